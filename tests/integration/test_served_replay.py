"""`decentrl replay`: a served browser episode, accepted by a real coordinator, re-run on a fresh
browser reproduces every signed view and the signed reward; the same actions on another task do not.

A coordinator process, an env server with a real Chromium, a worker client whose model says a fixed
form-filling script (`served_support.ScriptedModel`), then `decentrl replay` as a user runs it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from adversarial.served_support import OVERRIDES, served_arena

from decentrl.eval.reproduce import reproduce
from decentrl.protocol import RolloutSubmission

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(shutil.which("chromium") is None, reason="needs Chromium: make browser-tools"),
]
BROWSER = [
    'task.env="browser"',
    'task.args={kinds=["form"], max_turns=4}',
    *(o for o in OVERRIDES if not o.startswith(("task.env", "task.args"))),
    "coordinator.max_new_tokens=48",
]
SCRIPT = ["click(2)", "type({n}, 'kibo')", "click(3)"]
"""Focus the second box, type into box 1 or 2, submit. The tiny model's context (256 positions)
ends the episode after the typing's view: two signed steps, then an end the worker asks for."""


@pytest.mark.slow  # 57 s at load 15 (a coordinator, an env server with Chromium, a `decentrl replay` process)
def test_a_served_browser_episode_replays_to_the_same_views_and_reward(tmp_path_factory):
    with served_arena(tmp_path_factory, BROWSER) as served:
        agent = served.arena.agent("player")
        lease = agent.lease(max_groups=1)
        rollouts = served.play(agent, lease, SCRIPT)
        assert [len(r.served.steps) for r in rollouts] == [2, 2], [r.transcript for r in rollouts]
        assert all(r.served.end.final_action_sha256 is None for r in rollouts)
        agent.client.submit_rollouts(RolloutSubmission(rollouts=rollouts))
        config, run_dir = served.arena.config, served.arena.run_dir
        for rollout in rollouts:
            rollout_id = f"{rollout.task_id}-{rollout.slot}"
            report = reproduce(config, run_dir, served.arena.model_dir, rollout_id)
            assert report["reproduces"], report
            assert report["steps"] == 2 and report["env_version"]["same"]
            assert report["env_version"]["recorded"].startswith("browser-")
            assert "Chrome/" in report["env_version"]["recorded"]
        # The same actions on other pages (another kind of task for the seed): views differ.
        other = config.model_copy(deep=True)
        other.task.args = {"kinds": ["select"], "max_turns": 4}
        report = reproduce(other, run_dir, served.arena.model_dir, f"{rollouts[0].task_id}-0")
        assert not report["reproduces"] and report["differences"]
        # As a user runs it: one JSON report, exit status 0.
        command = [sys.executable, "-m", "decentrl", "replay", rollout_id, "--run-dir", str(run_dir)]
        done = subprocess.run(
            [*command, "--model-dir", str(served.arena.model_dir)], capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr[-2000:]
        assert json.loads(done.stdout)["reproduces"] is True
