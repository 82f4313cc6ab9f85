"""The example of docs/environments.md ("Your own dataset") trains end to end from a JSONL file
written here: the worker never gets its path, it fetches the served prompts by sha256."""

from __future__ import annotations

import hashlib
import json
import re
import tomllib
from pathlib import Path

import pytest
from demo_support import run_demo

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # CI time: `make test-all` runs it

DOCS = Path(__file__).parents[2] / "docs" / "environments.md"


def docs_example() -> tuple[str, list[dict]]:
    """The section's TOML and JSONL blocks, as a user copies them."""
    section = DOCS.read_text().split("## Your own dataset", 1)[1].split("\n## ", 1)[0]
    toml = re.search(r"```toml\n(.*?)```", section, re.DOTALL)
    lines = re.search(r"```json\n(.*?)```", section, re.DOTALL)
    assert toml and lines, "the docs section lost its example"
    return toml[1], [json.loads(line) for line in lines[1].splitlines()]


def test_docs_dataset_example_trains_from_a_file_workers_fetch_by_hash(tmp_path: Path) -> None:
    toml, example = docs_example()
    args = tomllib.loads(toml)["task"]["args"]
    rows = example + [{"question": f"{a}+{b}=", "answer": str(a + b)} for a in range(10) for b in range(10)]
    data = tmp_path / "user" / args["path"]
    data.parent.mkdir()
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = tmp_path / "sums.toml"
    config.write_text(toml.replace(f'path = "{args["path"]}"', f"path = {json.dumps(str(data))}"))
    summary = run_demo(
        tmp_path,
        "model.hidden_size=32",
        "model.num_layers=1",
        "model.num_heads=1",
        "model.intermediate_size=64",
        "sft.steps=10",
        "trainer.num_steps=3",
        "trainer.groups_per_step=2",
        "trainer.eval_every=0",
        "trainer.eval_size=8",
        "coordinator.group_size=4",
        "worker.groups_per_lease=2",
        "demo.num_workers=1",
        config=config,
        timeout=300,
    )
    assert summary["num_policy_versions"] == 3 and summary["num_rollouts_accepted"] >= 3 * 2 * 4
    worker = tmp_path / "run" / "worker-0"
    fetched = list((worker / "data").glob("*.jsonl"))
    assert len(fetched) == 1, list(worker.rglob("*"))
    content = fetched[0].read_bytes()
    assert fetched[0].stem == hashlib.sha256(content).hexdigest()
    served = [json.loads(line) for line in content.decode().splitlines()]
    assert all(list(row) == ["question"] for row in served)  # prompts only: no answers on workers
    assert {row["question"] for row in served} < {row["question"] for row in rows}
    assert str(data) not in (tmp_path / "run" / "logs" / "worker-0.log").read_text(errors="replace")
