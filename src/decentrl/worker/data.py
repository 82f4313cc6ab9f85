"""Files the run's environment reads, fetched from the coordinator by hash (`envs/dataset.py`).

The coordinator's `/v1/info` names such a file in `env_args` as `"sha256:<hex>"`; the worker
fetches it once into its state directory, checks its hash, and loads the environment from that
copy, so nothing but decentrl is installed on a worker and the user's path never reaches it.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

from decentrl.client import CoordinatorClient
from decentrl.envs.dataset import DIGEST_PREFIX

DIGEST = re.compile(re.escape(DIGEST_PREFIX) + "([0-9a-f]{64})")


class DataFileMismatch(RuntimeError):
    """The coordinator served a file whose hash is not the one it named."""


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def fetch_data_file(client: CoordinatorClient, digest: str, data_dir: Path) -> Path:
    """The local copy of the file with sha256 `digest`, fetched unless a verified copy is there."""
    path = data_dir / f"{digest}.jsonl"
    if path.is_file() and sha256_of(path) == digest:
        return path
    content = client.data_file(digest)
    if hashlib.sha256(content).hexdigest() != digest:
        raise DataFileMismatch(f"the coordinator's data file {digest[:12]}... does not match its sha256")
    data_dir.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    partial.write_bytes(content)
    os.replace(partial, path)  # a crash mid-write never leaves a wrong file under the final name
    return path


def localize_env_args(client: CoordinatorClient, env_args: dict, data_dir: Path) -> dict:
    """`env_args` with each `"sha256:<hex>"` value replaced by the path of the fetched file."""
    local = dict(env_args)
    for key, value in env_args.items():
        match = DIGEST.fullmatch(value) if isinstance(value, str) else None
        if match:
            local[key] = str(fetch_data_file(client, match[1], data_dir))
    return local
