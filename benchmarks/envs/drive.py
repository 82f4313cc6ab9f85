"""Load on an env server's pool: scripted episodes played by threads, optionally with instances
killed at random (the env server's own `Pool` and instance processes; no model, no network).

Each driver thread plays episodes back to back: a session on an instance (`open`), the
environment's own demonstration turns as the actions (`step`, until the environment ends the
episode), the reward, and `close`. An episode whose instance failed is played again from the start
(as a worker retries it) and counted as a retry.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from dataclasses import dataclass, field

from decentrl.envd.supervisor import InstanceFailed, Limits, Pool
from decentrl.envs.base import TeacherHabits
from decentrl.envs.registry import load_environment


@dataclass
class Load:
    episodes: int = 0
    steps: int = 0
    retries: int = 0
    failures: dict[str, int] = field(default_factory=dict)
    latencies: list[float] = field(default_factory=list)
    """Seconds of each open and step call."""
    kills: int = 0
    seconds: float = 0.0


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def episode_turns(env, seed: int) -> list[str]:
    problem = env.problem(seed, "train")
    return env.demonstration(problem, random.Random(seed), TeacherHabits())


def drive(
    env_name: str,
    args: dict,
    instances: int,
    seconds: float,
    threads_per_instance: int = 2,
    kill_every: float | None = None,
    limits: Limits | None = None,
) -> tuple[Load, Pool]:
    """Play episodes on a fresh pool for `seconds`; with `kill_every`, SIGKILL a random instance
    that often (seconds). Returns the load and the pool (still running: the caller measures it)."""
    limits = limits or Limits(step_seconds=30.0, start_seconds=120.0, memory_bytes=4 << 30, sessions=64)
    pool = Pool(env_name, args, instances, limits)
    env = load_environment(env_name, **args)  # the demonstrations only: no session here
    load, lock, stop = Load(), threading.Lock(), threading.Event()
    seeds = iter(range(10**9))

    def player(index: int) -> None:
        while not stop.is_set():
            with lock:
                seed = next(seeds)
            turns = episode_turns(env, seed)
            while not stop.is_set():
                key = f"{index}-{seed}-{time.monotonic_ns()}"
                try:
                    instance = pool.place(key)
                except InstanceFailed:
                    time.sleep(0.05)
                    continue
                calls: list[float] = []
                try:
                    steps = play(instance, key, seed, turns, calls)
                except InstanceFailed as failed:
                    with lock:
                        load.retries += 1
                        load.failures[failed.failure.value] = load.failures.get(failed.failure.value, 0) + 1
                    continue
                finally:
                    pool.release(instance, key)
                with lock:
                    load.episodes += 1
                    load.steps += steps
                    load.latencies += calls
                break

    def killer() -> None:
        rng = random.Random(0)
        while kill_every and not stop.wait(rng.expovariate(1 / kill_every)):
            live = [i for i in pool.instances if i is not None and i.alive()]
            if live:
                os.kill(rng.choice(live).pid, signal.SIGKILL)
                load.kills += 1

    workers = [
        threading.Thread(target=player, args=(i,), daemon=True)
        for i in range(instances * threads_per_instance)
    ]
    workers.append(threading.Thread(target=killer, daemon=True))
    started = time.monotonic()
    for thread in workers:
        thread.start()
    time.sleep(seconds)
    stop.set()
    for thread in workers:
        thread.join(timeout=60)
    load.seconds = time.monotonic() - started
    return load, pool


def play(instance, key: str, seed: int, turns: list[str], calls: list[float]) -> int:
    """One episode on `instance`; the steps it took."""
    started = time.perf_counter()
    instance.call({"op": "open", "session": key, "seed": seed})
    calls.append(time.perf_counter() - started)
    steps = 0
    for action in turns:
        started = time.perf_counter()
        reply = instance.call({"op": "step", "session": key, "action": action})["reply"]
        calls.append(time.perf_counter() - started)
        steps += 1
        if reply is None:
            break
    instance.call({"op": "reward", "session": key, "final_action": None})
    instance.call({"op": "close", "session": key})
    return steps
