"""`decentrl replay ROLLOUT_ID`: does an accepted episode of a served task reproduce?

Every served episode records what it ran on: the environment's version and the task's seed (in
its signed end record), and the key of the env server that signed it (with the episode the
coordinator granted). `reproduce` reads the rollout from the run's store (read-only), checks the
records' signatures under that key, then plays the same actions (the texts the rollout's model
turns decode to) on a fresh session of the environment in this process, and compares every
observation and the final reward with the signed ones. A difference means the environment is not
a function of its seed and actions (or changed version since).
"""

from __future__ import annotations

import json
from pathlib import Path

from decentrl.config import ConfigError, RunConfig
from decentrl.envd_wire import EnvStep, ServedEpisode, action_digest, signed_bytes
from decentrl.envs import environment_from_config
from decentrl.envs.chat import ChatFormat
from decentrl.envs.live import env_version, open_session
from decentrl.model.special import read_eos_token_ids
from decentrl.protocol import Rollout
from decentrl.trust.identity import signature_valid
from decentrl.weights.run_dir import read_only, rows


def recorded(run_dir: Path, rollout_id: str) -> tuple[Rollout, ServedEpisode, dict]:
    """The rollout, its signed episode and the granted episode's row; a ConfigError naming the fix."""
    with read_only(run_dir) as db:
        found = rows(db, "SELECT payload FROM rollouts WHERE rollout_id = ?", rollout_id)
        if not found:
            raise ConfigError(f"run {run_dir} has no rollout {rollout_id!r} (ids look like t0000012-3)")
        rollout = Rollout.model_validate_json(found[0]["payload"])
        if rollout.served is None:
            raise ConfigError(f"rollout {rollout_id} is not of a served task: nothing was recorded to replay")
        episode = rows(db, "SELECT * FROM env_episodes WHERE episode_id = ?", rollout.served.end.episode_id)
    if not episode:
        raise ConfigError(f"the store has no grant of episode {rollout.served.end.episode_id}")
    return rollout, rollout.served, dict(episode[0])


def model_turns(rollout: Rollout, chat: ChatFormat) -> list[str]:
    return [chat.turn_text(s.token_ids) for s in rollout.segments if s.source == "model"]


def reproduce(config: RunConfig, run_dir: Path, model_dir: Path, rollout_id: str) -> dict:
    rollout, served, granted = recorded(run_dir, rollout_id)
    end, key = served.end, granted["server_key"]
    signed = all(signature_valid(key, r.signature, signed_bytes(r)) for r in (*served.steps, end))
    env = environment_from_config(config.task)
    chat = ChatFormat.from_model_dir(model_dir, read_eos_token_ids(model_dir))
    turns = model_turns(rollout, chat)
    session = open_session(env, env.problem(end.seed, "train"))
    differences: list[str] = []
    try:
        for index, step in enumerate(served.steps):
            differences += _compare(step, turns[index], session.step(turns[index]))
        final = turns[len(served.steps)] if end.final_action_sha256 is not None else None
        if final is not None and action_digest(final) != end.final_action_sha256:
            differences.append("the final turn's text does not hash as the end record says")
        reward = float(session.reward(final))
    finally:
        session.close()
        close = getattr(env, "close", None)
        if close is not None:
            close()
    if reward != end.reward:
        differences.append(f"reward {reward} where the server signed {end.reward}")
    now = env_version(env)
    return {
        "rollout_id": rollout_id,
        "env": end.env,
        "seed": end.seed,
        "episode_id": end.episode_id,
        "server_id": end.server_id,
        "server_key": key,
        "env_version": {"recorded": end.env_version, "now": now, "same": now == end.env_version},
        "signatures_valid": signed,
        "steps": len(served.steps),
        "reward": {"signed": end.reward, "replayed": reward},
        "differences": differences,
        "reproduces": signed and not differences,
    }


def _compare(step: EnvStep, action: str, reply: list[dict] | None) -> list[str]:
    found = []
    if action_digest(action) != step.action_sha256:
        found.append(f"turn {step.turn}: the rollout's text is not the action the server signed")
    signed = None if step.observation is None else [m.model_dump() for m in step.observation]
    if reply != signed:
        found.append(
            f"turn {step.turn}: observation {json.dumps(reply)[:200]} where the server signed {json.dumps(signed)[:200]}"
        )
    return found


def main_replay(config: RunConfig, run_dir: Path, model_dir: Path, rollout_id: str) -> int:
    report = reproduce(config, run_dir, model_dir, rollout_id)
    print(json.dumps(report, indent=2))
    return 0 if report["reproduces"] else 1
