"""The driver's engine: stage 0 here, every later stage on the holders of the lease's route.

A worker that holds the first stage plays its leases as any worker does (`envs/player.py`);
only its engine differs. `generate` embeds and runs the first stage on a left-padded batch,
sends the hidden states through each later stage's holder in turn (`worker/stage_server.py`),
and the last holder samples a token per sequence; each decode step goes round the route again
with one position per sequence, so a batch of B sequences costs one round trip per stage per
token, whatever B is. The sampling loop, its EOS handling and the cut into completions are the
`hf` engine's own (`engines/sampling.py`).

A hop that fails (unreachable, refused, a malformed answer) raises `HopFailed`: the worker
reports it and drops the lease, and the coordinator re-leases its slots on another route. At the
end of each generation every holder's signed per-row commitments are collected, and each row's
trace (the commitments and the bytes they cover) waits for its rollout (`take_trace`). Each
decode step's round trip to each hop is timed (`hop_timer`) and goes to the coordinator with the
next lease request, which routes this driver's later leases by it.
"""

from __future__ import annotations

import base64
import secrets
import threading
import time

import httpx
import torch
from pydantic import ValidationError

from decentrl.client import CoordinatorClient
from decentrl.engines.base import Completion
from decentrl.engines.sampling import check_prompts, completions, left_pad_ids
from decentrl.model.boundary_codec import BoundaryDataError, Codec, decode, encode
from decentrl.model.stage_session import StageSession
from decentrl.protocol import HopRecord, Lease, RouteHop, SamplingParams, StageTrace
from decentrl.stage_wire import (
    CloseRequest,
    Commitment,
    Commitments,
    HopFailure,
    StepAnswer,
    StepRequest,
    commitment_bytes,
    pack,
    relay_path,
    sampled_bytes,
    unpack,
)
from decentrl.trust.identity import Signer, signature_valid
from decentrl.worker.hop_timer import HopTimer
from decentrl.worker.stage_versions import StageVersions

HOP_TIMEOUT_SECONDS = 30.0


class HopFailed(RuntimeError):
    reason: HopFailure

    def __init__(self, hop: RouteHop, reason: HopFailure, detail: str):
        where = "through the relay" if hop.relayed else f"at {hop.url}"
        super().__init__(f"stage {hop.stage} holder {hop.worker_id} {where}: {reason} ({detail})")
        self.hop, self.reason, self.detail = hop, reason, detail


class VersionGone(RuntimeError):
    """The driver no longer holds its lease's version (newer ones pushed it out of the window)."""


