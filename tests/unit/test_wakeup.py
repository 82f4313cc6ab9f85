"""Long polls: answered at the notification after a commit, at the end of the wait otherwise, and
at once past the cap of waiting requests (which hold units of the coordinator's request budget)."""

from __future__ import annotations

import asyncio
import threading
import time

from decentrl.coordinator.wakeup import Wakeup, long_poll


class Ready:
    """An attempt that answers once `ready` is set, counting its calls."""

    def __init__(self) -> None:
        self.ready = False
        self.calls = 0

    async def __call__(self) -> str | None:
        self.calls += 1
        return "answer" if self.ready else None


def test_a_notification_from_another_thread_answers_the_waiting_request():
    async def scenario() -> tuple[str | None, float, int]:
        wakeup, attempt = Wakeup(), Ready()

        def commit() -> None:  # a pipeline thread commits, then notifies
            time.sleep(0.2)
            attempt.ready = True
            wakeup.notify()

        threading.Thread(target=commit).start()
        started = time.monotonic()
        answer = await long_poll(attempt, wakeup, 5.0, max_waiters=4)
        return answer, time.monotonic() - started, attempt.calls

    answer, elapsed, calls = asyncio.run(scenario())
    assert answer == "answer" and 0.15 < elapsed < 2.0 and calls == 2


def test_without_a_notification_the_request_waits_out_its_time_then_answers_empty():
    async def scenario() -> tuple[str | None, float]:
        started = time.monotonic()
        answer = await long_poll(Ready(), Wakeup(), 0.3, max_waiters=4)
        return answer, time.monotonic() - started

    answer, elapsed = asyncio.run(scenario())
    assert answer is None and 0.3 <= elapsed < 2.0


def test_past_the_cap_of_waiters_a_request_is_answered_at_once():
    async def scenario() -> tuple[float, float]:
        wakeup = Wakeup()

        async def timed() -> float:
            started = time.monotonic()
            await long_poll(Ready(), wakeup, 0.5, max_waiters=1)
            return time.monotonic() - started

        first = asyncio.create_task(timed())
        await asyncio.sleep(0.05)  # the first one is waiting now
        assert wakeup.waiters == 1
        second = await timed()
        return await first, second

    first, second = asyncio.run(scenario())
    assert first >= 0.5 and second < 0.2
