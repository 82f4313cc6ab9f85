"""`CoordinatorClient`: the one HTTP client of the coordinator, shared by workers, trainer and launchers.

Every call retries with exponential backoff and jitter while the coordinator is unreachable,
restarting or busy (connection errors, timeouts, truncated bodies, 502/503/504, 507 low disk, and
429 unless `retry_rate_limited` is off: waiting is what a rate limit asks for, at least its
`Retry-After`), and never retries an answer that says the request itself is wrong: any other
4xx/5xx raises `RequestRejected` with the server's detail. Retries are logged with their reason and counted on the client (`retries`, `retry_reasons`).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import httpx

from decentrl.envd_wire import (
    EnvLeaseInfo,
    EnvServerAnnounce,
    EnvServerInfo,
    EpisodeClaim,
    EpisodeFailed,
    EpisodeGrant,
)
from decentrl.protocol import (
    API_PREFIX,
    SERVER_TIME_HEADER,
    BatchAck,
    BatchRequest,
    Challenge,
    Lease,
    LeaseRequest,
    PeerAnnounce,
    PeerInfo,
    PeerReport,
    RegisterRequest,
    RegisterResponse,
    RolloutSubmission,
    ScoreJobs,
    ScoreJobsRequest,
    ServerInfo,
    StepMetrics,
    SubmissionResult,
    TermScoreBatch,
    TrainBatch,
    TrainerKey,
    TrainerPeerAnnounce,
    TrainerRun,
    VerdictBatch,
    VerifyJobs,
    VerifyJobsRequest,
    WeightsEntry,
    WeightsInfo,
    Wire,
)
from decentrl.stage_wire import (
    RELAY_PATH_HEADER,
    RELAY_REQUEST_HEADER,
    RELAY_STATUS_HEADER,
    RelayedRequest,
    StageAnnounce,
    StageAnnounced,
    StageLeaseInfo,
    StageReport,
)
from decentrl.tls import verifying_context
from decentrl.trust.identity import SIGNED_HEADERS

if TYPE_CHECKING:
    from decentrl.trust.identity import Signer

log = logging.getLogger(__name__)

RETRY_STATUSES = frozenset({502, 503, 504, 507})
RATE_LIMITED = 429


WAITING_HEADER = "Decentrl-Waiting"  # coordinator/role_watch.py: what the run waits on
WAITING_REPEAT_SECONDS = 60.0
HINT_EVERY = 8
"""Failed connection attempts in one call between two "is the coordinator running at URL?" hints."""
RUN_HEADER = "Decentrl-Run"  # "complete" once the trainer has published its last version


class RequestRejected(Exception):
    """The coordinator answered with an error that retrying the same request cannot fix."""

    def __init__(self, status: int, detail: str):
        super().__init__(f"HTTP {status}: {detail}")
        self.status = status
        self.detail = detail


class CoordinatorUnavailable(Exception):
    """Retries ran out (the caller's `max_wait`, or its `interrupt` event was set) before an answer."""


def _retry_after(response: httpx.Response) -> float:
    try:
        return min(60.0, float(response.headers.get("Retry-After", 0)))
    except ValueError:
        return 0.0


def _detail(response: httpx.Response) -> str:
    try:
        detail = response.json().get("detail", response.text)
    except (ValueError, AttributeError):
        detail = response.text
    return str(detail)[:1000] or response.reason_phrase


class CoordinatorClient:
    def __init__(
        self,
        url: str,
        token: str | None = None,
        *,
        timeout: float = 60.0,
        base_delay: float = 0.1,
        max_delay: float = 10.0,
        max_wait: float | None = None,
        interrupt: threading.Event | None = None,
        interrupt_grace: float = 10.0,
    ):
        """`max_wait` bounds the total time one call spends retrying (None: retry until answered).
        Once `interrupt` is set, a call retries for at most `interrupt_grace` more seconds."""
        self.url = url.rstrip("/")
        self.token = token
        self.base_delay = base_delay
        self.max_delay = max_delay
        self.max_wait = max_wait
        self.interrupt = interrupt
        self.interrupt_grace = interrupt_grace
        self.retry_rate_limited = True
        """Wait and retry on 429 (off: raise `RequestRejected`, for clients that measure the limit)."""
        self.signer: Signer | None = None
        """A worker's request signer (`trust/identity.py`); every attempt is signed afresh."""
        self.renew_token: Callable[[], None] | None = None
        """Registers again and sets `token` (a worker's key keeps its identity, so its leases stay
        its own): called once when a request sent with `token` is refused with 401, then the
        request is sent again. One renewal for all threads: a request refused with a token that
        another thread has already replaced is just sent again with the new one."""
        self._renewing = threading.Lock()
        self.retries = 0
        self.retry_reasons: Counter[str] = Counter()
        self.waiting: str | None = None
        """What the run waits on, as the coordinator last said (`Decentrl-Waiting`), else None."""
        self._waiting_logged: tuple[str | None, float] = (None, 0.0)
        self.run_complete = False
        """Set by a 204 answer that says the run is complete: nothing more will be leased."""
        self._http = httpx.Client(base_url=self.url + API_PREFIX, timeout=timeout, verify=verifying_context())

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> CoordinatorClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ transport

    def _request(
        self, method: str, path: str, *, body: Wire | None = None, token: str | None = None, **kwargs: Any
    ) -> httpx.Response:
        """One call with retries; `check(response)` may return a reason to retry a 2xx answer."""
        check = kwargs.pop("check", None)
        headers = dict(kwargs.pop("headers", {}))
        sent = self.token if token is None else token  # "": no token at all
        if sent:
            headers["Authorization"] = f"Bearer {sent}"
        renewed = False
        if body is not None:
            kwargs["content"] = body.model_dump_json()
            headers["Content-Type"] = "application/json"
        started = time.monotonic()
        interrupted_at: float | None = None
        attempt = 0
        while True:
            try:
                response = self._http.request(method, path, headers=headers, auth=self.signer, **kwargs)
                if self._corrected_clock(response):
                    reason = "clock_skew"
                elif response.status_code in RETRY_STATUSES or (
                    response.status_code == RATE_LIMITED and self.retry_rate_limited
                ):
                    reason = f"HTTP {response.status_code}"
                    log.debug("%s %s: %s %s", method, path, reason, _detail(response))
                elif response.status_code == 401 and token is None and sent and not renewed:
                    renewed = True
                    sent = self._renewed_token(sent, RequestRejected(401, _detail(response)))
                    headers["Authorization"] = f"Bearer {sent}"
                    continue
                elif response.status_code >= 400:
                    raise RequestRejected(response.status_code, _detail(response))
                else:
                    reason = check(response) if check else None
                    if reason is None:
                        return response
            except httpx.TransportError as exc:
                reason = type(exc).__name__
                log.debug("%s %s: %s", method, path, exc)
                if attempt % HINT_EVERY == HINT_EVERY - 1:
                    log.warning(
                        "no answer from %s after %d attempts (%s): is the coordinator running at %s? "
                        "(its log says where it listens)",
                        self.url,
                        attempt + 1,
                        reason,
                        self.url,
                    )
            now = time.monotonic()
            delay = min(self.max_delay, self.base_delay * 2 ** min(attempt, 30)) * random.uniform(0.5, 1.0)
            if reason == f"HTTP {RATE_LIMITED}":
                delay = max(delay, _retry_after(response))
            if self.interrupt is not None and self.interrupt.is_set():
                interrupted_at = interrupted_at or now
                if now + delay > interrupted_at + self.interrupt_grace:
                    raise CoordinatorUnavailable(f"{method} {path}: interrupted; last failure: {reason}")
            if self.max_wait is not None and now + delay > started + self.max_wait:
                raise CoordinatorUnavailable(
                    f"{method} {path}: no answer within {self.max_wait:.0f}s "
                    f"({attempt + 1} attempts); last failure: {reason}"
                )
            attempt += 1
            self.retries += 1
            self.retry_reasons[reason] += 1
            log.warning("%s %s failed (%s); retry %d in %.2fs", method, path, reason, attempt, delay)
            time.sleep(delay)

    def _renewed_token(self, refused: str, rejection: RequestRejected) -> str:
        """The token to send again after `refused` was refused, or `rejection` raised when there is
        none (no `renew_token`, or registering again was refused too)."""
        if self.renew_token is None:
            raise rejection
        with self._renewing:
            if self.token == refused:  # nobody renewed it since: this thread does
                log.warning("credentials refused (%s); registering again", rejection.detail)
                try:
                    self.renew_token()
                except RequestRejected as again:
                    log.warning("registering again was refused: %s", again)
                    raise rejection from None
            if not self.token or self.token == refused:
                raise rejection
            return self.token

    def _corrected_clock(self, response: httpx.Response) -> bool:
        """On a 401 for our signature's timestamp, adopt the coordinator's clock; True to retry.
        Only once per distinct correction: a second refusal with the clock already adopted is real."""
        server_time = response.headers.get(SERVER_TIME_HEADER)
        if response.status_code != 401 or server_time is None or self.signer is None:
            return False
        try:
            offset = float(server_time) - time.time()
        except ValueError:
            return False
        if abs(offset - self.signer.offset) < 1.0:
            return False
        log.warning("the coordinator's clock is %.1fs from ours; signing with its time", offset)
        self.signer.offset = offset
        return True

    def _json(self, method: str, path: str, body: Wire | None = None, **kwargs: Any) -> Any:
        """Decoded JSON of a 200 answer, or None for 204."""
        response = self._request(method, path, body=body, **kwargs)
        if response.status_code == 204:
            self.run_complete = response.headers.get(RUN_HEADER) == "complete"
            self._note_waiting(response.headers.get(WAITING_HEADER))
            return None
        self._note_waiting(None)
        return response.json()

    def _note_waiting(self, waiting: str | None) -> None:
        """Log what the run waits on when it changes, and again every `WAITING_REPEAT_SECONDS`."""
        self.waiting = waiting
        said, at = self._waiting_logged
        now = time.monotonic()
        if waiting != said or (waiting and now - at >= WAITING_REPEAT_SECONDS):
            if waiting:
                log.warning("coordinator: %s", waiting)
            self._waiting_logged = (waiting, now)

    # ------------------------------------------------------------------ everyone

    def health(self) -> dict:
        return self._json("GET", "/health")

    def info(self) -> ServerInfo:
        return ServerInfo.model_validate(self._json("GET", "/info"))

    def stats(self) -> dict:
        return self._json("GET", "/stats")

    def latest_weights(self) -> WeightsInfo | None:
        """The newest published version, or None before the first one."""
        try:
            return WeightsInfo.model_validate(self._json("GET", "/weights/latest"))
        except RequestRejected as exc:
            if exc.status == 404:
                return None
            raise

    def weights_index(self) -> list[WeightsEntry]:
        """Every retained manifest (version, kind, payload bytes): the catch-up planner's input."""
        return [WeightsEntry.model_validate(entry) for entry in self._json("GET", "/weights/index")]

    def manifest_bytes(
        self, version: int, kind: str, anchor: int | None = None, stage: int | None = None
    ) -> bytes:
        """The manifest as sent (the caller parses and verifies its signature); a patch names its
        anchor, a stage trainer's manifest its stage."""
        params = _present(anchor=anchor, stage=stage)
        return self._request("GET", f"/weights/manifests/{version}/{kind}", params=params).content

    def chunk(self, sha256: str) -> bytes:
        """A chunk's bytes as served (a body cut short is retried; the caller checks the hash)."""
        return self._request("GET", f"/weights/chunks/{sha256}").content

    def request_snapshot(self) -> dict:
        """Ask for a full snapshot with the trainer's next version (idempotent)."""
        return self._json("POST", "/weights/snapshot-request")

    def announce_peer(self, announce: PeerAnnounce) -> list[PeerInfo]:
        data = self._json("POST", "/weights/peers", announce)
        return [PeerInfo.model_validate(peer) for peer in data["peers"]]

    def announce_trainer_peer(self, announce: TrainerPeerAnnounce) -> None:
        self._json("POST", "/weights/trainer-peers", announce)

    def peers(self) -> list[PeerInfo]:
        return [PeerInfo.model_validate(peer) for peer in self._json("GET", "/weights/peers")["peers"]]

    def report_peer(self, report: PeerReport) -> dict:
        return self._json("POST", "/weights/peers/report", report)

    def announce_stage(self, announce: StageAnnounce) -> StageAnnounced:
        return StageAnnounced.model_validate(self._json("POST", "/stages/announce", announce))

    def relay_exchange(self, answer: tuple[str, int, bytes] | None, wait: float) -> RelayedRequest | None:
        """A relayed holder's exchange: post the answer (request id, HTTP status, body) to the
        request it was handed last, and take the next one (None: none came within `wait` s)."""
        headers = {"Content-Type": "application/octet-stream"}
        content = b""
        if answer is not None:
            headers |= {RELAY_REQUEST_HEADER: answer[0], RELAY_STATUS_HEADER: str(answer[1])}
            content = answer[2]
        response = self._request(
            "POST", "/relay/exchange", params={"wait": wait}, headers=headers, content=content
        )
        if response.status_code == 204:
            return None
        return RelayedRequest(
            request_id=response.headers[RELAY_REQUEST_HEADER],
            path=response.headers[RELAY_PATH_HEADER],
            headers={name: response.headers.get(name, "") for name in SIGNED_HEADERS},
            body=response.content,
        )

    def stage_lease(self, lease_id: str) -> StageLeaseInfo:
        """Who drives a lease routed through this holder (`coordinator/stage_holders.py`)."""
        return StageLeaseInfo.model_validate(self._json("GET", f"/stages/leases/{lease_id}"))

    def report_stage(self, report: StageReport) -> dict:
        return self._json("POST", "/stages/report", report)

    def env_servers(self) -> list[EnvServerInfo]:
        """The run's live env servers (`decentrl envd`), for a worker of a served task."""
        return [EnvServerInfo.model_validate(s) for s in self._json("GET", "/envd/servers")["servers"]]

    def model_file(self, name: str) -> bytes:
        return self._request("GET", f"/model/files/{name}").content

    def data_file(self, digest: str) -> bytes:
        """A file the run's environment reads, by its sha256 (`envs/dataset.py`)."""
        return self._request("GET", f"/data/{digest}").content

    # ------------------------------------------------------------------ workers

    def register(self, request: RegisterRequest, enroll_token: str | None) -> RegisterResponse:
        """Register; with a signer, its key is registered with a signed server challenge as proof."""
        if self.signer is not None:
            answer = self._json("POST", "/workers/challenge", token="")  # anonymous: no worker token
            challenge = Challenge.model_validate(answer).challenge
            update = {"public_key": self.signer.public_key, "challenge": challenge}
            request = request.model_copy(update={**update, "proof": self.signer.prove(challenge)})
        return RegisterResponse.model_validate(
            self._json("POST", "/workers/register", request, token=enroll_token or "")
        )

    def lease(self, request: LeaseRequest) -> Lease | None:
        """A lease, or None when there is nothing to do (204)."""
        data = self._json("POST", "/leases", request)
        return None if data is None else Lease.model_validate(data)

    def submit_rollouts(self, submission: RolloutSubmission) -> SubmissionResult:
        return SubmissionResult.model_validate(self._json("POST", "/rollouts", submission))

    # ------------------------------------------------------------------ trainer

    def next_batch(self, request: BatchRequest) -> TrainBatch | None:
        data = self._json("POST", "/trainer/batches", request)
        return None if data is None else TrainBatch.model_validate(data)

    def local_lease(self, request: LeaseRequest) -> Lease | None:
        """A lease for the trainer's own rollouts (colocated mode), or None with no room (204)."""
        data = self._json("POST", "/trainer/leases", request)
        return None if data is None else Lease.model_validate(data)

    def submit_local_rollouts(self, submission: RolloutSubmission) -> SubmissionResult:
        """The trainer's own rollouts of one local lease; answered once they are committed."""
        return SubmissionResult.model_validate(self._json("POST", "/trainer/rollouts", submission))

    def ack_batch(self, batch_id: str, ack: BatchAck) -> dict:
        return self._json("POST", f"/trainer/batches/{batch_id}/ack", ack)

    def post_metrics(self, metrics: StepMetrics) -> list[str]:
        """Report a trainer step; returns the reward-hacking alarms it raised (docs/rewards.md)."""
        return list(self._json("POST", "/trainer/metrics", metrics).get("alarms", []))

    def report_run(self, run: TrainerRun) -> dict:
        """The trainer's settings and progress for the run directory; answers {"complete": bool}."""
        return self._json("PUT", "/trainer/run", run)

    def verify_jobs(self, request: VerifyJobsRequest) -> VerifyJobs:
        """Sampled rollouts for the trusted verifier (trainer token)."""
        return VerifyJobs.model_validate(self._json("POST", "/verifier/jobs", request))

    def post_verdicts(self, batch: VerdictBatch) -> dict:
        return self._json("POST", "/verifier/verdicts", batch)

    def score_jobs(self, request: ScoreJobsRequest) -> ScoreJobs:
        """Rollouts for the trusted reward scorer (trainer token)."""
        return ScoreJobs.model_validate(self._json("POST", "/scorer/jobs", request))

    def post_scores(self, batch: TermScoreBatch) -> dict:
        return self._json("POST", "/scorer/scores", batch)

    # ------------------------------------------------------------------ env servers (trainer token)

    def envd_announce(self, announce: EnvServerAnnounce) -> dict:
        return self._json("PUT", "/envd/servers", announce)

    def envd_lease(self, lease_id: str) -> EnvLeaseInfo:
        """Who holds a lease, with the key that signs its requests (`coordinator/env_servers.py`)."""
        return EnvLeaseInfo.model_validate(self._json("GET", f"/envd/leases/{lease_id}"))

    def envd_claim(
        self, server_id: str, lease_id: str, task_id: str, slot: int, env_version: str
    ) -> EpisodeGrant:
        claim = EpisodeClaim(
            server_id=server_id, lease_id=lease_id, task_id=task_id, slot=slot, env_version=env_version
        )
        return EpisodeGrant.model_validate(self._json("POST", "/envd/episodes", claim))

    def envd_failed(self, report: EpisodeFailed) -> dict:
        return self._json("POST", "/envd/failures", report)

    def register_trainer_key(self, key: TrainerKey) -> None:
        self._json("PUT", "/trainer/key", key)

    def upload_chunk(self, sha256: str, data: bytes | memoryview) -> None:
        headers = {"Content-Type": "application/octet-stream"}
        self._request("PUT", f"/weights/chunks/{sha256}", content=bytes(data), headers=headers)

    def upload_manifest(
        self,
        version: int,
        kind: str,
        manifest_json: bytes,
        anchor: int | None = None,
        stage: int | None = None,
    ) -> WeightsInfo:
        """Publish a signed manifest whose chunks are uploaded (or, with `weights.store = "peers"`,
        served by the publisher); re-sending the same one is harmless."""
        headers = {"Content-Type": "application/json"}
        params = _present(anchor=anchor, stage=stage)
        path = f"/weights/manifests/{version}/{kind}"
        data = self._json("PUT", path, content=manifest_json, headers=headers, params=params)
        return WeightsInfo.model_validate(data)


def _present(**params: int | None) -> dict[str, int]:
    """The query parameters that are set."""
    return {name: value for name, value in params.items() if value is not None}
