"""Which stage of a staged rollout computed wrongly: each stage recomputed on its committed inputs.

The coordinator has checked that a trace's bytes are what each holder committed to and that they
chain from stage to stage (`coordinator/trust/stage_traces.py`). Here the trusted verifier, which
holds the whole claimed version, runs each stage on exactly what that stage received (teacher
forced, one pass over the row's positions) and compares with what it answered:

- stage 0 (the driver): its output on the row's tokens against what stage 1 received;
- a middle stage: its output against what it answered, hidden state by hidden state;
- the last stage: the log-prob of each sampled token against the one it answered.

An honest stage differs only by the boundary codec's rounding of its answer (bfloat16 and
per-token int8 both round to within 2^-8 of a position's largest value) and by arithmetic order,
so a position whose largest deviation exceeds `BOUNDARY_TOLERANCE` of its largest value, or a
log-prob beyond `LOGPROB_TOLERANCE`, is that stage's doing: an honest stage given corrupted
inputs computes correctly on them, so blame lands on the first stage whose answer diverges and
never on a later honest one.
"""

from __future__ import annotations

import base64

import torch

from decentrl.algo.logprobs import logprobs_from_logits
from decentrl.model.boundary_codec import decode
from decentrl.model.stages import Stage
from decentrl.protocol import StageTrace, VerifyJob
from decentrl.stage_map import StageMap
from decentrl.stage_wire import bytes_per_token, sampled_values

BOUNDARY_TOLERANCE = {"float32": 1e-3, "bfloat16": 0.02, "int8": 0.02}
"""Largest |answered - recomputed| over a position, relative to that position's largest value.
The codec's own rounding is <= 2^-8 = 0.0039 (bfloat16, int8); measured on honest demo runs:
docs/pipeline.md. A corruption below this is a perturbation smaller than the codec's own."""
LOGPROB_TOLERANCE = 0.01
"""The last stage's answered log-prob against the recomputed one on the same inputs (float32)."""


def stages_over(model: torch.nn.Module, stage_map: StageMap) -> list[Stage]:
    """The stages of the verifier's whole model (every module real; each runs only its layers)."""
    names = list(model.state_dict())
    stages = [Stage(model, stage_map, s, stage_map.names(s, names)) for s in range(stage_map.num_stages)]  # type: ignore[arg-type]
    for stage in stages:
        stage.loaded = True  # the verifier loaded the claimed version into the whole model
    return stages


def _hidden(data: str, codec: str, hidden_size: int, width: int, steps: int) -> torch.Tensor:
    """A hop's hidden states of the first `steps` steps (the prefill's `width` positions, then one
    per step), as [1, width + steps - 1, D]: each step was encoded on its own (int8 has a scale
    block per encoding), so each is decoded on its own."""
    raw, size = base64.b64decode(data), bytes_per_token(codec, hidden_size)
    pieces, offset = [], 0
    for positions in [width] + [1] * (steps - 1):
        pieces.append(decode(raw[offset : offset + positions * size], codec, (1, positions, hidden_size)))
        offset += positions * size
    return torch.cat(pieces, dim=1)


def _deviation(answered_td: torch.Tensor, recomputed_td: torch.Tensor) -> float:
    scale_t = recomputed_td.abs().amax(-1).clamp(min=1e-6)
    return float(((answered_td - recomputed_td).abs().amax(-1) / scale_t).max())


@torch.no_grad()
def blame(stages: list[Stage], job: VerifyJob, pad_token_id: int) -> tuple[int, str] | None:
    """(stage, why) for the first stage of any model segment whose answer diverges; None if none."""
    assert job.stage_traces is not None
    context = list(job.prompt_token_ids)
    traces = iter(job.stage_traces)
    for segment in job.segments:
        if segment.source == "model":
            found = _segment(stages, next(traces), context, segment.token_ids, job.temperature, pad_token_id)
            if found is not None:
                return found
        context += segment.token_ids
    return None


def _segment(
    stages: list[Stage],
    trace: StageTrace,
    context: list[int],
    tokens: list[int],
    temperature: float,
    pad: int,
) -> tuple[int, str] | None:
    width, length, steps = trace.width, trace.prompt_length, len(tokens)
    ids_t = [pad] * (width - length) + context[-length:] + tokens[:-1]
    mask_t = torch.tensor([[0] * (width - length) + [1] * (length + steps - 1)])
    position_t = (mask_t.cumsum(-1) - 1).clamp(min=0)
    real = mask_t[0].bool()
    hidden_size = int(stages[0].config.hidden_size)
    tolerance = BOUNDARY_TOLERANCE[trace.codec]
    output = stages[0].forward(torch.tensor([ids_t]), mask_t, position_t, None)
    for index, hop in enumerate(trace.hops):
        received = _hidden(hop.inputs, trace.codec, hidden_size, width, steps)
        deviation = _deviation(received[0, real], output[0, real])
        if deviation > tolerance:
            stage = stages[index].stage
            return stage, f"stage {stage}'s answer deviates by {deviation:.3g} of its scale (> {tolerance:g})"
        stage = stages[index + 1]
        output = stage.forward(received, mask_t, position_t, None, logits_to_keep=0)
        if stage.is_last:
            sampled = sampled_values(base64.b64decode(hop.outputs))[:steps]
            logits_nv = output[0, width - 1 : width - 1 + steps].float()
            recomputed = logprobs_from_logits(logits_nv, torch.tensor(tokens), temperature)
            answered = torch.tensor([logprob for _, logprob in sampled], dtype=torch.float64)
            error = float((answered - recomputed.double()).abs().max())
            if error > LOGPROB_TOLERANCE:
                return (
                    stage.stage,
                    f"stage {stage.stage}'s log-probs err by {error:.3g} (> {LOGPROB_TOLERANCE:g})",
                )
            return None
        answered_out = _hidden(hop.outputs, trace.codec, hidden_size, width, steps)
        deviation = _deviation(answered_out[0, real], output[0, real])
        if deviation > tolerance:
            return (
                stage.stage,
                f"stage {stage.stage}'s answer deviates by {deviation:.3g} of its scale (> {tolerance:g})",
            )
        output = answered_out
    raise AssertionError("a route ends with the last stage")
