"""Checks of a staged rollout's traces at ingestion: what each stage holder committed to is what
passed between the stages, and what the rollout claims (docs/pipeline.md, "Trust per stage").

A driver's rollout carries, per model segment, each route holder's signed per-row commitment and
the bytes it covers (`stage_wire.py`). Before anything costly, for every segment:

- the hops are the lease's route (stage by stage, the holders and the version it was granted at),
  and every model token claims that version;
- each commitment verifies under its holder's registered key, and its chains are the chains of
  the bytes beside it (so those bytes are what the holder received and answered);
- what stage s received is byte for byte what stage s - 1 answered (only the driver passes data
  between holders: a difference is the driver's doing);
- the last stage's sampled tokens and log-probs are the segment's, token for token.

A failure refuses the submission (`stage_trace`, a strike on the driver: only it composes the
rollout). What these checks cannot see, a holder computing its stage wrongly on the inputs it
committed to, is the verifier's part: it recomputes each stage on those inputs and blames the
first that diverges. Traces are kept only for the rollouts picked for verification. No torch.
"""

from __future__ import annotations

import base64
import binascii
import json
from functools import lru_cache
from pathlib import Path

from decentrl.coordinator.context import Context
from decentrl.coordinator.http.errors import ApiError, Reason
from decentrl.dbapi import Connection
from decentrl.protocol import HopRecord, Rollout, Segment, StageTrace
from decentrl.stage_wire import (
    SAMPLED_BYTES,
    Commitment,
    bytes_per_token,
    chain_over,
    chain_start,
    commitment_bytes,
    sampled_values,
)
from decentrl.trust.identity import signature_valid


def _refuse(detail: str) -> ApiError:
    return ApiError(422, detail, Reason.STAGE_TRACE)


def _bytes(text: str, what: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise _refuse(f"{what} is not base64") from None


def _steps(data: bytes, sizes: list[int], what: str) -> list[bytes]:
    if len(data) != sum(sizes):
        raise _refuse(f"{what} has {len(data)} bytes; {len(sizes)} steps of this shape take {sum(sizes)}")
    pieces, offset = [], 0
    for size in sizes:
        pieces.append(data[offset : offset + size])
        offset += size
    return pieces


@lru_cache(maxsize=8)
def _hidden_size(model_dir: Path) -> int:
    return int(json.loads((model_dir / "config.json").read_text())["hidden_size"])


def check_traces(db: Connection, context: Context, rollout: Rollout) -> None:
    """Refuse (422 `stage_trace`) a staged rollout whose traces do not hold together."""
    route = db.execute(
        "SELECT stage, worker_id, version FROM lease_routes WHERE lease_id = ? ORDER BY stage",
        (rollout.lease_id,),
    ).fetchall()
    if not route:  # a whole-model worker's lease (or an unstaged run): nothing was routed
        if rollout.stage_traces is not None:
            raise _refuse("stage traces came with a lease that was not routed through stage holders")
        return
    traces = list(rollout.stage_traces or [])
    model_segments = sum(segment.source == "model" for segment in rollout.segments)
    if len(traces) != model_segments:
        raise _refuse(f"{model_segments} model segments came with {len(traces)} stage traces")
    keys = {
        row["worker_id"]: row["public_key"]
        for row in db.execute(
            "SELECT k.worker_id, k.public_key FROM worker_keys k JOIN lease_routes r"
            " ON r.worker_id = k.worker_id WHERE r.lease_id = ?",
            (rollout.lease_id,),
        )
    }
    hidden_size = _hidden_size(context.model_dir)
    codec = context.run.model.stage_codec
    context_length = len(rollout.prompt_token_ids)
    for segment in rollout.segments:
        if segment.source == "model":
            trace = traces.pop(0)
            _segment(rollout.lease_id, route, keys, segment, trace, context_length, hidden_size, codec)
        context_length += len(segment.token_ids)


def _segment(
    lease_id: str,
    route: list,
    keys: dict[str, str],
    segment: Segment,
    trace: StageTrace,
    context_length: int,
    hidden_size: int,
    codec: str,
) -> None:
    version = route[0]["version"]
    if trace.codec != codec:
        raise _refuse(f"a trace in codec {trace.codec!r}; this run's stages speak {codec!r}")
    if [(h.stage, h.holder_id) for h in trace.hops] != [(r["stage"], r["worker_id"]) for r in route]:
        raise _refuse("a trace's hops are not the lease's route")
    if any(v != version for v in segment.policy_versions or []) or any(
        h.version != version for h in trace.hops
    ):
        raise _refuse(f"a routed lease's tokens and holders are all at its version {version}")
    if trace.prompt_length > trace.width:
        raise _refuse("a trace's prompt is longer than its prefill")
    steps = trace.hops[0].steps
    if any(h.steps != steps for h in trace.hops) or steps < len(segment.token_ids):
        raise _refuse(
            f"the hops' steps differ or are fewer than the segment's {len(segment.token_ids)} tokens"
        )
    token_bytes = bytes_per_token(trace.codec, hidden_size)
    hidden_sizes = [trace.width * token_bytes] + [token_bytes] * (steps - 1)
    answered_before: list[bytes] | None = None
    for index, hop in enumerate(trace.hops):
        last = index == len(trace.hops) - 1
        received = _steps(_bytes(hop.inputs, "a hop's inputs"), hidden_sizes, f"stage {hop.stage}'s inputs")
        out_sizes = [SAMPLED_BYTES] * steps if last else hidden_sizes
        answered = _steps(_bytes(hop.outputs, "a hop's outputs"), out_sizes, f"stage {hop.stage}'s answers")
        _commitment(lease_id, keys, hop, received, answered)
        if answered_before is not None and received != answered_before:
            raise _refuse(f"stage {hop.stage} received other bytes than stage {hop.stage - 1} answered")
        answered_before = answered
        if last:
            sampled = sampled_values(b"".join(answered))
            claimed = list(zip(segment.token_ids, segment.logprobs or [], strict=False))
            if sampled[: len(claimed)] != claimed or len(claimed) != len(segment.token_ids):
                raise _refuse(f"the segment's tokens or log-probs are not what stage {hop.stage} sampled")
    if trace.prompt_length != context_length:
        raise _refuse(
            f"a trace's prompt has {trace.prompt_length} tokens; the segment follows {context_length}"
        )


def _commitment(
    lease_id: str, keys: dict[str, str], hop: HopRecord, received: list[bytes], answered: list[bytes]
) -> None:
    commitment = Commitment(
        holder_id=hop.holder_id,
        stage=hop.stage,
        lease_id=lease_id,
        session=hop.session,
        row=hop.row,
        version=hop.version,
        steps=hop.steps,
        input_chain=hop.input_chain,
        output_chain=hop.output_chain,
    )
    key = keys.get(hop.holder_id)
    if key is None or not signature_valid(key, hop.signature, commitment_bytes(commitment)):
        raise _refuse(f"stage {hop.stage}'s commitment is not signed by {hop.holder_id}'s registered key")
    start_in = chain_start(lease_id, hop.session, hop.stage, hop.row, "in")
    start_out = chain_start(lease_id, hop.session, hop.stage, hop.row, "out")
    if (
        chain_over(start_in, received) != hop.input_chain
        or chain_over(start_out, answered) != hop.output_chain
    ):
        raise _refuse(f"stage {hop.stage}'s bytes are not the ones its holder committed to")
