"""A served run for the adversarial suite: an arena whose task is served, an env server in this
process, and workers that play through it with a scripted model (its turns are chosen text with
claimed log-probs: what is attacked here is the env server's records, not the sampling)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from tokenizers import Tokenizer

from adversarial.processes import confident_arena
from benchmarks.adversarial.arena import Agent, Arena
from decentrl.client import CoordinatorClient
from decentrl.config import EnvdConfig
from decentrl.engines.base import Completion
from decentrl.envd.main import EnvDaemon
from decentrl.envs.chat import ChatFormat
from decentrl.envs.player import Player, lease_seed
from decentrl.protocol import Lease, Rollout, SamplingParams
from decentrl.worker.fleet import EnvFleet

OVERRIDES = [
    'task.env="tool_use"',
    'task.args={tool_format="python", max_turns=3}',
    "task.served=true",
    "task.max_env_retries=1",
    "coordinator.group_size=2",
    "coordinator.max_new_tokens=24",
    "trust.verify_fraction=0.0",
]


NAMES = ("kibo", "lano", "ruse", "tavi", "mezo", "pika", "sogu", "vena")


class ScriptedModel:
    """An engine whose episode i of a batch says `turns[k]` at its turn k, `{name}` and `{i}`
    filled in (each slot's text differs: identical slots are the repeat detector's business), with
    log-probs it claims."""

    serves_adapters = False

    def __init__(self, tokenizer: Tokenizer, eos: int, turns: list[str], version: int):
        self.tokenizer, self.eos, self.turns, self.policy_version = tokenizer, eos, turns, version

    def generate(
        self, prompts: list[list[int]], sampling: SamplingParams, seed: int | None = None
    ) -> list[Completion]:
        completions = []
        for i, prompt in enumerate(prompts):
            turn = self.tokenizer.decode(prompt, skip_special_tokens=False).count("assistant: ") - 1
            text = self.turns[min(turn, len(self.turns) - 1)].format(
                name=NAMES[i % len(NAMES)], i=i, n=1 + i % 2
            )
            ids = [*self.tokenizer.encode(text).ids, self.eos]
            completions.append(Completion(ids, [-1.0] * len(ids), [self.policy_version] * len(ids), "stop"))
        return completions


class ServedArena:
    def __init__(self, arena: Arena):
        self.arena = arena
        client = CoordinatorClient(arena.url, arena.trainer_token, max_wait=30)
        task = arena.config.task
        self.env_args = task.args
        self.envd = EnvDaemon(EnvdConfig(name="envd-test", instances=1), client, task.env, task.args).start()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.envd.run, args=(self.stop,), daemon=True)
        self.thread.start()
        info = arena.trainer.info()
        self.tokenizer = Tokenizer.from_file(str(arena.model_dir / "tokenizer.json"))
        self.chat = ChatFormat.from_model_dir(arena.model_dir, info.eos_token_ids)
        self.eos = info.eos_token_ids[0]

    def fleet(self, agent: Agent) -> EnvFleet:
        return EnvFleet(agent.client, agent.signer, retries=1)

    def play(self, agent: Agent, lease: Lease, turns: list[str]) -> list[Rollout]:
        """The agent's honest rollouts of `lease`, its model saying `turns`."""
        model = ScriptedModel(self.tokenizer, self.eos, turns, self.arena.latest)
        player = Player(self.chat, self.env_args, fleet=self.fleet(agent))
        return player.play(model, lease, lease_seed(lease.lease_id))

    def violations(self, worker_id: str) -> int:
        rows = self.arena.query(
            "SELECT COUNT(*) FROM events WHERE kind = 'violation' AND worker_id = ?", worker_id
        )
        return rows[0][0]

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=10)
        self.envd.close()


@contextmanager
def served_arena(root: pytest.TempPathFactory, overrides: list[str] = OVERRIDES) -> Iterator[ServedArena]:
    with confident_arena(root, overrides, num_versions=1) as arena:
        served = ServedArena(arena)
        try:
            yield served
        finally:
            served.close()
