"""Episodes of a lease on the worker's engine: one batch per turn, one rollout per slot.

Single-turn environments take exactly one `engine.generate` call over every slot of the lease;
multi-turn ones then alternate environment turns (run here, on the worker, and replayed by the
coordinator) and further model turns for the episodes still going (see `envs/episode.py`).
"""

from __future__ import annotations

import time

from decentrl.envs import Environment, Problem, load_environment
from decentrl.envs.chat import ChatFormat
from decentrl.envs.episode import Episode, run_episodes, start
from decentrl.protocol import Lease, Rollout, RolloutImage, TaskSpec

NO_PROBLEM = Problem(seed=-1, split="train", prompt="", answer="")
"""Stands in for the problem of a single-turn task leased without its seed (it is never read)."""


class Player:
    def __init__(self, chat: ChatFormat, env_args: dict):
        self.chat = chat
        self.env_args = env_args
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
            run_episodes(engine, env, self.chat, episodes, lease.sampling, seed)
            generate_s = time.perf_counter() - started
            for (task, slot), episode in zip(slots, episodes, strict=True):
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
                        # a visual task's images, named by hash: the coordinator draws them too
                        images=[RolloutImage(sha256=image.sha256) for image in episode.images] or None,
                    )
                )
        return rollouts