class PipelineEngine:
    def __init__(
        self,
        versions: StageVersions,
        signer: Signer,
        eos_token_ids: list[int],
        pad_token_id: int,
        codec: Codec = "bfloat16",
        coordinator: CoordinatorClient | None = None,
    ):
        """`coordinator`: whose relay carries the steps of relayed hops (holders behind NAT)."""
        assert versions.stage.is_first, "the driver holds the first stage"
        self.versions = versions
        self.stage = versions.stage
        self.eos_token_ids = list(eos_token_ids)
        self.pad_token_id = pad_token_id
        self.codec: Codec = codec
        self.serves_adapters = True
        self.device = versions.stage.device
        self.lease: Lease | None = None
        self.traces: list[tuple[tuple[int, ...], tuple[int, ...], StageTrace]] = []
        """(prompt, completion, its trace) of every generation of the bound lease."""
        self.bytes_sent = 0
        self.hop_timer = HopTimer()
        """Each hop's decode-step round trips, sent with the next lease request (`worker/loop.py`)."""
        self.coordinator = coordinator
        self.http = httpx.Client(auth=signer, timeout=HOP_TIMEOUT_SECONDS)
        self._lock = threading.Lock()  # a weight swap never interleaves with a generation

    @property
    def policy_version(self) -> int:
        """The newest version of the first stage held (what the next lease is asked at)."""
        return self.versions.policy_version

    def bind(self, lease: Lease) -> bool:
        """The lease whose route the next generations run through, at its version; False when
        this driver no longer holds that version (the lease is then given up)."""
        assert lease.route and lease.policy_version is not None, "a driver's lease names a route"
        self.lease = lease
        self.traces = []
        return lease.policy_version in self.versions.held()

    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        with self._lock:
            self.versions.load_weights(state_dict, version)

    def update_weights(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        with self._lock:
            self.versions.update_weights(tensors, version)

    @torch.no_grad()
    def generate(
        self, prompts: list[list[int]], sampling: SamplingParams, seed: int | None = None
    ) -> list[Completion]:
        check_prompts(prompts)
        assert self.lease is not None and self.lease.route, "bind a lease before generating"
        with self._lock:
            if not self.versions.ensure(self.version):
                raise VersionGone(
                    f"the first stage no longer holds v{self.version} (held: {self.versions.held()})"
                )
            return self._generate(prompts, sampling, seed if seed is not None else secrets.randbits(62))

    @property
    def version(self) -> int:
        assert self.lease is not None and self.lease.policy_version is not None
        return self.lease.policy_version

    def _generate(self, prompts: list[list[int]], sampling: SamplingParams, seed: int) -> list[Completion]:
        assert self.lease is not None and self.lease.route
        route, session = self.lease.route, secrets.token_hex(8)
        self._sent = [[[] for _ in prompts] for _ in route]  # per hop, per row: payload per step
        self._answered = [[[] for _ in prompts] for _ in route]
        local = StageSession(self.stage)
        ids_bt = left_pad_ids(prompts, self.pad_token_id)
        lengths = [len(p) for p in prompts]
        hidden = local.prefill(ids_bt, lengths)
        token_b, logprob_b = self._round(route, session, 0, hidden, lengths, sampling.temperature, seed)
        tokens, logprobs = [token_b], [logprob_b]
        done_b = torch.zeros(len(prompts), dtype=torch.bool)
        eos_e = torch.tensor(self.eos_token_ids)
        for step in range(1, sampling.max_new_tokens + 1):
            token_b = torch.where(done_b, torch.full_like(token_b, self.pad_token_id), token_b)
            tokens[-1] = token_b
            done_b |= torch.isin(token_b, eos_e)
            if bool(done_b.all()) or step == sampling.max_new_tokens:
                break
            hidden = local.decode(token_b[:, None])
            token_b, logprob_b = self._round(route, session, step, hidden, None, None, None)
            tokens.append(token_b)
            logprobs.append(logprob_b)
        # a failed hop is not closed: its holder drops the session when idle
        commitments = self._close(route, session)
        done = completions(
            torch.stack(tokens, 1).tolist(),
            torch.stack(logprobs, 1).tolist(),
            self.eos_token_ids,
            self.version,
        )
        width = ids_bt.shape[1]
        for row, (prompt, completion) in enumerate(zip(prompts, done, strict=True)):
            hops = [
                self._hop_record(hop, commitments[index][row], index, row) for index, hop in enumerate(route)
            ]
            trace = StageTrace(codec=self.codec, width=width, prompt_length=len(prompt), hops=hops)
            self.traces.append((tuple(prompt), tuple(completion.token_ids), trace))
        return done

    def _hop_record(self, hop: RouteHop, commitment: Commitment, index: int, row: int) -> HopRecord:
        return HopRecord(
            stage=hop.stage,
            holder_id=hop.worker_id,
            session=commitment.session,
            row=row,
            version=commitment.version,
            steps=commitment.steps,
            input_chain=commitment.input_chain,
            output_chain=commitment.output_chain,
            signature=commitment.signature,
            inputs=base64.b64encode(b"".join(self._sent[index][row])).decode(),
            outputs=base64.b64encode(b"".join(self._answered[index][row])).decode(),
        )

    def take_trace(self, prompt: list[int], token_ids: list[int]) -> StageTrace | None:
        """The trace of a generation of `token_ids` after `prompt` (one with that content, once)."""
        key = (tuple(prompt), tuple(token_ids))
        for index, (p, t, trace) in enumerate(self.traces):
            if (p, t) == key:
                del self.traces[index]
                return trace
        return None

    def _round(
        self,
        route: list[RouteHop],
        session: str,
        step: int,
        hidden_btd: torch.Tensor,
        lengths: list[int] | None,
        temperature: float | None,
        seed: int | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One step through every later stage: the last one's sampled tokens and log-probs."""
        for index, hop in enumerate(route):
            last = index == len(route) - 1
            request = StepRequest(
                lease_id=self.lease.lease_id if self.lease else "",
                session=session,
                step=step,
                version=self.version,
                codec=self.codec,
                shape=list(hidden_btd.shape),
                prompt_lengths=lengths,
                temperature=temperature if last else None,
                seed=seed if last else None,
            )
            rows = [encode(hidden_btd[row : row + 1], self.codec) for row in range(hidden_btd.shape[0])]
            for row, chunk in enumerate(rows):
                self._sent[index][row].append(chunk)
            sent = time.perf_counter()
            answer, data = self._post(hop, "/stage/step", pack(request, b"".join(rows)))
            if step > 0:  # the prefill carries the whole prompt once; a decode step is paid per token
                self.hop_timer.record(request.lease_id, hop, time.perf_counter() - sent)
            answer = StepAnswer.model_validate_json(answer)
            if answer.step != step or answer.version != self.version:
                raise HopFailed(hop, "bad_answer", f"answered step {answer.step} at v{answer.version}")
            if last:
                batch = hidden_btd.shape[0]
                if (
                    answer.token_ids is None
                    or answer.logprobs is None
                    or len(answer.token_ids) != batch
                    or len(answer.logprobs) != batch
                ):
                    raise HopFailed(hop, "bad_answer", "the last stage answered no token per sequence")
                for row, (token, logprob) in enumerate(zip(answer.token_ids, answer.logprobs, strict=True)):
                    self._answered[index][row].append(sampled_bytes(token, logprob))
                # float64 as answered: the rollout's claimed log-probs are exactly the committed ones
                return torch.tensor(answer.token_ids), torch.tensor(answer.logprobs, dtype=torch.float64)
            if answer.shape != list(hidden_btd.shape) or answer.codec != self.codec:
                raise HopFailed(hop, "bad_answer", f"answered shape {answer.shape} in {answer.codec}")
            try:
                size = len(data) // max(1, hidden_btd.shape[0])
                answered = [data[r * size : (r + 1) * size] for r in range(hidden_btd.shape[0])]
                hidden_btd = torch.cat(
                    [decode(chunk, self.codec, (1, *hidden_btd.shape[1:])) for chunk in answered]
                )
                for row, chunk in enumerate(answered):
                    self._answered[index][row].append(chunk)
            except BoundaryDataError as exc:
                raise HopFailed(hop, "bad_answer", str(exc)) from None
        raise AssertionError("a route has at least one hop")

    def _post(self, hop: RouteHop, path: str, body: bytes) -> tuple[bytes, bytes]:
        try:
            if hop.relayed:
                response = self._post_relayed(hop, path, body)
            else:
                assert hop.url is not None, "a direct hop names the holder's address"
                response = self.http.post(hop.url + path, content=body)
        except httpx.HTTPError as exc:
            raise HopFailed(hop, "unreachable", f"{type(exc).__name__}: {exc}") from None
        self.bytes_sent += len(body)
        if hop.relayed and response.status_code in (503, 504):  # the relay: no holder, or no answer
            raise HopFailed(hop, "unreachable", f"relay {response.status_code}: {response.text[:200]}")
        if response.status_code == 409 and b"version" in response.content:
            raise HopFailed(hop, "version_mismatch", response.text[:200])
        if response.status_code != 200:
            raise HopFailed(hop, "refused", f"{response.status_code}: {response.text[:200]}")
        if path == "/stage/close":
            return response.content, b""
        try:
            return unpack(response.content)
        except ValueError as exc:
            raise HopFailed(hop, "bad_answer", str(exc)) from None

    def _post_relayed(self, hop: RouteHop, path: str, body: bytes) -> httpx.Response:
        """The same request through the coordinator's relay: signed for the relay's path, which
        names the holder and the lease, and carrying this worker's coordinator token."""
        assert self.lease is not None
        if self.coordinator is None or self.coordinator.token is None:
            raise HopFailed(
                hop, "unreachable", "the hop is relayed, and this driver has no coordinator to relay"
            )
        url = self.coordinator.url + relay_path(hop.worker_id, self.lease.lease_id, path.rsplit("/", 1)[1])
        return self.http.post(
            url, content=body, headers={"Authorization": f"Bearer {self.coordinator.token}"}
        )

    def _close(self, route: list[RouteHop], session: str) -> list[list[Commitment]]:
        """Every holder's signed per-row commitments for the session (each checked under its key)."""
        assert self.lease is not None
        collected = []
        for hop in route:
            close = pack(CloseRequest(lease_id=self.lease.lease_id, session=session))
            content, _ = self._post(hop, "/stage/close", close)
            try:
                commitments = Commitments.model_validate_json(content).commitments
            except ValidationError as exc:
                detail = f"malformed commitments: {str(exc).splitlines()[0]}"
                raise HopFailed(hop, "bad_answer", detail) from None
            rows = len(self._sent[0])
            if len(commitments) != rows or any(
                c.holder_id != hop.worker_id
                or c.row != row
                or c.session != session
                or not signature_valid(hop.public_key, c.signature, commitment_bytes(c))
                for row, c in enumerate(commitments)
            ):
                raise HopFailed(
                    hop, "bad_answer", "its commitments are not one per row, signed by its registered key"
                )
            collected.append(commitments)
        return collected
