"""A reasoning-gym task through the real worker -> coordinator -> trainer path (processes on loopback).

The tiny model has random weights, so this checks the plumbing, not learning: prompts rendered
by the chat template on the coordinator, episodes played by the workers, rewards recomputed by
the coordinator with exact scoring, groups trained, held-out evaluation on the same env.
"""

from __future__ import annotations

import json

import pytest
from test_loop import db_rows, model_dir, start_system, start_trainer, start_worker, wait_until, write_config

from decentrl.client import CoordinatorClient
from decentrl.envs import load_environment

pytestmark = pytest.mark.integration
__all__ = ["model_dir"]  # the module-scoped fixture, shared with test_loop


@pytest.mark.slow  # 43 s; reasoning-gym scoring has its unit tests, the loop its own
def test_reasoning_gym_task_trains_through_the_loop(tmp_path, model_dir):
    pytest.importorskip("reasoning_gym")
    config = write_config(
        tmp_path,
        'task.env="reasoning_gym"',
        'task.args={task="basic_arithmetic"}',
        "coordinator.max_new_tokens=8",
        "trainer.num_steps=3",
        "trainer.eval_every=3",
        "trainer.eval_size=8",
        "trust.verify_fraction=0.0",  # no verifier role here: log-prob verification has its own tests
    )
    coordinator, endpoint = start_system(tmp_path, model_dir, config)
    roles = [coordinator]
    try:
        trainer = start_trainer(tmp_path, model_dir, config, endpoint)
        roles += [trainer, start_worker("worker-0", tmp_path, config, endpoint)]
        wait_until(lambda: not trainer.alive(), "the trainer to finish 3 steps", roles)
        assert trainer.process.returncode == 0, trainer.log_path.read_text()[-3000:]
        with CoordinatorClient(endpoint["url"], endpoint["trainer_token"], max_wait=30) as client:
            stats = client.stats()
        assert stats["latest_version"] == 3
        assert "eval_accuracy" in stats["history"][2]["metrics"]
        assert db_rows(tmp_path, "SELECT DISTINCT env FROM tasks") == [("reasoning_gym",)]
        # The stored prompts are the chat-templated reasoning-gym questions of the tasks' seeds.
        env = load_environment("reasoning_gym", task="basic_arithmetic")
        seed, prompt_ids = db_rows(tmp_path, "SELECT seed, prompt_token_ids FROM tasks LIMIT 1")[0]
        question = env.problem(seed, "train").text
        assert question.startswith("Calculate") and len(json.loads(prompt_ids)) > len(question)
        rewards = {row[0] for row in db_rows(tmp_path, "SELECT reward FROM rollouts")}
        assert rewards <= {0.0, 1.0}
        trained = db_rows(tmp_path, "SELECT COUNT(*) FROM rollouts WHERE staleness IS NOT NULL")[0][0]
        assert trained >= 3 * 4 * 4
    finally:
        for role in reversed(roles):
            role.stop()
