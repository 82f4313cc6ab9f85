"""The scoring pool: every way a scorer can misbehave fails that one call, clearly, and the pool
keeps serving the next call from a fresh process."""

from __future__ import annotations

import multiprocessing
import time

import pool_scorers
import pytest

from decentrl.rewards.pool import Failure, ScoringFailure, ScoringPool


@pytest.fixture(scope="module")
def pool():
    pool = ScoringPool(
        pool_scorers.misbehaving_scorer, size=2, timeout_seconds=2.0, max_output_bytes=4096, max_memory_mb=512
    )
    yield pool
    pool.close()


@pytest.mark.parametrize(
    ("job", "kind", "words"),
    [
        ("sleep:30", Failure.TIMEOUT, "timed out after 2s"),
        ("crash", Failure.CRASHED, "exit code 3"),
        ("big:100000", Failure.OVERSIZED, "exceeds 4096 bytes"),
        ("raise", Failure.ERROR, "ValueError: bad sample"),
        ("alloc", Failure.ERROR, "MemoryError"),
    ],
)
def test_a_misbehaving_call_fails_alone_and_the_pool_recovers(pool, job, kind, words):
    started = time.monotonic()
    failed, fine = pool.map([job, "fine"])
    assert isinstance(failed, ScoringFailure) and failed.kind is kind and words in failed.detail
    assert fine == "fine"
    assert time.monotonic() - started < 20
    assert pool.map(["again"]) == ["again"]  # the slot that failed was replaced


def test_calls_run_in_parallel_across_slots(pool):
    pool.map(["warm", "warm"])
    started = time.monotonic()
    assert pool.map(["sleep:1", "sleep:1"]) == ["slept", "slept"]
    assert time.monotonic() - started < 1.9


def test_a_scorer_that_cannot_start_fails_each_call_with_its_reason():
    pool = ScoringPool(pool_scorers.failing_factory, size=1, timeout_seconds=5)
    try:
        (result,) = pool.map(["x"])
        assert result.kind is Failure.START
        assert "RuntimeError: no judge endpoint configured" in result.detail
        assert pool.failures[Failure.START] == 1
    finally:
        pool.close()


def test_a_pool_started_now_has_its_processes_before_the_first_call():
    """The coordinator starts its scorers when the first worker registers, so its first rollouts
    do not wait for a spawned interpreter to import the scorer."""
    before = len(multiprocessing.active_children())  # another test's pool may be running
    pool = ScoringPool(pool_scorers.misbehaving_scorer, size=2, timeout_seconds=5, start_now=True)
    try:
        deadline = time.monotonic() + 60
        while len(multiprocessing.active_children()) < before + 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(multiprocessing.active_children()) == before + 2
        assert pool.map(["fine", "fine"]) == ["fine", "fine"]
        assert len(multiprocessing.active_children()) == before + 2  # served by those, none new
    finally:
        pool.close()


def test_a_submitter_whose_calls_sleep_to_the_deadline_delays_its_own_calls_not_others() -> None:
    """Six calls that sleep, queued first by one submitter, then one quick call by another: the
    quick call is scored as soon as a process frees, before most of the sleepers (pool time is
    shared by submitter, and one submitter holds at most half the processes while others wait)."""
    pool = ScoringPool(pool_scorers.misbehaving_scorer, size=2, timeout_seconds=30.0, start_now=True)
    finished: list[str] = []
    try:
        pool.map(["warm", "warm"])
        sleepers = [pool.submit("sleep:1.5", key="sleeper") for _ in range(6)]
        for future in sleepers:
            future.add_done_callback(lambda _: finished.append("sleeper"))
        time.sleep(0.2)
        assert pool.pending("sleeper") == 6
        quick = pool.submit("fine", key="honest")
        quick.add_done_callback(lambda _: finished.append("honest"))
        assert quick.result(timeout=60) == "fine"
        for future in sleepers:
            future.result(timeout=60)
    finally:
        pool.close()
    assert finished.index("honest") <= 2, finished
