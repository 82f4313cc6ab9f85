"""Rewards on the coordinator: scored in the pool after the answer, never on the request path.

A deliberately slow scorer leaves the p99 latency of submissions where a fast one has it; a hung
one gets its rollouts rejected (`scoring_failed`, never trained) without holding anything else; reward-model
terms arrive from the trusted scorer role; the monitors fire on a deliberately hackable reward.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from test_coordinator_api import Harness

from decentrl.client import CoordinatorClient
from decentrl.config import ModelConfig

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from decentrl.model.tiny import build_tiny, save_model_dir

    return save_model_dir(*build_tiny(ModelConfig()), tmp_path_factory.mktemp("tiny-model"))


def _custom(target: str, **args: object) -> dict:
    return {"function": "custom", "args": {"target": f"reward_support:{target}", **args}}


def _harness(tmp_path: Path, model_dir: Path, name: str, terms: list[dict], **reward: object) -> Harness:
    return Harness(tmp_path / name, model_dir, reward={"terms": terms, "pool_size": 1, **reward})


def _submit_latencies(harnesses: list[Harness], num_groups: int) -> list[list[float]]:
    """Submit one rollout at a time to each harness in turn (so both see the same machine load);
    the latency of every submission, per harness."""
    workers = [harness.register() for harness in harnesses]
    for harness in harnesses:
        harness.publish(0)
    leases = [
        harness.lease(worker, max_groups=num_groups)
        for harness, worker in zip(harnesses, workers, strict=True)
    ]
    latencies: list[list[float]] = [[] for _ in harnesses]
    for task in range(num_groups):
        for slot in range(2):
            for index, harness in enumerate(harnesses):
                rollout = harness.rollout(leases[index], task=task, slot=slot, correct=slot == 0)
                started = time.perf_counter()
                answer = harness.submit(workers[index], rollout, settle=False)
                latencies[index].append(time.perf_counter() - started)
                assert answer.status_code == 200, answer.text
    return latencies


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


@pytest.mark.slow  # 37 s; the hung scorer's test below keeps the scoring pool's path in CI
def test_a_slow_scorer_does_not_slow_submissions(tmp_path, model_dir):
    fast = _harness(tmp_path, model_dir, "fast", [_custom("Sleepy", seconds=0.0)], pool_size=2)
    slow = _harness(tmp_path, model_dir, "slow", [_custom("Sleepy", seconds=3.0)], pool_size=2)
    try:
        fast_latencies, slow_latencies = _submit_latencies([fast, slow], 8)
        fast_p99, slow_p99 = _p99(fast_latencies), _p99(slow_latencies)
        print(f"submit p99: fast scorer {fast_p99 * 1000:.0f} ms, 3 s scorer {slow_p99 * 1000:.0f} ms")
        # Scored inline, each of the 16 submissions would take >= 3 s; off the path none waits.
        assert slow_p99 < 3.0 and slow_p99 < max(3 * fast_p99, fast_p99 + 0.5), (fast_p99, slow_p99)
        ready = slow.query("SELECT COUNT(*) FROM tasks WHERE state = 'ready'")[0][0]
        assert ready < 8  # answered before everything was scored
        slow.settle(timeout=180)
        assert slow.query("SELECT COUNT(*) FROM tasks WHERE state = 'ready'") == [(8,)]
        assert slow.query("SELECT slot, reward FROM rollouts ORDER BY seq LIMIT 2") == [(0, 1.0), (1, 0.0)]
    finally:
        fast.stop()
        slow.stop()


def test_a_hung_scorer_gets_its_rollouts_rejected_and_holds_nothing_else(tmp_path, model_dir):
    harness = _harness(tmp_path, model_dir, "hung", [_custom("Sleepy", seconds=600)], timeout_seconds=1)
    try:
        worker = harness.register()
        harness.publish(0)
        lease = harness.lease(worker)
        started = time.monotonic()
        assert (
            harness.submit(
                worker, harness.rollout(lease, slot=0), harness.rollout(lease, slot=1), settle=False
            ).status_code
            == 200
        )
        assert time.monotonic() - started < 1.0
        harness.settle(timeout=30)
        # no reward 0 enters the advantages: both rollouts are gone and their slots leasable again
        assert harness.query("SELECT COUNT(*) FROM rollouts") == [(0,)]
        assert harness.query("SELECT COUNT(*) FROM reward_pending") == [(0,)]
        assert harness.query("SELECT state FROM tasks") == [("pending",)]
        assert harness.query("SELECT COUNT(*) FROM slots WHERE lease_id IS NULL AND rollout_id IS NULL") == [
            (2,)
        ]
        stats = harness.stats()
        assert stats["rollouts_rejected"]["by_reason"] == {"scoring_failed": 2}
        assert stats["reward"]["failed"] == {"timeout": 2}
        assert harness.query("SELECT COUNT(*) FROM events WHERE kind = 'violation'") == [(0,)]  # no strike
    finally:
        harness.stop()


def test_reward_model_terms_come_from_the_trusted_scorer(tmp_path, model_dir):
    from decentrl.protocol import ScoreJobsRequest
    from decentrl.rewards.reward_model import RewardModel, load_reward_model
    from decentrl.scorer.main import Scorer

    rm_dir = tmp_path / "rm"
    model, tokenizer = load_reward_model(model_dir)  # an untrained head: any scores will do
    model.save_pretrained(rm_dir)
    tokenizer.save_pretrained(rm_dir)
    terms = [{"function": "env", "gate": 1.0}, {"function": "reward_model", "name": "rm", "weight": 2.0}]
    harness = _harness(tmp_path, model_dir, "rm", terms)
    try:
        worker = harness.register()
        harness.publish(0)
        lease = harness.lease(worker)
        rollouts = [harness.rollout(lease, slot=0), harness.rollout(lease, slot=1, correct=False)]
        assert harness.submit(worker, *rollouts, settle=False).status_code == 200
        harness.settle(timeout=60, remote=True)  # local terms in; the group waits for the scorer
        assert harness.query("SELECT state FROM tasks") == [("pending",)]
        # The real scorer role, its requests sent through the app (trainer token).
        client = CoordinatorClient("http://testserver", harness.trainer["Authorization"].split()[1])
        client._http = TestClient(harness.client.app, base_url="http://testserver/v1")
        reward_model = RewardModel(rm_dir, device="cpu")
        assert Scorer(client, reward_model).run_once() == 2
        assert client.score_jobs(ScoreJobsRequest()).jobs == []
        right, wrong = harness.query("SELECT reward FROM rollouts ORDER BY slot")
        prompt = harness.tokenizer.decode(lease["tasks"][0]["prompt_token_ids"])
        answer = str(eval(prompt.rstrip("=")))
        assert right[0] == pytest.approx(2.0 * reward_model.score([prompt], [answer])[0], abs=1e-4)
        assert wrong == (0.0,)  # the env gate is closed: the RM's opinion does not matter
        assert harness.query("SELECT state FROM tasks") == [("ready",)]
    finally:
        harness.stop()


def test_monitors_fire_on_a_hackable_reward(tmp_path, model_dir):
    harness = _harness(
        tmp_path, model_dir, "hack", [_custom("PaysForLength")], zero_flagged=True, monitors={"window": 2}
    )
    try:
        worker = harness.register()
        harness.publish(0)
        lines: list[str] = []
        # Four steps: answers grow from 2 to 7 characters, the reward follows, held-out stays at 0.3.
        for step, text in enumerate(["12", "34", "1234567", "7654321"]):
            lease = harness.lease(worker)
            rollouts = [
                harness.rollout(lease, slot=slot, text=text[slot:] + text[:slot]) for slot in range(2)
            ]
            assert harness.submit(worker, *rollouts).status_code == 200
            harness.settle(timeout=60)
            metrics = {"reward_mean": len(text) / 8, "eval_accuracy": 0.3}
            answer = harness.client.post(
                "/v1/trainer/metrics",
                json={"policy_version": step + 1, "metrics": metrics},
                headers=harness.trainer,
            )
            lines += answer.json()["alarms"]
        assert any(line.startswith("reward_without_heldout") for line in lines), lines
        assert any(line.startswith("length_jump") for line in lines), lines
        # A known hack pattern in an answer: an alarm, and with zero_flagged the reward is 0.
        lease = harness.lease(worker)
        rollouts = [
            harness.rollout(lease, slot=0, text="exit()"),
            harness.rollout(lease, slot=1, text="1234"),
        ]
        assert harness.submit(worker, *rollouts).status_code == 200
        harness.settle(timeout=60)
        assert harness.query("SELECT reward FROM rollouts ORDER BY seq DESC LIMIT 2") == [(0.5,), (0.0,)]
        alarms = harness.stats()["reward"]["alarms"]
        assert (
            alarms["hack_pattern"] == 1
            and alarms["reward_without_heldout"] >= 1
            and alarms["length_jump"] >= 1
        )
        text = harness.client.get("/metrics").text
        assert 'decentrl_reward_alarms_total{alarm="hack_pattern"} 1' in text
        assert 'decentrl_reward_term{term="custom"}' in text
    finally:
        harness.stop()


def test_worker_outlier_fires_once_on_a_worker_paid_more_than_its_peers(tmp_path, model_dir):
    harness = Harness(
        tmp_path / "outlier",
        model_dir,
        reward={"monitors": {"window": 2, "peer_min_groups": 16}},
        max_pending_groups=100,
    )
    # Honest workers: per group of 2, right-wrong, right-wrong, both right, both wrong (mean 0.5).
    pattern = [(True, False), (True, False), (True, True), (False, False)]

    def answer(lease: dict, task: int, slot: int, right: bool) -> str:
        # Slots of a group differ (a leading space, another wrong digit), as independent samples
        # do: identical slots would be quarantined by the repeated-completion test.
        value = str(eval(harness.tokenizer.decode(lease["tasks"][task]["prompt_token_ids"]).rstrip("=")))
        return " " * slot + value if right else value + str(8 + slot)

    def work(worker: dict, cheat: bool = False) -> None:
        done = 0
        while done < 24:  # 24 groups, in as many leases as the worker's allowance needs
            harness.settle(timeout=60)  # its groups waiting for rewards count against that allowance
            lease = harness.lease(worker, max_groups=24 - done)
            rollouts = [
                harness.rollout(lease, task=task, slot=slot, text=answer(lease, task, slot, right))
                for task in range(len(lease["tasks"]))
                for slot, right in enumerate((True, True) if cheat else pattern[(done + task) % 4])
            ]
            assert harness.submit(worker, *rollouts, settle=False).status_code == 200
            done += len(lease["tasks"])

    def step(version: int) -> list[str]:
        harness.settle(timeout=60)
        answer = harness.client.post(
            "/v1/trainer/metrics",
            json={"policy_version": version, "metrics": {"reward_mean": 0.6}},
            headers=harness.trainer,
        )
        return [line for line in answer.json()["alarms"] if line.startswith("worker_outlier")]

    try:
        honest = [harness.register("a"), harness.register("b")]
        harness.publish(0)
        for worker in honest:
            work(worker)
        assert step(1) == []  # two honest workers alike: no alarm
        work(harness.register("c"), cheat=True)  # every answer right: 1.0 vs 0.5
        lines = step(2)
        assert len(lines) == 1 and "mean reward 1.000 vs peers 0.500" in lines[0], lines
        (cheat,) = harness.query("SELECT worker_id FROM workers WHERE name = 'c'")[0]
        assert cheat in lines[0]
        assert step(3) == [] and step(4) == []  # still far above, but flagged once (hysteresis)
        assert harness.stats()["reward"]["alarms"].get("worker_outlier") == 1
    finally:
        harness.stop()
