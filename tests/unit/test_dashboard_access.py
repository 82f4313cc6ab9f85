"""Who may read the dashboard, and what its answers tell the browser: the token only as a bearer
header (never in a query string, which proxies log), and on every answer a strict
Content-Security-Policy, no framing, no referrer, no caching. The same page in a real browser is
tests/integration/test_dashboard.py."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.testclient import TestClient

from decentrl.monitor.dashboard import HEADERS, add_dashboard_routes


def client(tmp_path: Path) -> TestClient:
    app = FastAPI()
    add_dashboard_routes(app, tmp_path, "secret", str)
    return TestClient(app)


def test_every_dashboard_answer_carries_the_browser_protections(tmp_path):
    with client(tmp_path) as http:
        answers = [
            http.get("/dashboard"),
            http.get("/dashboard/static/dashboard.js"),
            http.get("/dashboard/static/nothing.js"),
            http.get("/dashboard/api/overview"),
            http.get("/dashboard?token=secret"),
        ]
    assert [a.status_code for a in answers] == [200, 200, 404, 401, 400]
    for answer in answers:
        for name, value in HEADERS.items():
            assert answer.headers[name] == value, (answer.url, name)
    policy = HEADERS["Content-Security-Policy"]
    assert (
        "script-src 'self'" in policy and "unsafe-inline" not in policy and "frame-ancestors 'none'" in policy
    )
    assert (
        answers[0].headers["Cache-Control"] == "no-store" and answers[0].headers["X-Frame-Options"] == "DENY"
    )


def test_the_token_is_a_bearer_header_never_a_query_parameter(tmp_path):
    with client(tmp_path) as http:
        page = http.get("/dashboard")
        assert page.status_code == 200 and "<script" in page.text  # the shell: no data in it
        assert http.get("/dashboard/api/overview?token=secret").status_code == 401
        assert (
            http.get("/dashboard/api/rollouts", headers={"Authorization": "Bearer wrong"}).status_code == 401
        )
        refused = http.get("/dashboard?token=secret")
        assert refused.status_code == 400 and "#token=" in refused.text and "secret" not in refused.text
    script = (Path(__file__).parents[2] / "src/decentrl/monitor/static/dashboard.js").read_text()
    assert "location.hash" in script and "location.search" not in script


def test_trust_events_are_grouped_by_kind_and_never_seen_in_the_future(tmp_path):
    """The panel's summary: every trust event of the run by kind (not only the newest 50), how
    many workers each came from and the newest one's reason; healthy-run events left out. A
    worker whose last call landed after the read began is seen 0 s ago, not -0."""
    from decentrl.coordinator.db.open import open_store
    from decentrl.coordinator.db.store import add_event
    from decentrl.monitor.dashboard_data import fleet, trust_event_kinds

    store = open_store(tmp_path, "sqlite")
    with store.transaction() as db:
        for ts, kind, worker, reason in [
            (1.0, "rejected", "w1", "stale"),
            (2.0, "rejected", "w2", "prompt_swap"),
            (3.0, "quarantined", "w2", "logprob forgery"),
            (4.0, "rejected", "w1", "schema"),
            (5.0, "lease_expired", "w1", ""),
        ]:
            add_event(db, ts, kind, worker, reason)
        db.execute(
            "INSERT INTO workers (worker_id, name, engine, token_sha256, registered, last_seen)"
            " VALUES ('w1', 'one', 'hf', 'h', 0, 10.5)"
        )
        kinds = trust_event_kinds(db)
        seen = fleet(db, 10.0, {})
    store.close()
    assert kinds == [
        {"kind": "rejected", "count": 3, "workers": 2, "last_ts": 4.0, "last_reason": "schema"},
        {"kind": "quarantined", "count": 1, "workers": 1, "last_ts": 3.0, "last_reason": "logprob forgery"},
    ]
    assert [worker["seconds_since_seen"] for worker in seen] == [0.0]
