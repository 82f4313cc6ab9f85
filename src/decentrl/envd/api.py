"""The env server's HTTP API: workers reset, step and end episodes of their leased slots.

    POST /envd/reset   ResetRequest -> ResetAnswer
    POST /envd/step    StepRequest  -> StepAnswer
    POST /envd/end     EndRequest   -> EnvEnd
    GET  /envd/health                -> {"status": "ok", ...}   (no auth; a readiness probe)

Plain `http.server` in daemon threads, as the stage server. Every POST is signed by the worker
that holds the lease (`trust/identity.py` headers): the server asks the coordinator once per lease
who holds it (`GET /v1/envd/leases/{id}`, with the trainer token) and checks the signature under
that worker's registered key, the timestamp window and the nonce; a step or end must come from the
lease's worker too, before the lease's deadline. Bodies are bounded before they are parsed.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler

from pydantic import ValidationError

from decentrl.envd.turns import Episode, Episodes, Refused
from decentrl.envd_wire import EndRequest, EnvLeaseInfo, ResetRequest, StepRequest
from decentrl.trust.identity import (
    NONCE_HEADER,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    signature_valid,
    signed_message,
)
from decentrl.trust.replay_guard import ReplayGuard
from decentrl.weights.peer_server import SOCKET_TIMEOUT_SECONDS, BoundedServer

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 1 << 20
MAX_CONNECTIONS = 512
"""Open connections at once (a worker keeps one per thread that plays its episodes: 16 by default).
Measured: at the chunk server's 16, two workers' resets were closed unanswered ("server
disconnected") and retried, 1,554 timeouts in a 30-minute run."""
HEALTH_PATH = "/envd/health"
"""Answered without authentication: a readiness probe (deploy/kubernetes/envd.yaml)."""
CLOCK_SKEW_SECONDS = 120.0
LEASE_CACHE = 4096


class EnvServer:
    def __init__(self, episodes: Episodes, coordinator, host: str = "127.0.0.1", port: int = 0):
        self.episodes = episodes
        self.coordinator = coordinator
        self.leases: dict[str, EnvLeaseInfo] = {}
        self.guard = ReplayGuard(CLOCK_SKEW_SECONDS)
        self.http = BoundedServer((host, port), self._handler())
        self.http.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.http.server_address[:2]
        return str(host), int(port)

    def lease(self, lease_id: str) -> EnvLeaseInfo:
        info = self.leases.get(lease_id)
        if info is None:
            from decentrl.client import RequestRejected

            try:
                info = self.coordinator.envd_lease(lease_id)
            except RequestRejected as exc:
                raise Refused(
                    403, f"the coordinator knows no open lease {lease_id!r}: {exc.detail}"
                ) from None
            if len(self.leases) >= LEASE_CACHE:
                self.leases.pop(next(iter(self.leases)))
            self.leases[lease_id] = info
        return info

    def authorise(self, lease: EnvLeaseInfo, path: str, headers: dict, body: bytes) -> None:
        """The lease's worker signed this request, freshly, before the lease's deadline; else Refused."""
        timestamp, nonce = headers.get(TIMESTAMP_HEADER, ""), headers.get(NONCE_HEADER, "")
        message = signed_message("POST", path, timestamp, nonce, body)
        if not signature_valid(lease.worker_public_key, headers.get(SIGNATURE_HEADER, ""), message):
            raise Refused(401, "the request is not signed by the worker that holds the lease")
        refusal = self.guard.check(lease.worker_id, timestamp, nonce, time.time())
        if refusal is not None:
            raise Refused(401, refusal.detail)
        if time.time() > lease.deadline_unix:
            raise Refused(410, f"lease {lease.lease_id} is past its deadline")

    def handle(self, path: str, headers: dict, body: bytes) -> bytes:
        if path == "/envd/reset":
            reset = ResetRequest.model_validate_json(body)
            self.authorise(self.lease(reset.lease_id), path, headers, body)
            answer, episode = self.episodes.reset(reset, self.lease(reset.lease_id))
            if reset.screenshot and answer.failed is None:
                answer.screenshot = self._screenshot(episode)
            return answer.model_dump_json().encode()
        if path == "/envd/step":
            step = StepRequest.model_validate_json(body)
            episode = self.episodes.episode(step.episode_id)
            self.authorise(episode.lease, path, headers, body)
            answer = self.episodes.step(episode, step)
            if step.screenshot and answer.end is None:
                answer.screenshot = self._screenshot(episode)
            return answer.model_dump_json().encode()
        if path == "/envd/end":
            end = EndRequest.model_validate_json(body)
            episode = self.episodes.episode(end.episode_id)
            self.authorise(episode.lease, path, headers, body)
            return self.episodes.end(episode, end).model_dump_json().encode()
        raise Refused(404, f"no {path} here")

    def _screenshot(self, episode: Episode) -> str | None:
        assert episode.instance is not None
        return episode.instance.call({"op": "screenshot", "session": episode.session}).get("png")

    def health(self) -> bytes:
        pool = self.episodes.pool
        body = {
            "status": "ok",
            "env_version": pool.version,
            "instances": sum(1 for i in pool.instances if i is not None and i.alive()),
            "open_episodes": self.episodes.open_count(),
        }
        return json.dumps(body).encode()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            timeout = SOCKET_TIMEOUT_SECONDS
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                if self.path == HEALTH_PATH:
                    self._send(200, server.health())
                else:
                    self._send(404, b'{"detail": "not found"}')

            def do_POST(self) -> None:  # noqa: N802
                try:
                    length = int(self.headers.get("Content-Length", "0"))
                    if not 0 < length <= MAX_BODY_BYTES:
                        raise Refused(413, f"a request is 1 to {MAX_BODY_BYTES} bytes")
                    body = self.rfile.read(length)
                    self._send(200, server.handle(self.path, dict(self.headers), body))
                except Refused as exc:
                    self._send(exc.status, json.dumps({"detail": exc.detail}).encode())
                except (ValidationError, ValueError) as exc:
                    detail = f"malformed request: {str(exc).splitlines()[0]}"
                    self._send(422, json.dumps({"detail": detail}).encode())
                except Exception as exc:  # the coordinator refused a claim, or is unreachable
                    from decentrl.client import CoordinatorUnavailable, RequestRejected

                    if isinstance(exc, RequestRejected):
                        self._send(exc.status, json.dumps({"detail": exc.detail}).encode())
                    elif isinstance(exc, CoordinatorUnavailable):
                        self._send(503, json.dumps({"detail": str(exc)}).encode())
                    else:
                        log.exception("request to %s failed", self.path)
                        self._send(500, json.dumps({"detail": type(exc).__name__}).encode())

            def _send(self, status: int, data: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: object) -> None:  # noqa: A002
                pass

        return Handler
