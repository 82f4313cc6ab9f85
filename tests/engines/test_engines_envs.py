"""Every built-in environment through the BPE tokenizer's chat template on the vllm and openai
engines, with the token-id invariant a trainer relies on: the ids it trains on are exactly the
prompt, the ids the engine produced and the environment's ids, and the coordinator's replay of the
episode rebuilds the same ids (no re-tokenization drift at a turn boundary)."""

from __future__ import annotations

import pytest
from conftest import published
from vllm_support import require_vllm

from decentrl.engines.openai import OpenAIEngine
from decentrl.envs import load_environment
from decentrl.envs.chat import ChatFormat
from decentrl.envs.episode import replay, start
from decentrl.envs.player import Player
from decentrl.protocol import Lease, SamplingParams, TaskSpec

require_vllm()
pytestmark = pytest.mark.vllm

ENVIRONMENTS = {
    "arithmetic": {},
    "tool_use": {"tool_format": "hermes"},  # tool calls in the chat template's own <tool_call> tags
    "code": {},
    "reasoning_gym": {"task": "basic_arithmetic"},
}


@pytest.fixture(scope="module")
def engines(bpe_model, vllm_engine, vllm_server, tmp_path_factory):
    served = OpenAIEngine(vllm_server.url, bpe_model.model_dir, tmp_path_factory.mktemp("served"))
    served.load_weights(published(bpe_model.model), 0)
    yield {"vllm": vllm_engine, "openai": served}
    served.close()


@pytest.mark.parametrize("engine_name", ["vllm", "openai"])
@pytest.mark.parametrize("env_name", sorted(ENVIRONMENTS))
def test_episodes_keep_the_engines_token_ids(bpe_model, engines, engine_name, env_name):
    if env_name == "reasoning_gym":
        pytest.importorskip("reasoning_gym")
    engine = engines[engine_name]
    chat = ChatFormat.from_model_dir(bpe_model.model_dir, engine.eos_token_ids)
    env = load_environment(env_name, **ENVIRONMENTS[env_name])
    tasks = []
    for seed in (11, 12):
        problem = env.problem(seed, "train")
        prompt_ids = start(env, chat, problem).prompt_ids
        tasks.append(
            TaskSpec(
                task_id=f"t{seed}",
                group_id=f"g{seed}",
                env=env_name,
                prompt_token_ids=prompt_ids,
                slots=[0, 1, 2],
                seed=seed,
            )
        )
    sampling = SamplingParams(temperature=1.0, max_new_tokens=24)
    lease = Lease(lease_id="l-1", deadline_unix=0.0, sampling=sampling, tasks=tasks)
    rollouts = Player(chat, ENVIRONMENTS[env_name]).play(engine, lease, seed=3)
    assert len(rollouts) == 6
    for rollout, task in zip(rollouts, [t for t in tasks for _ in t.slots], strict=True):
        assert rollout.prompt_token_ids == task.prompt_token_ids
        model = [s for s in rollout.segments if s.source == "model"]
        assert model and all(len(s.logprobs) == len(s.token_ids) for s in model)
        assert all(set(s.policy_versions) == {0} for s in model)
        # what the trainer trains on (trainer/batch.py concatenates exactly these)
        trained = rollout.prompt_token_ids + [t for s in rollout.segments for t in s.token_ids]
        # the coordinator's replay re-runs every environment turn from the model's ids alone
        episode = replay(
            env, chat, env.problem(task.seed, "train"), rollout.segments, sampling.max_new_tokens
        )
        assert episode.token_ids == trained
        assert [s.token_ids for s in episode.segments] == [s.token_ids for s in rollout.segments]
