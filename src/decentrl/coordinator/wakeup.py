"""Long polls: a request with nothing to answer yet waits for a commit that may change that.

A worker asking for a lease while the untrained groups are at `max_pending_groups`, or a trainer
asking for a batch before enough groups are ready, would otherwise poll on a timer: each empty
answer costs a round trip and a transaction, and the work is noticed up to one poll interval late.
With `wait_seconds` in its request, the coordinator instead answers once the attempt succeeds, or
after the wait with the same empty answer as before.

`Wakeup.notify` is called after the commit that may have freed room (a batch acked, groups
expired) or readied groups (rewards stored, a submission accepted, a verdict released a hold), from
any thread; the waiters wait on the event loop (no thread is held while waiting). A notification
that does not come (another coordinator replica committed the change) costs only the wait: the
attempt is made again when it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

MAX_WAIT_SECONDS = 5.0
"""The longest a request may ask to wait (`LeaseRequest.wait_seconds`, `BatchRequest.wait_seconds`)."""


class Wakeup:
    def __init__(self) -> None:
        self.count = 0
        """Notifications so far: a waiter that saw another count before its attempt does not wait."""
        self.waiters = 0
        """Requests waiting now (`long_poll`)."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._event: asyncio.Event | None = None

    def notify(self) -> None:
        """After a commit, from any thread: wake every waiter."""
        self.count += 1
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._fire)

    def _fire(self) -> None:
        event, self._event = self._event, None
        if event is not None:
            event.set()

    async def wait(self, seen: int, timeout: float) -> None:
        """Until a notification after the one numbered `seen`, or `timeout` seconds."""
        self._loop = asyncio.get_running_loop()
        if self.count != seen or timeout <= 0:
            return
        if self._event is None:
            self._event = asyncio.Event()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._event.wait(), timeout)


async def long_poll(
    attempt: Callable[[], Awaitable[T | None]], wakeup: Wakeup, wait_seconds: float, max_waiters: int
) -> T | None:
    """`attempt()` until it answers, once more after each notification, for up to `wait_seconds`.

    A waiting request holds a unit of `service.max_requests_in_flight`: with `max_waiters`
    requests already waiting on `wakeup`, a request is answered at once, as without a wait, so
    that a large idle fleet cannot fill the budget and have the trainer's requests refused."""
    deadline = time.monotonic() + min(wait_seconds, MAX_WAIT_SECONDS)
    while True:
        seen = wakeup.count  # before the attempt: a commit during it is not missed
        answer = await attempt()
        left = deadline - time.monotonic()
        if answer is not None or left <= 0 or wakeup.waiters >= max_waiters:
            return answer
        wakeup.waiters += 1  # on the event loop only: no lock needed
        try:
            await wakeup.wait(seen, left)
        finally:
            wakeup.waiters -= 1
