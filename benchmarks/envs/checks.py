"""What the coordinator pays per served rollout: the env server's signatures and their binding
checked, the episode walked from its tokens (`coordinator/pipeline/served.py`), against the replay
of a pure environment's turns (`coordinator/pipeline/replay.py`) for scale.

A real coordinator context (its store, tokenizer and chat template) in this process; the served
rollouts are browser episodes played on a live session with signed records, as an env server
signs them, and granted in the store as the coordinator grants them.
"""

from __future__ import annotations

import random
import tempfile
import time
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from decentrl.config import DEMO_CONFIG, load_config
from decentrl.coordinator.context import build_context
from decentrl.coordinator.pipeline.replay import replay_one
from decentrl.coordinator.pipeline.served import check_served
from decentrl.envd_wire import EnvEnd, EnvMessage, EnvStep, ServedEpisode, action_digest, signed_bytes
from decentrl.envs.base import TeacherHabits
from decentrl.envs.live import open_session
from decentrl.model.tiny import build_tiny, save_model_dir
from decentrl.protocol import Rollout, SamplingParams, Segment
from decentrl.weights.signing import public_key_hex


def _served_rollout(context, env, seed: int, key: Ed25519PrivateKey, number: int) -> tuple[Rollout, dict]:
    problem = env.problem(seed, "train")
    turns = env.demonstration(problem, random.Random(seed), TeacherHabits())
    chat, eos = context.chat, context.model.eos_token_ids[0]
    prompt_ids = chat.prompt_ids(problem.prompt, env.tools or None)
    session = open_session(env, problem)
    segments, steps, episode_id = [], [], f"e-{number:016x}"
    reply = None
    for turn, action in enumerate(turns, start=1):
        ids = [*chat.tokenizer.encode(action, add_special_tokens=False).ids, eos]
        segments.append(
            Segment(source="model", token_ids=ids, logprobs=[-0.1] * len(ids), policy_versions=[0] * len(ids))
        )
        reply = session.step(action)
        step = EnvStep(
            episode_id=episode_id,
            turn=turn,
            action_sha256=action_digest(chat.turn_text(ids)),
            observation=None if reply is None else [EnvMessage(**m) for m in reply],
        )
        step.signature = key.sign(signed_bytes(step)).hex()
        steps.append(step)
        if reply is None:
            break
        segments.append(
            Segment(source="env", token_ids=chat.env_ids(reply, env.tools or None, ended_with=eos))
        )
    reward = session.reward()
    session.close()
    end = EnvEnd(
        episode_id=episode_id,
        server_id="envd-bench",
        lease_id="l-bench",
        task_id=f"t{number}",
        slot=0,
        env=env.name,
        env_version="bench",
        seed=seed,
        attempt=0,
        steps=len(steps),
        reward=reward,
    )
    end.signature = key.sign(signed_bytes(end)).hex()
    rollout = Rollout(
        lease_id="l-bench",
        task_id=f"t{number}",
        slot=0,
        prompt_token_ids=prompt_ids,
        segments=segments,
        sampling=SamplingParams(max_new_tokens=64),
        finish_reason="stop",
        served=ServedEpisode(steps=steps, end=end),
    )
    granted = {
        "episode_id": episode_id,
        "lease_id": "l-bench",
        "task_id": f"t{number}",
        "slot": 0,
        "attempt": 0,
        "server_id": "envd-bench",
        "server_key": public_key_hex(key),
        "state": "open",
        "reason": None,
    }
    return rollout, granted


def check_costs(num_rollouts: int = 200, served_kinds: tuple[str, ...] = ("browser",)) -> dict:
    """Microseconds per rollout: the served check (of `served_kinds`' episodes) and a tool_use replay."""
    root = Path(tempfile.mkdtemp(prefix="bench-envs-"))
    model_dir = save_model_dir(
        *build_tiny(load_config(DEMO_CONFIG, ["model.max_positions=512"]).model), root / "model"
    )
    results = {}
    arms = [(kind, {}, True) for kind in served_kinds] + [("tool_use", {"tool_format": "python"}, False)]
    for name, args, served in arms:
        config = load_config(DEMO_CONFIG, ["coordinator.max_new_tokens=64", "model.max_positions=512"])
        config.task.env, config.task.args, config.task.served = name, args, served
        context = build_context(config, root / f"run-{name}", model_dir, time.time)
        env = context.env
        key = Ed25519PrivateKey.generate()
        if served:
            made = [(seed, *_served_rollout(context, env, seed, key, seed)) for seed in range(num_rollouts)]
            started = time.perf_counter()
            for seed, rollout, granted in made:
                check_served(context, seed, rollout, granted)
            seconds = time.perf_counter() - started
            steps = sum(len(record.steps) for _, r, _ in made if (record := r.served) is not None) / len(made)
            results[name] = {
                "check_us_per_rollout": 1e6 * seconds / len(made),
                "signed_records_per_rollout": steps + 1,
            }
            close = getattr(env, "close", None)
            if close is not None:
                close()
        else:
            made = [_replayed_rollout(context, env, seed) for seed in range(num_rollouts)]
            started = time.perf_counter()
            for seed, rollout in made:
                replay_one(context, seed, rollout)
            results[name] = {"replay_us_per_rollout": 1e6 * (time.perf_counter() - started) / len(made)}
        context.store.close()
    return results


def _replayed_rollout(context, env, seed: int) -> tuple[int, Rollout]:
    from decentrl.envs.episode import advance, start

    problem = env.problem(seed, "train")
    turns = env.demonstration(problem, random.Random(seed), TeacherHabits())
    chat, eos = context.chat, context.model.eos_token_ids[0]
    episode = start(env, chat, problem)
    for action in turns:
        ids = [*chat.tokenizer.encode(action, add_special_tokens=False).ids, eos]
        episode.segments.append(
            Segment(source="model", token_ids=ids, logprobs=[-0.1] * len(ids), policy_versions=[0] * len(ids))
        )
        env_ids = advance(env, chat, episode, ids, 64)
        if env_ids is None:
            break
        episode.segments.append(Segment(source="env", token_ids=env_ids))
    rollout = Rollout(
        lease_id="l",
        task_id="t",
        slot=0,
        prompt_token_ids=episode.prompt_ids,
        segments=episode.segments,
        sampling=SamplingParams(max_new_tokens=64),
        finish_reason="stop",
    )
    return seed, rollout
