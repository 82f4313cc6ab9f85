"""The trainer's network work off its critical path.

`Outbox`: a version's publication (encode, sign, upload chunks and manifests), the ack of the batch
it was trained on and its step metrics run in one background thread, in version order, while the
next version trains. The trainer hands version v over only once v-1 is published and acked, so at
most one version is in flight and workers are never more than one version behind the trainer's
critical path. A failure in the thread is raised in the trainer at its next hand-over.

`Prefetch`: the next batch is fetched in a background thread while the current one trains; the
request names the batches the trainer holds (`BatchRequest.held`) so they are not re-delivered.

Crash safety is unchanged: the checkpoint of v (with its batch id) is written before v is handed
over, and a restarted trainer re-publishes its checkpointed version and acks that batch; batches
issued but not acked are re-delivered, oldest first.
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

from decentrl.client import CoordinatorClient
from decentrl.protocol import BatchRequest, TrainBatch

log = logging.getLogger(__name__)


@dataclass
class Release:
    """One trained version for the outbox: publish `state` (None: nothing to publish, only ack),
    ack `batch_id`, then report `metrics`."""

    version: int
    batch_id: str
    state: dict[str, torch.Tensor] | None
    snapshot: bool = False
    report: Callable[[], None] | None = None
    """Posts the version's metrics (run after the ack)."""
    done: threading.Event = field(default_factory=threading.Event)


class Outbox:
    def __init__(self, publish_and_ack: Callable[[Release], None]) -> None:
        self.publish_and_ack = publish_and_ack
        self.queue: queue.Queue[Release | None] = queue.Queue()
        self.error: BaseException | None = None
        self.last: Release | None = None
        self.thread = threading.Thread(target=self._run, name="trainer-outbox", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (release := self.queue.get()) is not None:
            try:
                if self.error is None:  # after a failure nothing more goes out; the trainer raises it
                    self.publish_and_ack(release)
                    if release.report is not None:
                        release.report()
            except BaseException as exc:  # handed to the trainer thread, which stops on it
                self.error = exc
            finally:
                release.done.set()

    def held(self) -> list[str]:
        """Batch ids handed over and not yet acked."""
        last = self.last
        return [] if last is None or last.done.is_set() else [last.batch_id]

    def wait(self) -> None:
        """Until everything handed over is published, acked and reported; raises a failure."""
        if self.last is not None:
            self.last.done.wait()
        if self.error is not None:
            raise self.error

    def put(self, release: Release) -> None:
        """Hand `release` over once the previous one is out (the bound of one version in flight)."""
        self.wait()
        self.last = release
        self.queue.put(release)

    def close(self) -> None:
        self.queue.put(None)
        self.thread.join(60)


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
            batch = self.client.next_batch(request)
            if batch is not None:
                return batch
            time.sleep(self.poll_seconds)
        return None

    def take(self) -> TrainBatch | None:
        """The requested batch (None once the trainer is stopping)."""
        assert self.future is not None, "start() first"
        future, self.future = self.future, None
        return future.result()

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.client.close()
