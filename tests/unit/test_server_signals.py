"""A stop signal that arrives before uvicorn has installed its handlers is not lost (the run is
announced first, so a launcher may stop the coordinator that early: CI saw it hang until SIGKILL)."""

from __future__ import annotations

import os
import signal

import pytest
import uvicorn

from decentrl.listen import absorb_reraised_signals, bind

pytestmark = pytest.mark.timeout(60)


async def app(scope, receive, send) -> None:  # a minimal ASGI app: lifespan and nothing else
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_before_uvicorn_starts_stops_it_gracefully(signum):
    sock = bind("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    before = signal.getsignal(signum)
    try:
        with absorb_reraised_signals(server):
            os.kill(os.getpid(), signum)  # delivered now, between announcing and serving
            assert server.should_exit
            server.run(sockets=[sock])  # returns: neither hangs nor dies of the signal
    finally:
        sock.close()
    assert signal.getsignal(signum) is before
