"""A stage holder's server: its stage's prefill and decode steps for the drivers routed through it.

`POST /stage/step` runs one step of a session (a batch of sequences of one lease) on this stage
with the session's own KV cache; `POST /stage/close` ends the session and answers the holder's
signed commitment to what it received and answered (`stage_wire.py`). Plain `http.server` in
daemon threads, as the chunk server; steps run one at a time (the stage is CPU or GPU bound, and
one step carries a whole batch of sequences).

Every request is signed by the lease's driver (`trust/identity.py` headers). The holder asks the
coordinator who drives a lease (`/v1/stages/leases/{id}`: only a holder on the lease's route gets
an answer) and checks the signature under that driver's registered key, the timestamp window and
the nonce, and that steps come in order. What arrives is bounded before any compute: the batch,
the shape against the model's width, the byte count against the codec, and finite values.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from typing import cast

import torch
from pydantic import ValidationError

from decentrl.client import CoordinatorClient, RequestRejected
from decentrl.engines.sampling import sample_next
from decentrl.model.boundary_codec import BoundaryDataError, Codec, decode, encode
from decentrl.model.stage_session import StageSession
from decentrl.stage_wire import (
    MAX_BATCH,
    CloseRequest,
    Commitment,
    Commitments,
    RelayedRequest,
    StageLeaseInfo,
    StepAnswer,
    StepRequest,
    chain_next,
    chain_start,
    commitment_bytes,
    pack,
    relay_path,
    sampled_bytes,
    unpack,
)
from decentrl.trust.identity import (
    NONCE_HEADER,
    SIGNATURE_HEADER,
    SIGNED_HEADERS,
    TIMESTAMP_HEADER,
    signature_valid,
    signed_message,
)
from decentrl.trust.replay_guard import ReplayGuard
from decentrl.weights.peer_server import SOCKET_TIMEOUT_SECONDS, BoundedServer
from decentrl.worker.stage_versions import StageVersions

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 256 << 20
SESSION_IDLE_SECONDS = 60.0
"""A session no step has touched for this long is dropped (its driver is gone)."""
MAX_SESSIONS = 64
CLOCK_SKEW_SECONDS = 120.0


class StepRefused(Exception):
    def __init__(self, status: int, detail: str):
        super().__init__(detail)
        self.status = status


@dataclass
class Session:
    lease_id: str
    version: int
    rows: int
    prompt_lengths: list[int]
    compute: StageSession
    generator: torch.Generator | None
    temperature: float
    input_chains: list[str]
    output_chains: list[str]
    steps: int = 0
    touched: float = field(default_factory=time.monotonic)


class StageServer:
    def __init__(
        self,
        versions: StageVersions,
        client: CoordinatorClient,
        holder_id: str,
        host: str = "127.0.0.1",
        port: int = 0,
        listen: bool = True,
    ):
        """`listen=False`: open no port (behind NAT); steps arrive through the relay alone
        (`handle_relayed`, fed by `worker/stage_relay_link.py`)."""
        self.versions = versions
        self.stage = versions.stage.stage  # its index in the stage map
        self.client = client
        self.holder_id = holder_id
        self.sessions: dict[str, Session] = {}
        self.leases: dict[str, StageLeaseInfo] = {}
        self.guard = ReplayGuard(CLOCK_SKEW_SECONDS)
        self.compute = threading.Lock()
        self.positions_served = 0
        self.compute_seconds = 0.0
        self.http = BoundedServer((host, port), self._handler()) if listen else None

    @property
    def url(self) -> str | None:
        if self.http is None:
            return None
        host, port = self.http.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> StageServer:
        if self.http is not None:
            threading.Thread(target=self.http.serve_forever, name="stage-server", daemon=True).start()
        return self

    def close(self) -> None:
        if self.http is not None:
            self.http.shutdown()
            self.http.server_close()

    def tokens_per_second(self) -> float:
        return self.positions_served / self.compute_seconds if self.compute_seconds > 0 else 0.0

    # ---------------------------------------------------------------- requests

    def handle(
        self, path: str, headers: Mapping[str, str], body: bytes, signed_path: str | None = None
    ) -> tuple[int, bytes]:
        """One driver request for `path` (`/stage/step` or `/stage/close`): the HTTP status and body
        of the answer. `signed_path` is the path the driver signed when the request came through
        the relay (it names this holder and the lease); a direct request signs `path` itself."""
        try:
            if not 0 < len(body) <= MAX_BODY_BYTES:
                raise StepRefused(413, f"a stage request is 1 to {MAX_BODY_BYTES} bytes")
            header, payload = unpack(body)
            if path == "/stage/step":
                request: StepRequest | CloseRequest = StepRequest.model_validate_json(header)
            elif path == "/stage/close":
                request = CloseRequest.model_validate_json(header)
            else:
                raise StepRefused(404, f"no {path} here")
            action = path.rsplit("/", 1)[1]
            if signed_path is not None and signed_path != relay_path(
                self.holder_id, request.lease_id, action
            ):
                raise StepRefused(
                    403, f"the relayed request was signed for {signed_path}, not this holder's lease"
                )
            info = self.authorise(request.lease_id, "POST", signed_path or path, headers, body)
            if isinstance(request, StepRequest):
                return 200, self.step(request, payload, info)
            return 200, self.close_session(request)
        except StepRefused as exc:
            return exc.status, str(exc).encode()
        except (ValidationError, ValueError) as exc:
            return 422, f"malformed stage request: {str(exc).splitlines()[0]}".encode()

    def handle_relayed(self, relayed: RelayedRequest) -> tuple[int, bytes]:
        """A request the coordinator's relay handed over: the path the driver signed ends in the
        action (`stage_wire.relay_path`)."""
        action = relayed.path.rsplit("/", 1)[-1]
        return self.handle(f"/stage/{action}", relayed.headers, relayed.body, signed_path=relayed.path)

    def authorise(
        self, lease_id: str, method: str, path: str, headers: Mapping[str, str], body: bytes
    ) -> StageLeaseInfo:
        """The lease's driver signed this request, freshly; else StepRefused."""
        info = self.leases.get(lease_id)
        if info is None:
            try:
                info = self.client.stage_lease(lease_id)
            except RequestRejected as exc:
                raise StepRefused(
                    403, f"the coordinator routed no lease {lease_id!r} here: {exc.detail}"
                ) from None
            self.leases[lease_id] = info
        timestamp, nonce = headers.get(TIMESTAMP_HEADER, ""), headers.get(NONCE_HEADER, "")
        message = signed_message(method, path, timestamp, nonce, body)
        if not signature_valid(info.driver_public_key, headers.get(SIGNATURE_HEADER, ""), message):
            raise StepRefused(401, "the request is not signed by the lease's driver")
        refusal = self.guard.check(info.driver_id, timestamp, nonce, time.time())
        if refusal is not None:
            raise StepRefused(401, refusal.detail)
        if time.time() > info.deadline_unix:
            raise StepRefused(410, f"lease {lease_id} is past its deadline")
        return info

    def step(self, request: StepRequest, payload: bytes, info: StageLeaseInfo) -> bytes:
        if self.stage not in info.stages:
            raise StepRefused(403, f"lease {request.lease_id} is not routed through stage {self.stage} here")
        if request.version != info.version:
            raise StepRefused(
                409, f"the lease is at version {info.version}, the step names {request.version}"
            )
        batch, width, hidden = request.shape
        if not 1 <= batch <= MAX_BATCH or hidden != self.versions.hidden_size or width < 1:
            raise StepRefused(
                422, f"shape {request.shape} does not fit a batch of hidden size {self.versions.hidden_size}"
            )
        session = self._session(request, batch, width)
        try:
            rows = [decode(chunk, request.codec, (1, width, hidden)) for chunk in _split(payload, batch)]
        except BoundaryDataError as exc:
            raise StepRefused(422, str(exc)) from None
        for row, chunk in enumerate(_split(payload, batch)):
            session.input_chains[row] = chain_next(session.input_chains[row], chunk)
        with self.compute:
            started = time.perf_counter()
            if not self.versions.ensure(session.version):
                raise StepRefused(
                    409, f"version {session.version} is no longer held (held: {self.versions.held()})"
                )
            inputs = torch.cat(rows)
            if request.step == 0:
                output = session.compute.prefill(inputs, session.prompt_lengths)
            else:
                output = session.compute.decode(inputs)
            answer = self._answer(request, session, output)
            self.compute_seconds += time.perf_counter() - started
            self.positions_served += batch * width
        session.steps += 1
        session.touched = time.monotonic()
        return answer

    def _answer(self, request: StepRequest, session: Session, output: torch.Tensor) -> bytes:
        header = StepAnswer(session=request.session, step=request.step, version=session.version)
        if self.versions.is_last:
            header.token_ids, header.logprobs = self.sample(session, output[:, -1])
            for row, (token, logprob) in enumerate(zip(header.token_ids, header.logprobs, strict=True)):
                session.output_chains[row] = chain_next(
                    session.output_chains[row], sampled_bytes(token, logprob)
                )
            return pack(header)
        codec = cast(Codec, request.codec)  # `step` decoded the payload with it: a known codec
        chunks = [encode(output[row : row + 1], codec) for row in range(output.shape[0])]
        for row, chunk in enumerate(chunks):
            session.output_chains[row] = chain_next(session.output_chains[row], chunk)
        header.codec, header.shape = request.codec, list(output.shape)
        return pack(header, b"".join(chunks))

    def sample(self, session: Session, logits_bv: torch.Tensor) -> tuple[list[int], list[float]]:
        """The last stage's draw: a token per sequence and its log-prob (the `hf` engine's step)."""
        assert session.generator is not None
        token_b, logprob_b = sample_next(logits_bv, session.temperature, session.generator)
        return token_b.tolist(), logprob_b.tolist()

    def _session(self, request: StepRequest, batch: int, width: int) -> Session:
        session = self.sessions.get(request.session)
        if request.step == 0:
            if session is not None:
                raise StepRefused(409, f"session {request.session} has already started")
            lengths = request.prompt_lengths
            if lengths is None or len(lengths) != batch or not all(1 <= n <= width for n in lengths):
                raise StepRefused(422, "step 0 names each row's prompt length (1 to the width)")
            if self.versions.is_last and (request.temperature is None or request.seed is None):
                raise StepRefused(422, "the last stage samples: step 0 names the temperature and the seed")
            self._drop_idle()
            if len(self.sessions) >= MAX_SESSIONS:
                raise StepRefused(503, f"{MAX_SESSIONS} sessions are open here; retry shortly")
            generator = None
            if self.versions.is_last:
                assert request.seed is not None  # refused above otherwise
                generator = torch.Generator().manual_seed(request.seed)
            session = Session(
                lease_id=request.lease_id,
                version=request.version,
                rows=batch,
                prompt_lengths=lengths,
                compute=StageSession(self.versions.stage),
                generator=generator,
                temperature=request.temperature or 0.0,
                input_chains=[
                    chain_start(request.lease_id, request.session, self.stage, r, "in") for r in range(batch)
                ],
                output_chains=[
                    chain_start(request.lease_id, request.session, self.stage, r, "out") for r in range(batch)
                ],
            )
            self.sessions[request.session] = session
            return session
        if session is None or session.lease_id != request.lease_id:
            raise StepRefused(404, f"no session {request.session} of lease {request.lease_id} here")
        if request.step != session.steps or width != 1 or batch != session.rows:
            raise StepRefused(
                409,
                f"session {request.session} expects step {session.steps} of {session.rows} rows, one position",
            )
        return session

    def close_session(self, request: CloseRequest) -> bytes:
        session = self.sessions.pop(request.session, None)
        if session is None or session.lease_id != request.lease_id:
            raise StepRefused(404, f"no session {request.session} of lease {request.lease_id} here")
        key = self.client_signer().key
        commitments = []
        for row in range(session.rows):
            commitment = Commitment(
                holder_id=self.holder_id,
                stage=self.stage,
                lease_id=request.lease_id,
                session=request.session,
                row=row,
                version=session.version,
                steps=session.steps,
                input_chain=session.input_chains[row],
                output_chain=session.output_chains[row],
            )
            commitment.signature = key.sign(commitment_bytes(commitment)).hex()
            commitments.append(commitment)
        return Commitments(commitments=commitments).model_dump_json().encode()

    def client_signer(self):  # noqa: ANN201 - trust.identity.Signer
        assert self.client.signer is not None, "a holder signs with its worker key"
        return self.client.signer

    def _drop_idle(self) -> None:
        cutoff = time.monotonic() - SESSION_IDLE_SECONDS
        for name in [name for name, s in self.sessions.items() if s.touched < cutoff]:
            del self.sessions[name]

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            timeout = SOCKET_TIMEOUT_SECONDS
            # A driver keeps one connection per holder: a step costs one round trip, not a TCP
            # handshake and a request (2.1 round trips per step measured with HTTP/1.0, 1.15 kept;
            # docs/pipeline.md). Nagle off: an answer's headers and body go in two sends, and the
            # body would otherwise wait for the driver's delayed ACK (40 ms) every step.
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True

            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                try:
                    length = int(self.headers.get("Content-Length", "0"))
                except ValueError:
                    length = -1
                if not 0 < length <= MAX_BODY_BYTES:  # refused before a byte of the body is read
                    self._send(413, f"a stage request is 1 to {MAX_BODY_BYTES} bytes".encode())
                    return
                headers = {name: self.headers.get(name, "") for name in SIGNED_HEADERS}
                self._send(*server.handle(self.path, headers, self.rfile.read(length)))

            def _send(self, status: int, data: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - http.server's name
                pass

        return Handler


def _split(payload: bytes, rows: int) -> list[bytes]:
    """The payload's equal per-row byte strings (each row is encoded on its own, `stage_wire.py`)."""
    if rows <= 0 or len(payload) % rows:
        raise StepRefused(422, f"a payload of {len(payload)} bytes does not split into {rows} equal rows")
    size = len(payload) // rows
    return [payload[i * size : (i + 1) * size] for i in range(rows)]
