"""The trainer's network work off its critical path.

`Outbox`: a version's publication (encode, sign, upload chunks and manifests) runs in one
background thread, in version order, while the next version trains; the ack of the batch it was
trained on and its step metrics follow in a second thread, in version order, each once its version
is published. The trainer hands version v over once v-1 is published, so at most one publication
is in flight and workers are never more than one version behind the trainer's critical path; the
acks and metrics of earlier versions may still be on their way meanwhile (their round trips and
the coordinator's commits then overlap the next publication instead of adding to it). A failure in
either thread is raised in the trainer at its next hand-over.

`Prefetch`: the next batch is fetched in a background thread while the current one trains; the
request names the batches the trainer holds (`BatchRequest.held`: every batch handed over and not
yet acked) so they are not re-delivered.

Crash safety: the checkpoint of v (with its batch id) is copied when v is handed over and written
by the publishing thread before v is published, so a version is never published before it is
checkpointed. The ack of v-1 may still be on its way (retrying while the coordinator is slow or
down) when the checkpoint of v is written, so the checkpoint also lists every batch handed over
whose ack was not confirmed when it was copied (`Outbox.unacked`). A restarted trainer
re-publishes its checkpointed version and acks that batch and every listed one; batches issued
but not acked (a version trained and not yet written among them) are re-delivered, oldest first.
Without the list, the coordinator would re-deliver a batch whose version is already in the
checkpoint, and it would be trained twice. A batch is acked only after its version is published.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from decentrl.client import CoordinatorClient, RequestRejected
from decentrl.config import ConfigError
from decentrl.protocol import BatchRequest, TrainBatch
from decentrl.trainer.checkpoint import CheckpointData

log = logging.getLogger(__name__)


@dataclass
class TrainedVersion:
    """One trained version for the outbox: publish `state` (None: nothing to publish, only ack),
    ack `batch_id`, then report `metrics`."""

    version: int
    batch_id: str
    state: dict[str, torch.Tensor] | None
    snapshot: bool = False
    checkpoint: CheckpointData | None = None
    """Written (by the publication, ahead of it) before `state` goes out."""
    report: Callable[[], None] | None = None
    """Posts the version's metrics (run after the ack)."""
    delta_ratio: float | None = None
    """Delta bytes of the published version over its state (set by the publication)."""
    published: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    """Published, acked and reported (or given up after a failure)."""


class Outbox:
    def __init__(
        self, publish: Callable[[TrainedVersion], None], acknowledge: Callable[[TrainedVersion], None]
    ) -> None:
        self.publish = publish
        self.acknowledge = acknowledge
        self.to_publish: queue.Queue[TrainedVersion | None] = queue.Queue()
        self.to_ack: queue.Queue[TrainedVersion | None] = queue.Queue()
        self.error: BaseException | None = None
        self.last: TrainedVersion | None = None
        self.pending: list[TrainedVersion] = []
        """Handed over and not yet done, oldest first (the trainer's thread only)."""
        self.threads = [
            threading.Thread(target=self._publishing, name="trainer-outbox-publish", daemon=True),
            threading.Thread(target=self._acking, name="trainer-outbox-ack", daemon=True),
        ]
        for thread in self.threads:
            thread.start()

    def _publishing(self) -> None:
        while (trained := self.to_publish.get()) is not None:
            try:
                if self.error is None:  # after a failure nothing more goes out; the trainer raises it
                    self.publish(trained)
            except BaseException as exc:  # handed to the trainer thread, which stops on it
                self.error = exc
            finally:
                # The weights and the checkpoint copy (the model's size, and with AdamW three times
                # that) are out or given up: let go of them now, not when the version is collected.
                trained.state = trained.checkpoint = None
                trained.published.set()
                self.to_ack.put(trained)
        self.to_ack.put(None)

    def _acking(self) -> None:
        while (trained := self.to_ack.get()) is not None:
            try:
                if self.error is None:
                    self.acknowledge(trained)
                    if trained.report is not None:
                        trained.report()
            except BaseException as exc:
                self.error = exc
            finally:
                # A report closure may refer back to its version (the trainer's does): a cycle only
                # the cyclic collector would free, which holds on to long-lived objects for long.
                trained.report = None
                trained.done.set()

    def unacked(self) -> list[tuple[int, str]]:
        """(version, batch id) of every batch handed over whose ack is not confirmed yet, oldest
        first. `done` is set after the ack returned (or after a failure, which the next `put`
        raises before anything more is written), so nothing unconfirmed is left out."""
        self.pending = [trained for trained in self.pending if not trained.done.is_set()]
        return [(trained.version, trained.batch_id) for trained in self.pending if trained.batch_id]

    def held(self) -> list[str]:
        """Batch ids handed over and not yet acked."""
        return [batch_id for _, batch_id in self.unacked()]

    def wait(self) -> None:
        """Until everything handed over is published, acked and reported; raises a failure."""
        if self.last is not None:
            self.last.done.wait()
        self._raise()

    def wait_published(self) -> None:
        """Until the last version handed over is published; raises a failure."""
        if self.last is not None:
            self.last.published.wait()
        self._raise()

    def _raise(self) -> None:
        if self.error is not None:
            raise self.error

    def put(self, trained: TrainedVersion) -> None:
        """Hand `trained` over once the previous one is published (one publication in flight) and
        every one before it is acked (the acks never fall more than one version behind)."""
        if self.last is not None:
            self.last.published.wait()
        for older in self.pending[:-1]:
            older.done.wait()
        self._raise()
        self.last = trained
        self.pending.append(trained)
        self.to_publish.put(trained)

    def close(self) -> None:
        self.to_publish.put(None)
        for thread in self.threads:
            thread.join(60)


def next_batch(client: CoordinatorClient, request: BatchRequest) -> TrainBatch | None:
    """`client.next_batch`; a refusal is a setting of the run to fix (e.g. more groups per batch
    than the coordinator may ever hold), asking again would be refused forever: a ConfigError,
    which the CLI prints as one line."""
    try:
        return client.next_batch(request)
    except RequestRejected as exc:
        raise ConfigError(f"the coordinator refuses the trainer's batch request: {exc.detail}") from None


class Prefetch:
    """At most one `next_batch` request in flight in a background thread, polling while none is
    ready, with a client of its own."""

    def __init__(self, client: CoordinatorClient, stop: threading.Event, poll_seconds: float) -> None:
        self.client = client
        self.stop = stop
        self.poll_seconds = poll_seconds
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainer-prefetch")
        self.future: Future[TrainBatch | None] | None = None

    def start(self, request: BatchRequest) -> None:
        assert self.future is None, "one request at a time"
        self.future = self.pool.submit(self._fetch, request)

    def _fetch(self, request: BatchRequest) -> TrainBatch | None:
        while not self.stop.is_set():
            batch = next_batch(self.client, request)
            if batch is not None:
                return batch
            time.sleep(self.poll_seconds)
        return None

    def take(self, timeout: float | None = None) -> TrainBatch | None:
        """The requested batch (None once the trainer is stopping). With `timeout`, TimeoutError
        when none came within it; the request stays in flight for the next `take`."""
        assert self.future is not None, "start() first"
        batch = self.future.result(timeout)
        self.future = None
        return batch

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.client.close()
