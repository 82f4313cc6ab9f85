"""The served environment of docs/environments.md ("Writing a served environment in under 50
lines"), run as the page shows it: under 50 lines, served by a real env-server pool with a real
Chromium, and the same moves replayed through its `respond` and `reward`."""

from __future__ import annotations

import re
import shutil
import sys
import types
from pathlib import Path

import pytest

from decentrl.envd.supervisor import Limits, Pool
from decentrl.envs.browser.webtasks import solution

DOC = Path(__file__).resolve().parents[2] / "docs" / "environments.md"
pytestmark = pytest.mark.skipif(shutil.which("chromium") is None, reason="needs Chromium: make browser-tools")


def example() -> str:
    section = DOC.read_text().split("### Writing a served environment in under 50 lines", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.DOTALL)[1]


@pytest.fixture
def module(monkeypatch):
    """The example as an installed package `my_package` would hold it."""
    code = example()
    assert len(code.strip().splitlines()) < 50
    package = types.ModuleType("my_package")
    exec(compile(code, "my_package.py", "exec"), package.__dict__)
    monkeypatch.setitem(sys.modules, "my_package", package)
    return package


def test_the_documented_environment_answers_and_scores_in_a_pool(module, monkeypatch, tmp_path):
    env = module.ClickTasks()
    problem = env.problem(3, "eval")
    target = solution(problem.info["spec"])[-1].args[0]
    messages = [*problem.prompt, {"role": "assistant", "content": f"click({target})"}]
    assert env.respond(problem, messages) is None  # the click ended the task
    assert env.reward(problem, messages) == 1.0
    env.browser.close()
    # Served: an instance process loads it by name, as an entry point would resolve it.
    entry = tmp_path / "entry_points"
    (entry / "my_package").mkdir(parents=True)
    (entry / "my_package" / "__init__.py").write_text(example())
    info = entry / "my_package-1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: my-package\nVersion: 1\n")
    (info / "entry_points.txt").write_text("[decentrl.environments]\nclick_tasks = my_package:ClickTasks\n")
    monkeypatch.setenv("PYTHONPATH", f"{entry}:{':'.join(sys.path)}")
    pool = Pool(
        "click_tasks", {}, 1, Limits(step_seconds=30.0, start_seconds=60.0, memory_bytes=2 << 30, sessions=2)
    )
    try:
        instance = pool.place("a")
        assert instance.version == "click-tasks-1"
        instance.call({"op": "open", "session": "a", "seed": 3})  # an env server opens train problems
        target = solution(env.problem(3, "train").info["spec"])[-1].args[0]
        assert instance.call({"op": "step", "session": "a", "action": f"click({target})"})["reply"] is None
        assert instance.call({"op": "reward", "session": "a", "final_action": None})["reward"] == 1.0
    finally:
        pool.close()
