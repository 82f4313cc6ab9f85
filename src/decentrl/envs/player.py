"""Episodes of a lease on an engine (a worker's, or a colocated trainer's): one batch per turn,
one rollout per slot.

Single-turn environments take exactly one `engine.generate` call over every slot of the lease;
multi-turn ones then alternate environment turns (run here, on the worker, and replayed by the
coordinator) and further model turns for the episodes still going (see `envs/episode.py`).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from typing import Protocol

from decentrl.envd_wire import ServedEpisode
from decentrl.envs import Environment, Problem, load_environment
from decentrl.envs.chat import ChatFormat
from decentrl.envs.episode import Episode, run_episodes, start
from decentrl.protocol import Lease, Rollout, RolloutImage, SamplingParams, TaskSpec


class Fleet(Protocol):
    """Env servers that play a served task's episodes (the worker's `worker/fleet.py`, `EnvFleet`)."""

    def play(
        self,
        engine,
        env: Environment,
        chat: ChatFormat,
        started: list[tuple[str, str, int, Episode]],
        sampling: SamplingParams,
        seed: int,
        fresh: Callable[[int], Episode],
    ) -> dict[int, tuple[Episode, ServedEpisode]]: ...


def lease_seed(lease_id: str) -> int:
    """Sampling seed derived from the lease id, so a lease's samples can be reproduced."""
    return int.from_bytes(hashlib.sha256(lease_id.encode()).digest()[:4], "big")


NO_PROBLEM = Problem(seed=-1, split="train", prompt="", answer="")
"""Stands in for the problem of a single-turn task leased without its seed (it is never read)."""


class Player:
    def __init__(self, chat: ChatFormat, env_args: dict, fleet: Fleet | None = None):
        self.chat = chat
        self.env_args = env_args
        self.fleet = fleet
        """A served task's env servers (`worker/fleet.py`); None: the environment runs here."""
        self._envs: dict[str, Environment] = {}

    def environment(self, name: str) -> Environment:
        if name not in self._envs:
            self._envs[name] = load_environment(name, **self.env_args)
        return self._envs[name]

    def _start(self, env: Environment, task: TaskSpec) -> Episode:
        if task.seed is None:
            assert env.max_turns == 1, (
                f"task {task.task_id} of multi-turn env {task.env!r} came without its seed"
            )
            problem = NO_PROBLEM
        else:
            problem = env.problem(task.seed, "train")
        return start(env, self.chat, problem, task.prompt_token_ids)

    def play(self, engine, lease: Lease, seed: int) -> list[Rollout]:
        """One rollout per slot, tasks in lease order, slots in task order."""
        rollouts: list[Rollout] = []
        for name in dict.fromkeys(task.env for task in lease.tasks):
            env = self.environment(name)
            slots = [(task, slot) for task in lease.tasks if task.env == name for slot in task.slots]
            started = time.perf_counter()
            episodes = [self._start(env, task) for task, _ in slots]
            if self.fleet is None:
                run_episodes(engine, env, self.chat, episodes, lease.sampling, seed)
                played = {i: (episode, None) for i, episode in enumerate(episodes)}
            else:  # only the slots whose episode ended well (`fleet.py`); the rest go back
                fresh = [
                    (lease.lease_id, task.task_id, slot, episode)
                    for (task, slot), episode in zip(slots, episodes, strict=True)
                ]
                played = self.fleet.play(
                    engine,
                    env,
                    self.chat,
                    fresh,
                    lease.sampling,
                    seed,
                    lambda i, env=env, slots=slots: self._start(env, slots[i][0]),
                )
            generate_s = time.perf_counter() - started
            for i, (episode, served) in sorted(played.items()):
                task, slot = slots[i]
                rollouts.append(
                    Rollout(
                        lease_id=lease.lease_id,
                        task_id=task.task_id,
                        slot=slot,
                        prompt_token_ids=task.prompt_token_ids,
                        segments=episode.segments,
                        sampling=lease.sampling,
                        finish_reason=episode.finish_reason(self.chat.eos_token_ids),
                        transcript=episode.transcript,
                        timings={"generate_s": generate_s},
                        served=served,
                        # a visual task's images, named by hash: the coordinator draws them too
                        images=[RolloutImage(sha256=image.sha256) for image in episode.images] or None,
                    )
                )
        return rollouts
