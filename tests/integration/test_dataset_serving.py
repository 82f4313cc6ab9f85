"""The coordinator serves a `dataset` run's train prompts by sha256 and names them, not the
user's path, in `/v1/info`; a worker keeps a copy only when its hash is the one named."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from test_coordinator_api import Harness, model_dir  # noqa: F401  # model_dir: a fixture

from decentrl.config import TaskConfig
from decentrl.worker.data import DataFileMismatch, fetch_data_file, localize_env_args

pytestmark = pytest.mark.integration


class DatasetHarness(Harness):
    task: TaskConfig

    def start(self) -> None:
        self.config = self.config.model_copy(update={"task": self.task})
        super().start()


def test_info_names_the_served_prompts_by_hash(tmp_path: Path, model_dir: Path) -> None:  # noqa: F811
    data = tmp_path / "private" / "qa.jsonl"
    data.parent.mkdir()
    data.write_text(
        "".join(json.dumps({"prompt": f"{n}+1=", "answer": str(n + 1)}) + "\n" for n in range(40))
    )
    DatasetHarness.task = TaskConfig(env="dataset", args={"path": str(data), "prompt_format": "raw"})
    harness = DatasetHarness(tmp_path / "run", model_dir)
    try:
        worker = harness.register()
        info = harness.client.get("/v1/info", headers=worker).json()
        assert str(data) not in json.dumps(info["env_args"])
        digest = info["env_args"]["path"].removeprefix("sha256:")
        served = harness.client.get(f"/v1/data/{digest}", headers=worker)
        assert served.status_code == 200 and hashlib.sha256(served.content).hexdigest() == digest
        assert b"answer" not in served.content and served.content.count(b"\n") < 40  # train rows only
        assert harness.client.get(f"/v1/data/{'0' * 64}", headers=worker).status_code == 404
        assert harness.client.get(f"/v1/data/{digest}").status_code == 401
    finally:
        harness.stop()


class Coordinator:
    """Serves `content` whatever digest is asked for; counts the fetches."""

    def __init__(self, content: bytes) -> None:
        self.content, self.fetches = content, 0

    def data_file(self, digest: str) -> bytes:
        self.fetches += 1
        return self.content


def test_worker_fetches_once_and_refuses_a_file_of_another_hash(tmp_path: Path) -> None:
    content = b'{"prompt": "1+1="}\n'
    digest = hashlib.sha256(content).hexdigest()
    honest = Coordinator(content)
    args = localize_env_args(honest, {"path": f"sha256:{digest}", "served": True}, tmp_path)  # type: ignore[arg-type]
    assert args == {"path": str(tmp_path / f"{digest}.jsonl"), "served": True}
    assert fetch_data_file(honest, digest, tmp_path).read_bytes() == content and honest.fetches == 1  # type: ignore[arg-type]
    with pytest.raises(DataFileMismatch, match="does not match its sha256"):
        fetch_data_file(Coordinator(b"something else\n"), hashlib.sha256(b"other").hexdigest(), tmp_path)  # type: ignore[arg-type]
    assert sorted(path.name for path in tmp_path.iterdir()) == [f"{digest}.jsonl"]
