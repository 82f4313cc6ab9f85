"""The env server role, `decentrl envd`: a trusted host of live episodes of the run's environment.

Like the verifier and the scorer it holds the trainer token. It reads the run's task from the
coordinator (`/v1/info`), starts its pool of instances (`supervisor.py`), serves workers over HTTP
(`api.py`) and announces itself every `ANNOUNCE_SECONDS` (`PUT /v1/envd/servers`): its URL, its
signing key and its counters. The key signs every step and end it answers (`turns.py`); it is
kept in `envd.state_dir` when given. Stops on SIGTERM/SIGINT, killing its instances.
"""

from __future__ import annotations

import json
import logging
import signal
import socket
import threading
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from decentrl.client import CoordinatorClient, CoordinatorUnavailable, RequestRejected
from decentrl.config import ConfigError, EnvdConfig
from decentrl.envd.api import EnvServer
from decentrl.envd.supervisor import InstanceFailed, Limits, Pool
from decentrl.envd.turns import Episodes
from decentrl.envd_wire import EnvServerAnnounce
from decentrl.weights.signing import load_or_create_key, public_key_hex

log = logging.getLogger(__name__)

ANNOUNCE_SECONDS = 2.0
KEY_FILE = "envd_key.pem"
ENDPOINT_FILE = "envd.json"


def signing_key(config: EnvdConfig) -> Ed25519PrivateKey:
    if config.state_dir is None:
        return Ed25519PrivateKey.generate()
    state = Path(config.state_dir)
    state.mkdir(parents=True, exist_ok=True)
    return load_or_create_key(state / KEY_FILE)


class EnvDaemon:
    """Pool, episodes and HTTP server of one env server, started and stopped together."""

    def __init__(self, config: EnvdConfig, client: CoordinatorClient, env: str, args: dict, stderr=None):
        self.config = config
        self.client = client
        self.key = signing_key(config)
        limits = Limits(
            step_seconds=config.step_seconds,
            start_seconds=config.start_seconds,
            memory_bytes=config.memory_mb << 20,
            sessions=config.sessions_per_instance,
        )
        self.pool = Pool(env, args, config.instances, limits, stderr)
        self.episodes = Episodes(self.pool, self.key, config.name, client)
        self.server = EnvServer(self.episodes, client, config.host, config.port)
        host, port = self.server.address
        if host in ("0.0.0.0", "::", ""):  # bound to every interface: workers use this host's address
            host = socket.gethostbyname(socket.gethostname())
        self.url = config.url or f"http://{host}:{port}"
        self.env = env
        self.thread = threading.Thread(target=self.server.http.serve_forever, name="envd-http", daemon=True)

    def start(self) -> EnvDaemon:
        self.thread.start()
        self.announce()
        return self

    def announce(self) -> None:
        counters = dict(self.episodes.counters) | dict(self.pool.counters)
        self.client.envd_announce(
            EnvServerAnnounce(
                server_id=self.config.name,
                url=self.url,
                public_key=public_key_hex(self.key),
                env=self.env,
                env_version=self.pool.version,
                instances=len(self.pool.instances),
                sessions=self.pool.capacity,
                open_episodes=self.episodes.open_count(),
                counters=counters,
            )
        )

    def run(self, stop: threading.Event) -> None:
        while not stop.wait(ANNOUNCE_SECONDS):
            try:
                self.announce()
                self.episodes.sweep()
            except (RequestRejected, CoordinatorUnavailable) as exc:
                log.warning("announcing to the coordinator failed: %s", exc)

    def close(self) -> None:
        self.server.http.shutdown()
        self.server.http.server_close()
        self.pool.close()


def main_envd(url: str, token: str, config: EnvdConfig) -> int:
    """CLI entry: serve until SIGTERM/SIGINT."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    with CoordinatorClient(url, token, interrupt=stop, max_wait=120.0) as client:
        try:
            task = client.info().sections.get("task", {})
        except RequestRejected as exc:
            raise ConfigError(f"the coordinator at {url} refused the token: {exc.detail}") from None
        if not task.get("served"):
            log.warning("the run's task (%s) is not served (task.served = false): no worker will come", task)
        try:
            daemon = EnvDaemon(config, client, task["env"], task.get("args", {}))
        except InstanceFailed as exc:
            log.error("the environment %r does not start: %s", task.get("env"), exc)
            return 1
        try:
            daemon.start()
            if config.state_dir:
                endpoint = {"url": daemon.url, "server_id": config.name}
                (Path(config.state_dir) / ENDPOINT_FILE).write_text(json.dumps(endpoint))
            log.info(
                "env server %s: %s at %s, %d instances",
                config.name,
                daemon.pool.version,
                daemon.url,
                len(daemon.pool.instances),
            )
            daemon.run(stop)
        except CoordinatorUnavailable as exc:
            log.warning("stopping without an answer from the coordinator: %s", exc)
            return 0 if stop.is_set() else 1
        finally:
            daemon.close()
    return 0
