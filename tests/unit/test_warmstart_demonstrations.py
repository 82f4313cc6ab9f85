"""A warm start on a fixed set of demonstrations (`sft.demonstrations`): each made once, cycled."""

from __future__ import annotations

from collections import Counter

from decentrl.config import ModelConfig, SFTConfig, TaskConfig
from decentrl.envs import environment_from_config
from decentrl.envs.chat import ChatFormat
from decentrl.model.tokenizer import build_char_tokenizer
from decentrl.model.warmstart import sft_batch, sft_seeds
from decentrl.model.warmstart_cache import warmstart_key


def test_fresh_seeds_by_default() -> None:
    sft = SFTConfig(batch_size=4)
    assert sft_seeds(sft, 100, 0) == [100, 101, 102, 103]
    assert sft_seeds(sft, 100, 2) == [108, 109, 110, 111]


def test_a_fixed_set_is_cycled_each_epoch_in_a_new_order() -> None:
    sft = SFTConfig(batch_size=4, demonstrations=6, steps=9)  # 36 examples: 6 epochs of 6
    seen = [seed for step in range(9) for seed in sft_seeds(sft, 1000, step)]
    epochs = [seen[i : i + 6] for i in range(0, 36, 6)]
    for epoch in epochs:  # every epoch is the whole set, each demonstration once
        assert sorted(epoch) == list(range(1000, 1006))
    assert len({tuple(epoch) for epoch in epochs}) > 1  # in orders of their own
    assert seen == [seed for step in range(9) for seed in sft_seeds(sft, 1000, step)]  # seeded


class CountingEnv:
    """An environment that counts the demonstrations it is asked for."""

    def __init__(self, env):
        self.env, self.asked = env, Counter()

    def __getattr__(self, name):
        return getattr(self.env, name)

    def demonstration(self, problem, rng, teacher):
        self.asked[problem.seed] += 1
        return self.env.demonstration(problem, rng, teacher)


def test_each_demonstration_is_made_once_and_rows_are_the_same() -> None:
    tokenizer = build_char_tokenizer()
    chat = ChatFormat.from_hf(tokenizer)
    env = CountingEnv(environment_from_config(TaskConfig(env="arithmetic")))
    sft = SFTConfig(batch_size=3, demonstrations=4, steps=4)
    made: dict = {}
    batches = [
        sft_batch(env, chat, tokenizer.pad_token_id, sft_seeds(sft, 7, step), sft, None, made)
        for step in range(4)
    ]
    assert set(env.asked) == set(range(7, 11)) and set(env.asked.values()) == {1}
    fresh = CountingEnv(env.env)  # the same seeds made anew give the same rows
    again = sft_batch(fresh, chat, tokenizer.pad_token_id, sft_seeds(sft, 7, 3), sft)
    assert all((a == b).all() for a, b in zip(batches[3][:3], again[:3], strict=True))


def test_the_cache_key_changes_only_when_the_set_is_named() -> None:
    model, task = ModelConfig(), TaskConfig(env="arithmetic")
    plain = warmstart_key(model, task, SFTConfig())
    assert warmstart_key(model, task, SFTConfig(demonstrations=None)) == plain
    assert warmstart_key(model, task, SFTConfig(demonstrations=64)) != plain
    assert warmstart_key(model, task, SFTConfig(demonstrations=64)) != warmstart_key(
        model, task, SFTConfig(demonstrations=128)
    )
