"""`decentrl serve` as a real process on loopback: the OpenAI-compatible endpoint that the eval,
judge and client tests drive."""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
TOKEN = secrets.token_urlsafe(16)
"""The served endpoints' bearer token; the clients of this process (the judge reward, the eval
endpoint engine) find it under their own variables."""
os.environ["DECENTRL_JUDGE_API_KEY"] = os.environ["DECENTRL_ENDPOINT_API_KEY"] = TOKEN


@contextmanager
def served(model_dir: Path, name: str, start_timeout: float = 120.0) -> Iterator[str]:
    """Serve `model_dir` as model `name` on a free port with `TOKEN`; yields the base URL (`.../v1`)
    once the server says it serves, and stops the server on exit."""
    command = [sys.executable, "-m", "decentrl", "serve", "--model-dir", str(model_dir)]
    command += ["--port", "0", "--name", name]
    env = {**ENV, "DECENTRL_SERVE_TOKEN": TOKEN}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    assert process.stdout is not None
    try:
        deadline, url = time.monotonic() + start_timeout, None
        while url is None and time.monotonic() < deadline:
            line = process.stdout.readline()
            match = re.search(r"serving \S+ at (\S+)", line)
            url = match[1] if match else None
            assert line or process.poll() is None, "decentrl serve exited before serving"
        assert url is not None, f"decentrl serve did not serve within {start_timeout:.0f} s"
        yield url
    finally:
        process.terminate()
        process.wait(timeout=20)
