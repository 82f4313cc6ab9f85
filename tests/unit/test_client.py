"""CoordinatorClient against a real HTTP server on loopback that misbehaves on cue."""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from decentrl.client import CoordinatorClient, CoordinatorUnavailable, RequestRejected
from decentrl.protocol import LeaseRequest, ServerInfo

INFO = ServerInfo(
    run_id="run",
    vocab_size=32,
    eos_token_ids=[1],
    pad_token_id=0,
    group_size=4,
    max_staleness=2,
    sampling={"temperature": 1.0, "max_new_tokens": 8},
    latest_version=3,
    model_files=["config.json"],
).model_dump_json()
WEIGHTS = bytes(range(256)) * 64
WEIGHTS_SHA = hashlib.sha256(WEIGHTS).hexdigest()


class Script:
    """Faults to inject, consumed one per request, then normal answers."""

    def __init__(self) -> None:
        self.faults: list[str] = []
        self.requests: list[tuple[str, str, dict]] = []
        self.tokens: set[str] | None = None
        """Worker tokens accepted (None: any); others are refused with 401."""


class Handler(BaseHTTPRequestHandler):
    script: Script

    def log_message(self, *args: object) -> None:
        pass

    def _answer(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _handle(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        self.script.requests.append((self.command, self.path, dict(self.headers), body))
        fault = self.script.faults.pop(0) if self.script.faults else None
        token = self.headers.get("Authorization", "").removeprefix("Bearer ")
        if self.script.tokens is not None and token not in self.script.tokens:
            return self._answer(
                401, b'{"detail": "invalid worker token"}', {"Content-Type": "application/json"}
            )
        if fault == "503":
            return self._answer(503, b'{"detail": "restarting"}', {"Content-Type": "application/json"})
        if fault == "drop":
            self.close_connection = True
            return  # closes the socket without any answer
        if fault == "slow":
            time.sleep(1.0)
        if fault == "422":
            return self._answer(
                422, b'{"detail": "slot 9 is not in the lease"}', {"Content-Type": "application/json"}
            )
        if fault == "500":
            return self._answer(500, b"boom")
        if fault == "429":
            headers = {"Content-Type": "application/json", "Retry-After": "1"}
            return self._answer(429, b'{"detail": "too many requests"}', headers)
        if self.path == "/v1/info":
            return self._answer(200, INFO.encode(), {"Content-Type": "application/json"})
        if self.path == "/v1/leases":
            return self._answer(204, b"")
        if self.path == f"/v1/weights/chunks/{WEIGHTS_SHA}":
            if fault == "corrupt":
                blob = b"x" + WEIGHTS[1:]
                return self._answer(200, blob, {"X-Content-SHA256": WEIGHTS_SHA})
            if fault == "truncate":
                self.send_response(200)
                self.send_header("X-Content-SHA256", WEIGHTS_SHA)
                self.send_header("Content-Length", str(len(WEIGHTS)))
                self.end_headers()
                self.wfile.write(WEIGHTS[:1000])
                self.close_connection = True
                return
            return self._answer(200, WEIGHTS, {"X-Content-SHA256": WEIGHTS_SHA})
        if self.path == "/v1/weights/latest":
            return self._answer(404, json.dumps({"detail": "no weights yet"}).encode())
        self._answer(404, b'{"detail": "not found"}')

    do_GET = do_POST = do_PUT = _handle


@pytest.fixture
def server() -> Iterator[tuple[str, Script]]:
    script = Script()
    handler = type("ScriptedHandler", (Handler,), {"script": script})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, args=(0.01,), daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", script
    httpd.shutdown()
    httpd.server_close()


def make_client(url: str, **kwargs: object) -> CoordinatorClient:
    kwargs = {"token": "secret", "base_delay": 0.01, "max_delay": 0.05, "timeout": 0.3} | kwargs
    return CoordinatorClient(url, **kwargs)


def test_retries_503_and_dropped_connections_then_succeeds(server, caplog):
    url, script = server
    script.faults = ["503", "drop", "503", "slow"]
    with make_client(url) as client, caplog.at_level(logging.WARNING, logger="decentrl.client"):
        info = client.info()
    assert info.latest_version == 3
    assert client.retries == 4
    assert client.retry_reasons["HTTP 503"] == 2
    assert client.retry_reasons["RemoteProtocolError"] == 1
    assert client.retry_reasons["ReadTimeout"] == 1
    assert sum("retry" in record.message for record in caplog.records) == 4
    assert all(headers["Authorization"] == "Bearer secret" for _, _, headers, _ in script.requests)


def test_rejection_is_raised_at_once_with_the_detail(server):
    url, script = server
    script.faults = ["422", "503"]
    with make_client(url) as client, pytest.raises(RequestRejected) as raised:
        client.lease(LeaseRequest(policy_version=0, max_groups=2))
    assert raised.value.status == 422
    assert raised.value.detail == "slot 9 is not in the lease"
    assert client.retries == 0
    assert len(script.requests) == 1
    # the body is the request as the worker built it, sent once (no download report attached)
    assert json.loads(script.requests[0][3]) == {
        "policy_version": 0,
        "max_groups": 2,
        "weights_received": None,
        "wait_seconds": 0.0,
        "stage": None,
        "hop_timings": [],  # a driver's measured hops (staged runs); none here
    }


def test_500_is_not_retried_and_204_is_none(server):
    url, script = server
    script.faults = ["500"]
    with make_client(url) as client:
        with pytest.raises(RequestRejected) as raised:
            client.info()
        assert raised.value.status == 500 and raised.value.detail == "boom"
        assert client.lease(LeaseRequest(policy_version=1)) is None
        assert client.latest_weights() is None  # 404 means none published yet


def test_chunk_download_retries_cut_answers_and_returns_what_was_served(server):
    url, script = server
    script.faults = ["truncate", "drop"]
    with make_client(url) as client:
        assert client.chunk(WEIGHTS_SHA) == WEIGHTS
        assert client.retries == 2 and len(script.requests) == 3
        # A complete answer with the wrong bytes is not the transport's business: the chunk fetcher
        # hashes it and goes to another source (weights/transfer.py).
        script.faults = ["corrupt"]
        assert client.chunk(WEIGHTS_SHA) != WEIGHTS and client.retries == 2


def test_429_waits_what_retry_after_asks_then_retries(server):
    """A rate limit is honoured, not hammered: the retry comes after Retry-After (1 s), far past the
    client's own backoff (at most 0.05 s here); with `retry_rate_limited` off the 429 is raised."""
    url, script = server
    script.faults = ["429"]
    with make_client(url) as client:
        started = time.monotonic()
        assert client.info().latest_version == 3
        assert 1.0 <= time.monotonic() - started < 3.0
        assert client.retries == 1 and client.retry_reasons["HTTP 429"] == 1
        script.faults = ["429"]
        client.retry_rate_limited = False
        with pytest.raises(RequestRejected) as raised:
            client.info()
        assert raised.value.status == 429 and client.retries == 1


def test_max_wait_bounds_the_retries(server):
    url, script = server
    script.faults = ["503"] * 1000
    started = time.monotonic()
    with make_client(url, max_wait=0.3) as client, pytest.raises(CoordinatorUnavailable, match="HTTP 503"):
        client.info()
    assert time.monotonic() - started < 1.0
    assert client.retries >= 3


def test_unreachable_coordinator_and_interrupt():
    stop = threading.Event()
    stop.set()
    # Port 9 on loopback: nothing listens, so every attempt is a ConnectError.
    with make_client("http://127.0.0.1:9", interrupt=stop, interrupt_grace=0.2) as client:
        with pytest.raises(CoordinatorUnavailable, match="interrupted"):
            client.info()
        assert client.retry_reasons["ConnectError"] >= 1


def test_clients_share_one_tls_context_per_ca_setting(tmp_path, monkeypatch) -> None:
    """Each context loads the CA bundle (about 20 ms); a role holds several clients. A CA named in
    SSL_CERT_FILE after the first client still counts for the next one."""
    import certifi

    from decentrl.tls import verifying_context

    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    monkeypatch.delenv("SSL_CERT_DIR", raising=False)
    first = verifying_context()
    assert verifying_context() is first
    bundle = tmp_path / "ca.pem"
    bundle.write_text(Path(certifi.where()).read_text())
    monkeypatch.setenv("SSL_CERT_FILE", str(bundle))
    assert verifying_context() is not first
    assert verifying_context() is verifying_context()


def test_a_refused_token_is_renewed_once_for_all_threads_and_each_request_sent_again(server):
    """Requests in flight when the token is revoked all come back 401: one thread registers again
    (a second registration would revoke the first's token, and so on), the others wait for it and
    are sent again with the new token; nothing is raised."""
    url, script = server
    script.tokens = {"new"}
    client = make_client(url, token="old")
    renewals: list[str] = []

    def renew() -> None:
        renewals.append(threading.current_thread().name)
        time.sleep(0.3)  # the other threads' refusals arrive meanwhile
        client.token = "new"

    client.renew_token = renew
    answers: list[object] = []
    threads = [threading.Thread(target=lambda: answers.append(client.info())) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert len(answers) == 4 and len(renewals) == 1
    sent = [headers["Authorization"] for _, _, headers, _ in script.requests]
    assert sorted(sent) == ["Bearer new"] * 4 + ["Bearer old"] * 4
    client.close()


def test_a_token_refused_again_after_renewal_is_raised(server):
    url, script = server
    script.tokens = set()  # nothing is accepted, not even the renewed token
    client = make_client(url, token="old")
    renewals = []
    client.renew_token = lambda: (renewals.append(1), setattr(client, "token", f"new-{len(renewals)}"))
    with pytest.raises(RequestRejected) as raised:
        client.info()
    assert raised.value.status == 401 and renewals == [1] and len(script.requests) == 2

    def refused() -> None:
        raise RequestRejected(401, "invalid enrollment token")

    client.renew_token = refused  # registering again is refused: the first refusal is raised
    with pytest.raises(RequestRejected, match="invalid worker token"):
        client.info()
    client.renew_token = None  # no renewal at all (the trainer's client): raised at once
    script.requests.clear()
    with pytest.raises(RequestRejected):
        client.info()
    assert len(script.requests) == 1
    client.close()
