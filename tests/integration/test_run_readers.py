"""A run's offline readers (the dashboard's data, export's provenance counts, `RunWeights`, eval's
run detection) read a PostgreSQL run exactly as they read a SQLite one.

The same rows go into a SQLite store and into a fresh database on a real PostgreSQL server, each
through the coordinator's own store and its transactions; every reader must then give the same
answer on both, and the answers are checked against the rows by hand. Both read-only connections
must refuse a write.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import psycopg
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from decentrl.config import ConfigError, load_config
from decentrl.coordinator.db.open import open_store
from decentrl.eval.sources import is_run_dir
from decentrl.monitor import dashboard_data as data
from decentrl.monitor.dashboard import add_dashboard_routes
from decentrl.monitor.inspector import recent_rollouts, rollout_detail
from decentrl.release.provenance import run_counts, run_id
from decentrl.weights.run_dir import STORE_FILE, RunWeights, has_table, read_only, store_location

pytestmark = pytest.mark.integration

NOW = 1000.0
KEY = "ab" * 32


def payload(prompt: list[int], tokens: list[int], version: int) -> str:
    segment = {
        "source": "model",
        "token_ids": tokens,
        "logprobs": [-0.5] * len(tokens),
        "policy_versions": [version] * len(tokens),
    }
    return json.dumps(
        {
            "prompt_token_ids": prompt,
            "segments": [segment],
            "finish_reason": "stop",
            "sampling": {"temperature": 1.0},
        }
    )


def fill(store) -> None:
    """Two workers (one quarantined), two groups of two rollouts, three versions, events."""
    with store.transaction() as db:
        db.execute("INSERT INTO meta (key, value) VALUES (?, ?)", ("trainer_public_key", KEY))
        for worker, name, registered, seen in (("w1", "alpha", 1.0, 990.0), ("w2", "beta", 2.0, 900.0)):
            db.execute(
                "INSERT INTO workers (worker_id, name, engine, token_sha256, registered, last_seen) "
                "VALUES (?, ?, 'hf', ?, ?, ?)",
                (worker, name, f"sha-{worker}", registered, seen),
            )
        rollouts = [  # id, task, slot, worker, reward, version, tokens, accepted, staleness
            ("r1", "t1", 0, "w1", 1.0, 0, 4, 980.0, 0),
            ("r2", "t1", 1, "w2", 0.0, 0, 6, 950.0, 1),
            ("r3", "t2", 0, "w1", 1.0, 1, 5, 985.0, None),
            ("r4", "t2", 1, "w1", 0.5, 2, 3, 800.0, None),
        ]
        for seq, (rid, task, slot, worker, reward, version, tokens, accepted, stale) in enumerate(rollouts):
            db.execute(
                "INSERT INTO rollouts (seq, rollout_id, task_id, slot, lease_id, worker_id, payload, reward, "
                "min_version, max_version, num_model_tokens, accepted, staleness) "
                "VALUES (?, ?, ?, ?, 'l1', ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    seq + 1,
                    rid,
                    task,
                    slot,
                    worker,
                    payload([1, 2], list(range(7, 7 + tokens)), version),
                    reward,
                    version,
                    version,
                    tokens,
                    accepted,
                    stale,
                ),
            )
        for task, state in (("t1", "trained"), ("t2", "filled")):
            db.execute(
                "INSERT INTO tasks (task_id, group_id, env, seed, prompt_token_ids, num_slots, state, created) "
                "VALUES (?, ?, 'arith', 0, '[1, 2]', 2, ?, 0.0)",
                (task, f"g-{task}", state),
            )
        for version in range(3):
            db.execute(
                "INSERT INTO weights (version, path, sha256, num_bytes, created) VALUES (?, ?, ?, ?, 0.0)",
                (version, f"v{version}", f"{version}" * 64, 1000 // (version + 1)),
            )
            db.execute(
                "INSERT INTO train_metrics (version, ts, metrics) VALUES (?, 0.0, ?)",
                (
                    version,
                    json.dumps({"loss": 0.5 - version / 10, **({"eval_accuracy": 0.7} if version else {})}),
                ),
            )
        db.execute(
            "INSERT INTO weight_traffic (version, worker_id, coordinator_bytes, peer_bytes) VALUES (1, 'w1', 300, 0)"
        )
        db.execute(
            "INSERT INTO weight_traffic (version, worker_id, coordinator_bytes, peer_bytes) VALUES (1, 'w2', 0, 500)"
        )
        events = [
            (1, "rejected", "w2", "logprobs out of range"),
            (2, "lease_expired", "w1", "deadline"),
            (3, "quarantined", "w2", "plausibility"),
            (4, "group_expired", None, "stale"),
        ]
        for seq, kind, worker, reason in events:
            db.execute(
                "INSERT INTO events (seq, ts, kind, worker_id, reason) VALUES (?, ?, ?, ?, ?)",
                (seq, 900.0 + seq, kind, worker, reason),
            )
        db.execute(
            "INSERT INTO reputation (worker_id, violations, logprob_failures, quarantined, reason) "
            "VALUES ('w2', 2, 1, 903.0, 'plausibility')"
        )
        db.execute("INSERT INTO holds (rollout_id, task_id, submission_id) VALUES ('r2', 't1', 's1')")
        db.execute(
            "INSERT INTO trainer_logprobs (rollout_id, version, logprobs) VALUES ('r1', 1, ?)",
            (json.dumps([-0.4, -0.6, -0.5, -0.5]),),
        )


def everything(db) -> dict:
    """What every reader gives for the run."""
    return {
        "latest": data.latest_version(db),
        "fleet": data.fleet(db, NOW, {"w1": 2}),
        "curves": data.curves(db),
        "staleness": data.staleness_histogram(db),
        "traffic": data.weight_traffic(db),
        "events": data.trust_events(db),
        "recent": recent_rollouts(db),
        "group": recent_rollouts(db, "t2"),
        "detail": rollout_detail(db, "r1", str),
    }


@pytest.fixture
def runs(tmp_path: Path, postgres_url: str) -> tuple[Path, Path]:
    """(a SQLite run directory, a PostgreSQL one) holding the same rows."""
    sqlite_run, postgres_run = tmp_path / "sqlite", tmp_path / "postgres"
    for run_dir, location in ((sqlite_run, "sqlite"), (postgres_run, postgres_url)):
        (run_dir / "weights" / "manifests").mkdir(parents=True)
        store = open_store(run_dir, location)
        fill(store)
        store.close()
    return sqlite_run, postgres_run


def test_every_reader_reads_a_postgresql_run_as_a_sqlite_one(
    runs: tuple[Path, Path], postgres_url: str
) -> None:
    sqlite_run, postgres_run = runs
    assert store_location(sqlite_run) == "sqlite" and store_location(postgres_run) == postgres_url
    # the coordinator recorded where its store is, readable by its owner only
    assert (postgres_run / STORE_FILE).stat().st_mode & 0o777 == 0o600
    with read_only(sqlite_run) as lite, read_only(postgres_run) as pg:
        read = everything(lite)
        assert everything(pg) == read
    # by hand, from the rows of `fill`
    assert read["latest"] == 2
    alpha, beta = read["fleet"]
    assert (alpha["name"], alpha["accepted"], alpha["version"], alpha["lag"]) == ("alpha", 3, 2, 0)
    assert alpha["tokens_per_second"] == (4 + 5) / data.THROUGHPUT_WINDOW_SECONDS  # r4 is too old
    assert (alpha["serving_peers"], alpha["peer_version"], alpha["seconds_since_seen"]) == (True, 2, 10.0)
    assert (beta["rejected"], beta["held"], beta["strikes"], beta["quarantined"]) == (1, 1, 3, "plausibility")
    assert read["curves"]["versions"] == [0, 1, 2]
    assert read["curves"]["series"]["eval_accuracy"] == [None, 0.7, 0.7]
    assert read["staleness"] == {0: 1, 1: 1}
    assert [(t["payload_bytes"], t["coordinator_bytes"], t["peer_bytes"]) for t in read["traffic"]] == [
        (1000, 0, 0),
        (500, 300, 500),
        (333, 0, 0),
    ]
    assert [(e["seq"], e["worker"]) for e in read["events"]] == [(4, None), (3, "beta"), (1, "beta")]
    assert [(r["rollout_id"], r["inspected"]) for r in read["recent"]] == [
        ("r4", 0),
        ("r3", 0),
        ("r2", 0),
        ("r1", 1),
    ]
    assert [r["rollout_id"] for r in read["group"]] == ["r4", "r3"]
    detail = read["detail"]
    assert detail["trainer_version"] == 1 and [m["rollout_id"] for m in detail["group"]] == ["r1", "r2"]
    assert [t.get("trainer_logprob") for t in detail["tokens"][2:]] == [-0.4, -0.6, -0.5, -0.5]

    counts = run_counts(postgres_run)
    assert counts == run_counts(sqlite_run)
    assert counts.model_dump() == {
        "workers_registered": 2,
        "workers_contributed": 2,  # t1 is trained: w1's r1 and w2's r2
        "workers_quarantined": 1,
        "rollouts_accepted": 4,
        "rollouts_trained": 2,
        "rollouts_rejected": 1,
        "groups_expired": 1,
    }
    assert len(run_id(postgres_run)) == 16 and run_id(postgres_run) != run_id(sqlite_run)
    run = RunWeights(postgres_run)
    assert run.versions == {v: f"{v}" * 64 for v in range(3)} and run.trainer_public_key == KEY
    assert is_run_dir(str(postgres_run)) and is_run_dir(str(sqlite_run))


def test_the_readers_cannot_write_and_a_missing_table_reads_as_empty(
    runs: tuple[Path, Path], postgres_url
) -> None:
    sqlite_run, postgres_run = runs
    with read_only(sqlite_run) as lite, pytest.raises(sqlite3.OperationalError, match="readonly"):
        lite.execute("DELETE FROM rollouts")
    with read_only(postgres_run) as pg, pytest.raises(psycopg.errors.ReadOnlySqlTransaction):
        pg.execute("DELETE FROM rollouts")
    # a run from before the inspector's table: the readers show no trainer log-probs, not an error
    with psycopg.connect(postgres_url, autocommit=True) as connection:
        connection.execute("DROP TABLE trainer_logprobs")
    with sqlite3.connect(sqlite_run / "coordinator.db") as connection:
        connection.execute("DROP TABLE trainer_logprobs")
    with read_only(sqlite_run) as lite, read_only(postgres_run) as pg:
        assert not has_table(pg, "trainer_logprobs") and has_table(pg, "rollouts")
        assert everything(pg) == everything(lite)
        assert all(r["inspected"] == 0 for r in recent_rollouts(pg))
        assert rollout_detail(pg, "r1", str)["trainer_version"] is None


def test_the_dashboard_serves_a_postgresql_run(runs: tuple[Path, Path]) -> None:
    _, postgres_run = runs
    app = FastAPI()
    add_dashboard_routes(app, postgres_run, "secret", str, clock=lambda: NOW)
    with TestClient(app) as client:
        assert client.get("/dashboard/api/overview").status_code == 401
        bearer = {"Authorization": "Bearer secret"}
        overview = client.get("/dashboard/api/overview", headers=bearer).json()
        detail = client.get("/dashboard/api/rollouts/r1", headers=bearer).json()
    assert overview["latest_version"] == 2 and overview["rollouts_accepted"] == 4
    assert [w["name"] for w in overview["fleet"]] == ["alpha", "beta"]
    assert detail["trainer_version"] == 1


def test_a_run_whose_store_is_gone_is_a_one_line_error(tmp_path: Path, postgres_url: str) -> None:
    run_dir = tmp_path / "run"
    (run_dir / "weights" / "manifests").mkdir(parents=True)
    (run_dir / STORE_FILE).write_text(json.dumps({"store": postgres_url + "_dropped"}))
    with pytest.raises(ConfigError, match="cannot connect to coordinator.store") as error:
        RunWeights(run_dir)
    assert "\n" not in str(error.value)
    # a model directory (its config.json is a model's) is not a run
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    assert not is_run_dir(str(tmp_path / "model"))
    # the launchers' config.json names the store too
    launched = tmp_path / "launched"
    launched.mkdir()
    config = load_config(None, [f"coordinator.store={postgres_url!r}"])
    (launched / "config.json").write_text(config.model_dump_json())
    assert store_location(launched) == postgres_url
