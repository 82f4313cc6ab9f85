"""A relayed stage holder's link to the coordinator: steps in, answers out, over its own requests.

A holder that accepts no connections keeps `LINKS` exchanges open with the coordinator's relay
(`coordinator/stage_relay.py`). Each exchange posts the answer to the request it was handed last and
waits for the next one, so the holder's side of a relayed step costs one round trip and no port.
Two links let one wait for the next request while the other's step computes (steps run one at a
time either way: `StageServer.compute`).
"""

from __future__ import annotations

import logging
import threading

from decentrl.client import CoordinatorClient, CoordinatorUnavailable, RequestRejected
from decentrl.worker.stage_server import StageServer

log = logging.getLogger(__name__)

LINKS = 2
EXCHANGE_WAIT_SECONDS = 20.0
"""How long one exchange waits for a request at the coordinator before it is asked again."""


class RelayLink:
    def __init__(self, client: CoordinatorClient, server: StageServer, stop: threading.Event):
        self.client = client
        self.server = server
        self.stop = stop
        self.threads: list[threading.Thread] = []
        self.served = 0
        self.refused: str | None = None
        """Why the coordinator refused this holder's exchanges (the links then end), else None."""

    @property
    def running(self) -> bool:
        return any(thread.is_alive() for thread in self.threads)

    def start(self) -> RelayLink:
        if not self.running:
            self.threads = [
                threading.Thread(target=self._serve, name=f"stage-relay-{n}", daemon=True)
                for n in range(LINKS)
            ]
            for thread in self.threads:
                thread.start()
        return self

    def _serve(self) -> None:
        answer: tuple[str, int, bytes] | None = None
        while not self.stop.is_set():
            try:
                relayed = self.client.relay_exchange(answer, EXCHANGE_WAIT_SECONDS)
            except RequestRejected as exc:
                self.refused = exc.detail
                log.error("the coordinator's relay refuses this holder: %s", exc.detail)
                return
            except CoordinatorUnavailable as exc:  # only once `stop` is set: the client retries until then
                log.info("relay link ends: %s", exc)
                return
            answer = None
            if relayed is not None:
                status, body = self.server.handle_relayed(relayed)
                answer = (relayed.request_id, status, body)
                self.served += 1
