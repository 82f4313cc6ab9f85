"""Fixtures shared by integration tests: the short demo run (a real `decentrl demo` process)."""

from __future__ import annotations

import pytest
from demo_support import run_demo


@pytest.fixture(scope="session")
def short_demo(tmp_path_factory) -> tuple:
    """The short demo, shared by the learning test and the release tests (tests/integration/
    test_release.py reads the exported model it ends with)."""
    tmp_path = tmp_path_factory.mktemp("short-demo")
    summary = run_demo(
        tmp_path,
        # 600 SFT steps and 60 versions: 0.145 -> 0.445 here (51 s of warm start, 53 s of RL);
        # 1000 and 100 took 75 s + 85 s. The test asks for +0.10.
        "sft.steps=600",
        "trainer.num_steps=60",
        "trainer.eval_every=20",
        "task.eval_size=200",
        timeout=900,
    )
    assert summary["export_dir"] == str(tmp_path / "run" / "model")
    return tmp_path / "run", summary
