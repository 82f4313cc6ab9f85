"""Coordinator store, tokens, leasing and rendering, without HTTP, torch or transformers."""

from __future__ import annotations

import json
import stat
import string
from pathlib import Path

import pytest
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

from decentrl.config import CoordinatorConfig, RunConfig
from decentrl.coordinator import metrics
from decentrl.coordinator.context import build_context
from decentrl.coordinator.db.store import Store, add_event, latest_version, next_counter, table_counts
from decentrl.coordinator.http.errors import ApiError, Reason
from decentrl.coordinator.pipeline import leasing
from decentrl.coordinator.trust import auth
from decentrl.protocol import LeaseRequest


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


def write_model_dir(path: Path) -> Path:
    """A vocabulary-only model directory: char tokenizer.json + config.json (no weights needed)."""
    vocab = {
        token: index for index, token in enumerate(["<pad>", "<eos>", "<unk>", *string.digits, "+", "-", "="])
    }
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    path.mkdir()
    tokenizer.save(str(path / "tokenizer.json"))
    config = {"vocab_size": len(vocab), "eos_token_id": 1, "pad_token_id": 0}
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_store_is_wal_full_sync_and_persists(tmp_path: Path) -> None:
    store = Store(tmp_path / "coordinator.db")
    with store.transaction() as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert db.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
        assert next_counter(db, "next_task") == 0
        assert next_counter(db, "next_task") == 1
        add_event(db, 1.0, "rejected", "w", "schema")
    store.close()
    reopened = Store(tmp_path / "coordinator.db")
    with reopened.transaction() as db:
        assert next_counter(db, "next_task") == 2
        assert table_counts(db)["events"] == 1
        assert latest_version(db) is None


def test_transaction_rolls_back_on_error(tmp_path: Path) -> None:
    store = Store(tmp_path / "coordinator.db")
    with pytest.raises(ApiError), store.transaction() as db:
        add_event(db, 1.0, "rejected", "w", "schema")
        raise ApiError(422, "boom", Reason.SCHEMA)
    with store.transaction() as db:
        assert table_counts(db)["events"] == 0


def test_tokens_generated_once_private_and_config_wins(tmp_path: Path) -> None:
    first = auth.load_tokens(tmp_path, CoordinatorConfig())
    path = tmp_path / auth.TOKENS_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert auth.load_tokens(tmp_path, CoordinatorConfig()) == first
    configured = auth.load_tokens(tmp_path, CoordinatorConfig(enroll_token="join-me"))
    assert configured.enroll == "join-me" and configured.trainer == first.trainer
    assert json.loads(path.read_text())["enroll_token"] == "join-me"


def test_bearer_token_parsing() -> None:
    assert auth.bearer_token("Bearer abc") == "abc"
    for header in (None, "", "Basic abc", "Bearer "):
        with pytest.raises(ApiError) as error:
            auth.bearer_token(header)
        assert error.value.status == 401


def make_context(tmp_path: Path, clock: Clock, **coordinator: object):
    run = RunConfig(coordinator=CoordinatorConfig(**coordinator))
    return build_context(run, tmp_path / "run", write_model_dir(tmp_path / "model"), clock)


def publish_row(context, version: int) -> None:
    with context.store.transaction() as db:
        db.execute(
            "INSERT INTO weights (version, path, sha256, num_bytes, created) VALUES (?, 'x', 'h', 1, 0)",
            (version,),
        )


def test_leasing_bounds_pending_groups_and_releases_expired_slots(tmp_path: Path) -> None:
    clock = Clock()
    context = make_context(tmp_path, clock, group_size=2, max_pending_groups=3, lease_seconds=10)
    with pytest.raises(ApiError) as error:
        leasing.grant_lease(context, "w1", LeaseRequest(policy_version=0))
    assert error.value.status == 503
    publish_row(context, 0)
    first = leasing.grant_lease(context, "w1", LeaseRequest(policy_version=0, max_groups=2))
    assert [task.slots for task in first.tasks] == [[0, 1], [0, 1]]
    assert first.tasks[0].prompt_token_ids  # the encoded arithmetic prompt
    second = leasing.grant_lease(context, "w2", LeaseRequest(policy_version=0, max_groups=2))
    assert len(second.tasks) == 1  # max_pending_groups=3
    assert leasing.grant_lease(context, "w2", LeaseRequest(policy_version=0)) is None
    clock.now += 11
    assert leasing.sweep(context) == 2
    again = leasing.grant_lease(context, "w3", LeaseRequest(policy_version=0, max_groups=4))
    assert {task.task_id for task in again.tasks} == {task.task_id for task in first.tasks + second.tasks}


def test_prometheus_text_has_headers_and_labels(tmp_path: Path) -> None:
    context = make_context(tmp_path, Clock())
    with context.store.transaction() as db:
        add_event(db, 1.0, "rejected", "w", 'out"of"vocab')
        db.execute(
            "INSERT INTO train_metrics (version, ts, metrics) VALUES (1, 0, ?)",
            (json.dumps({"loss/mean": 0.5}),),
        )
    text = metrics.prometheus(metrics.stats(context))
    assert "# TYPE decentrl_rollouts_rejected_total counter" in text
    assert 'decentrl_rollouts_rejected_total{reason="out\\"of\\"vocab"} 1.0' in text
    assert 'decentrl_groups{state="pending"} 0.0' in text
    assert "decentrl_trainer_loss_mean 0.5" in text
    assert "decentrl_policy_version NaN" in text


def shrink_context(model_dir: Path, context_length: int) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "max_position_embeddings": context_length}))


def test_prompts_too_long_for_the_context_are_skipped_or_refused(tmp_path: Path) -> None:
    from decentrl.config import ConfigError

    model_dir = write_model_dir(tmp_path / "model")
    run = RunConfig(coordinator=CoordinatorConfig(group_size=2, max_new_tokens=8, max_pending_groups=64))
    # the demo's prompts ("a+b=", 3 to 5 characters): with room for 8 new tokens a context of 12
    # fits the shortest and not the longest
    probe = build_context(run, tmp_path / "probe", model_dir, Clock())
    lengths = [len(probe.chat.prompt_ids(probe.env.problem(s, "train").prompt)) for s in range(16)]
    assert probe.model.max_context is None  # config.json without max_position_embeddings: no check
    shortest, longest = min(lengths), max(lengths)
    assert shortest < longest

    shrink_context(model_dir, shortest + 8 - 1)  # nothing fits: a one-line error naming the fix
    with pytest.raises(
        ConfigError, match=r"none fits the model's context .* raise it or lower max_new_tokens"
    ):
        build_context(run, tmp_path / "refused", model_dir, Clock())

    shrink_context(model_dir, longest + 8 - 1)  # the longest prompts do not fit: skipped, an event each
    context = build_context(run, tmp_path / "run", model_dir, Clock())
    publish_row(context, 0)
    lease = leasing.grant_lease(context, "w1", LeaseRequest(policy_version=0, max_groups=8))
    assert lease is not None
    assert all(len(task.prompt_token_ids) + 8 <= longest + 7 for task in lease.tasks)
    with context.store.transaction() as db:
        skipped = db.execute("SELECT reason FROM events WHERE kind = 'prompt_skipped'").fetchall()
    assert skipped and all(f"context {longest + 7}" in row[0] for row in skipped)
    assert len(lease.tasks) == 8  # skipping costs no lease its groups
    assert metrics.stats(context)["prompts_skipped"] == len(skipped)
    assert f"decentrl_prompts_skipped_total {len(skipped)}" in metrics.prometheus(metrics.stats(context))
