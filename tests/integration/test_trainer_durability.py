"""A trainer SIGKILLed while the ack of an earlier batch is still on its way trains no batch twice.

The trainer acks version v's batch in a background thread while v+1 trains, so the checkpoint of
v+1 can be written while the ack of v is still retrying (the coordinator slow or unreachable for
that route). Here a proxy in front of a real coordinator answers 503 to every batch ack, so the
trainer's ack of b1 keeps retrying; once the checkpoint of v2 is on disk the trainer is killed
and restarted against the coordinator itself. The coordinator still holds b1 as issued: unless the
restart acks it, b1 comes back and is trained a second time, into v3.
"""

from __future__ import annotations

import contextlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from test_loop import db_rows, start_system, start_trainer, start_worker, wait_until, write_config

from decentrl.config import ModelConfig
from decentrl.model.tiny import build_tiny, save_model_dir

pytestmark = pytest.mark.integration

HOP_BY_HOP = {"host", "connection", "content-length", "transfer-encoding", "content-encoding", "keep-alive"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_model_dir(*build_tiny(ModelConfig()), tmp_path_factory.mktemp("model"))


class AckRefusingProxy:
    """A reverse proxy to `upstream` on loopback that forwards everything but batch acks, which it
    answers 503 (what a restarting coordinator answers), counting them."""

    def __init__(self, upstream: str) -> None:
        self.refused_acks = 0
        forward = httpx.Client(base_url=upstream, timeout=60)
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def relay(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.command == "POST" and self.path.endswith("/ack"):
                    proxy.refused_acks += 1
                    self.send_response(503)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
                answer = forward.request(self.command, self.path, content=body, headers=headers)
                self.send_response(answer.status_code)
                for key, value in answer.headers.items():
                    if key.lower() not in HOP_BY_HOP:
                        self.send_header(key, value)
                self.send_header("Content-Length", str(len(answer.content)))
                self.end_headers()
                self.wfile.write(answer.content)

            do_GET = do_POST = do_PUT = do_DELETE = relay

            def handle(self) -> None:
                # The trainer is killed mid-request: its connection breaks.
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    super().handle()

            def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base's name
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.forward = forward
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.forward.close()


def checkpointed_version(run_dir: Path) -> int:
    state = run_dir / "trainer" / "latest" / "state.json"
    try:
        return json.loads(state.read_text())["policy_version"]
    except (OSError, ValueError):  # not written yet, or being replaced
        return 0


def test_a_trainer_killed_while_an_ack_retries_trains_no_batch_twice(tmp_path, model_dir):
    config = write_config(tmp_path, "trainer.num_steps=5", "trainer.eval_every=0")
    coordinator, endpoint = start_system(tmp_path, model_dir, config)
    roles = [coordinator]
    proxy = AckRefusingProxy(endpoint["url"])
    try:
        roles.append(start_worker("worker", tmp_path, config, endpoint))
        first = start_trainer(tmp_path, model_dir, config, {**endpoint, "url": proxy.url})
        roles.append(first)
        # v2's checkpoint is written while b1's ack is refused (v3 waits for that ack).
        wait_until(lambda: checkpointed_version(tmp_path) >= 2, "the checkpoint of v2", roles)
        first.process.kill()
        first.process.wait()
        assert proxy.refused_acks >= 1 and checkpointed_version(tmp_path) == 2
        states = [state for (state,) in db_rows(tmp_path, "SELECT state FROM batches ORDER BY seq")]
        assert states[:2] == ["issued", "issued"], states  # neither ack reached the coordinator

        second = start_trainer(tmp_path, model_dir, config, endpoint)
        roles.append(second)
        wait_until(lambda: not second.alive(), "the restarted trainer to finish", roles)
        log = second.log_path.read_text()
        assert second.process.returncode == 0, log[-3000:]
        assert "resumed at version 2" in log, log[-3000:]
        versions = sorted(row[0] for row in db_rows(tmp_path, "SELECT version FROM weights"))
        assert versions == list(range(6)), versions
        # Each batch trained once, into the version it first produced: b1 -> v1, b2 -> v2, ...
        # (b1 trained again would have been acked with v3 and v5 would lack a batch of its own).
        batches = db_rows(tmp_path, "SELECT state, acked_version FROM batches ORDER BY seq")
        assert batches[:5] == [("acked", version) for version in range(1, 6)], batches
        assert [state for state, _ in batches[5:]] in ([], ["issued"]), batches
    finally:
        proxy.close()
        for role in reversed(roles):
            role.stop()
