"""The dashboard's rollout inspector: recent rollouts of the run, and one rollout token by token.

A rollout is shown as its prompt, then each segment's tokens: the worker's sampling log-prob and
policy version of every model token and, where the trainer reported it for this rollout, the
trainer's log-prob of the same token (`trainer_logprobs`), so the worker-vs-trainer mismatch of
each token is visible. The group's rewards come with their group-normalised form
(r - mean) / (std + 1e-6), the GRPO advantage (other estimators scale it differently). A visual
task's rollout comes with its images beside its tokens: drawn again from the task's seed (a rollout
stores only their hashes), as PNG data URLs the page shows as they are.
"""

from __future__ import annotations

import base64
import json
import statistics
from collections.abc import Callable

from decentrl.dbapi import Connection
from decentrl.envs.images import TaskImage
from decentrl.monitor.dashboard_data import MAX_ROLLOUTS, Decode, _rows
from decentrl.weights.run_dir import has_table

ADVANTAGE_EPS = 1e-6
Draw = Callable[[int], tuple[TaskImage, ...]]
"""The images of the task with this seed (the coordinator's environment draws them)."""


def recent_rollouts(db: Connection, task_id: str | None = None) -> list[dict]:
    """The newest rollouts (or every rollout of one group), newest first; `inspected` marks those
    the trainer reported its log-probs for."""
    where, args = ("WHERE r.task_id = ?", (task_id,)) if task_id else ("", ())
    # 0 or 1 on both stores (PostgreSQL's IS NOT NULL is a boolean)
    inspected = "CASE WHEN t.rollout_id IS NULL THEN 0 ELSE 1 END"
    join = "LEFT JOIN trainer_logprobs t USING (rollout_id)"
    if not has_table(db, "trainer_logprobs"):  # a run from before the table existed
        inspected, join = "0", ""
    rows = db.execute(
        "SELECT r.rollout_id, r.task_id, r.slot, r.reward, r.staleness, r.num_model_tokens, "
        f"w.name AS worker, {inspected} AS inspected FROM rollouts r LEFT JOIN workers w USING (worker_id) "
        f"{join} {where} ORDER BY r.seq DESC LIMIT ?",
        (*args, MAX_ROLLOUTS),
    )
    return [dict(row) for row in rows]


def group_advantages(rewards: list[float]) -> list[float]:
    mean = sum(rewards) / len(rewards)
    std = statistics.stdev(rewards) if len(rewards) > 1 else 0.0
    return [(reward - mean) / (std + ADVANTAGE_EPS) for reward in rewards]


def rollout_images(db: Connection, task_id: str, named: list[dict], draw: Draw) -> list[dict]:
    """Each image a rollout names, with a PNG data URL when the task's drawing hashes to it."""
    seed = db.execute("SELECT seed FROM tasks WHERE task_id = ?", (task_id,)).fetchone()[0]
    drawn = {image.sha256: image for image in draw(seed)}
    shown = []
    for image in named:
        found = drawn.get(image["sha256"])
        url = None if found is None else "data:image/png;base64," + base64.b64encode(found.png()).decode()
        shown.append({"sha256": image["sha256"], "source": image.get("source", "task"), "png": url})
    return shown


def rollout_detail(db: Connection, rollout_id: str, decode: Decode, draw: Draw | None = None) -> dict | None:
    row = db.execute(
        "SELECT r.*, w.name AS worker FROM rollouts r LEFT JOIN workers w USING (worker_id) WHERE rollout_id = ?",
        (rollout_id,),
    ).fetchone()
    if row is None:
        return None
    payload = json.loads(row["payload"])
    group = db.execute(
        "SELECT rollout_id, slot, reward FROM rollouts WHERE task_id = ? ORDER BY slot", (row["task_id"],)
    ).fetchall()
    advantages = group_advantages([member["reward"] for member in group])
    reported = _rows(db, "SELECT version, logprobs FROM trainer_logprobs WHERE rollout_id = ?", rollout_id)
    trainer = json.loads(reported[0]["logprobs"]) if reported else None
    tokens = [{"text": decode(t), "id": t, "source": "prompt"} for t in payload["prompt_token_ids"]]
    model_index = 0
    for segment in payload["segments"]:
        for position, token_id in enumerate(segment["token_ids"]):
            token = {"text": decode(token_id), "id": token_id, "source": segment["source"]}
            if segment["source"] == "model":
                token["logprob"] = segment["logprobs"][position]
                token["version"] = segment["policy_versions"][position]
                if trainer is not None and model_index < len(trainer):
                    token["trainer_logprob"] = trainer[model_index]
                model_index += 1
            tokens.append(token)
    return {
        "rollout_id": rollout_id,
        "task_id": row["task_id"],
        "worker": row["worker"],
        "reward": row["reward"],
        "staleness": row["staleness"],
        "finish_reason": payload["finish_reason"],
        "temperature": payload["sampling"]["temperature"],
        "trainer_version": None if not reported else reported[0]["version"],
        "group": [
            {"rollout_id": m["rollout_id"], "slot": m["slot"], "reward": m["reward"], "advantage": a}
            for m, a in zip(group, advantages, strict=True)
        ],
        "tokens": tokens,
        "images": rollout_images(db, row["task_id"], payload["images"], draw)
        if payload.get("images") and draw is not None
        else [],
    }
