"""Shared by the vLLM engine tests: skip without vLLM, except where CI requires it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import pytest


def require_vllm() -> None:
    """`make test` runs these tests in .venv-vllm with DECENTRL_REQUIRE_VLLM=1: a broken install
    fails there instead of skipping; elsewhere (the main venv) they are skipped."""
    if os.environ.get("DECENTRL_REQUIRE_VLLM"):
        import vllm  # noqa: F401
    else:
        pytest.importorskip("vllm")


class VLLMServer:
    """`vllm`'s OpenAI-compatible server as a real process on loopback, with the dev routes the
    openai engine reloads weights through and the trainer's log-prob definition."""

    def __init__(self, model_dir, startup_timeout: float = 900.0):
        self.model_dir = model_dir
        self.startup_timeout = startup_timeout
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> VLLMServer:
        env = {
            **os.environ,
            "VLLM_SERVER_DEV_MODE": "1",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "HF_HUB_OFFLINE": "1",
        }
        command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model_dir)]
        command += ["--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32", "--enforce-eager"]
        command += ["--logprobs-mode", "processed_logprobs", "--served-model-name", "tiny"]
        self.log = tempfile.NamedTemporaryFile(prefix="vllm-server-", suffix=".log", delete=False)  # noqa: SIM115
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the vLLM server exited at start; see {self.log.name}")
            try:
                if httpx.get(f"{self.url}/v1/models", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.__exit__(None, None, None)
        raise RuntimeError(
            f"the vLLM server did not start within {self.startup_timeout:.0f} s; see {self.log.name}"
        )

    def __exit__(self, *exc) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
