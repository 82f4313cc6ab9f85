"""The trainer's outbox: publications in order, one in flight; acks after their publication, in
order, at most one version behind; a failure in either thread reaches the trainer."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from decentrl.trainer.outbox import Outbox, TrainedVersion


class Recorder:
    """Publication and ack callbacks that log what happened, optionally held at a gate."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.lock = threading.Lock()
        self.ack_gate = threading.Event()
        self.ack_gate.set()
        self.publish_gate = threading.Event()
        self.publish_gate.set()
        self.fail_on: str | None = None

    def record(self, what: str) -> None:
        with self.lock:
            self.log.append(what)
        if what == self.fail_on:
            raise RuntimeError(what)

    def publish(self, trained: TrainedVersion) -> None:
        self.publish_gate.wait(10)
        self.record(f"publish v{trained.version}")

    def acknowledge(self, trained: TrainedVersion) -> None:
        self.ack_gate.wait(10)
        self.record(f"ack {trained.batch_id}")


def trained_version(version: int, recorder: Recorder) -> TrainedVersion:
    item = TrainedVersion(version, f"b{version}", state={})
    item.report = lambda: recorder.record(f"report v{version}")
    return item


def test_acks_follow_their_publication_in_order_and_overlap_the_next_one():
    recorder = Recorder()
    outbox = Outbox(recorder.publish, recorder.acknowledge)
    try:
        recorder.ack_gate.clear()  # acks stall: publications go on, one version ahead at most
        outbox.put(trained_version(1, recorder))
        outbox.put(trained_version(2, recorder))  # v1 is published, its ack still waits: no blocking
        assert outbox.held() == ["b1", "b2"]
        assert outbox.unacked() == [(1, "b1"), (2, "b2")]  # what v3's checkpoint records
        handed = threading.Event()
        threading.Thread(target=lambda: (outbox.put(trained_version(3, recorder)), handed.set())).start()
        time.sleep(0.3)
        assert not handed.is_set(), "v3 must wait until v1 is acked"
        recorder.ack_gate.set()
        assert handed.wait(10)
        outbox.wait()
        assert outbox.held() == []
    finally:
        outbox.close()
    publications = [entry for entry in recorder.log if entry.startswith("publish")]
    acks = [entry for entry in recorder.log if not entry.startswith("publish")]
    assert publications == ["publish v1", "publish v2", "publish v3"]
    assert acks == ["ack b1", "report v1", "ack b2", "report v2", "ack b3", "report v3"]
    for version in (1, 2, 3):
        assert recorder.log.index(f"publish v{version}") < recorder.log.index(f"ack b{version}")


def test_one_publication_in_flight():
    recorder = Recorder()
    outbox = Outbox(recorder.publish, recorder.acknowledge)
    try:
        recorder.publish_gate.clear()
        outbox.put(trained_version(1, recorder))
        handed = threading.Event()
        threading.Thread(target=lambda: (outbox.put(trained_version(2, recorder)), handed.set())).start()
        time.sleep(0.3)
        assert not handed.is_set(), "v2 must wait until v1 is published"
        recorder.publish_gate.set()
        assert handed.wait(10)
        outbox.wait()
    finally:
        outbox.close()


@pytest.mark.parametrize("fail_on", ["publish v1", "ack b1"])
def test_a_failure_reaches_the_trainer_and_nothing_more_goes_out(fail_on):
    recorder = Recorder()
    recorder.fail_on = fail_on
    outbox = Outbox(recorder.publish, recorder.acknowledge)
    try:
        outbox.put(trained_version(1, recorder))
        with pytest.raises(RuntimeError, match=fail_on):
            outbox.wait()
        with pytest.raises(RuntimeError, match=fail_on):
            outbox.put(trained_version(2, recorder))
    finally:
        outbox.close()
    assert "publish v2" not in recorder.log and "report v1" not in recorder.log


def test_a_finished_version_lets_go_of_its_weights_without_a_garbage_collection():
    """A version's published state and checkpoint copy are the model's size (a full-parameter
    SmolLM2 checkpoint with AdamW is 1.6 GB). Its report closure refers back to the version (the
    trainer's does, for the delta ratio), a reference cycle that only the cyclic collector frees,
    rarely for objects that live this long: once the version is done the outbox must have dropped
    them already, or a real model's trainer grows by their size each version until it is killed."""
    import gc
    import weakref

    recorder = Recorder()
    outbox = Outbox(recorder.publish, recorder.acknowledge)
    gc.disable()
    try:
        refs = []
        for version in range(1, 4):
            state = {"w": torch.ones(1000)}
            checkpoint = torch.zeros(1000)
            trained = TrainedVersion(version, f"b{version}", state, checkpoint=checkpoint)  # type: ignore[arg-type]
            trained.report = lambda trained=trained: recorder.record(f"report v{trained.version}")
            refs.append((weakref.ref(state["w"]), weakref.ref(checkpoint), weakref.ref(trained)))
            outbox.put(trained)
            del state, checkpoint, trained
        outbox.wait()
        assert outbox.unacked() == []  # as the trainer asks each version: the done ones let go
        outbox.close()
        assert "report v3" in recorder.log
        # every version's weights are gone, the last one's too (the outbox still names it)
        assert all(state() is None and checkpoint() is None for state, checkpoint, _ in refs)
        # and the earlier versions themselves: no cycle through their report keeps them
        assert all(version() is None for _, _, version in refs[:-1])
    finally:
        gc.enable()
