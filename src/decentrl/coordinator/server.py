"""Run the coordinator: bind, announce, serve until SIGTERM/SIGINT.

The socket is bound before anything is announced, so `run_dir/coordinator.json` (url, pid and
tokens, mode 0600) appears only once the port is known and accepting connections. Launchers poll
for that file; with `port = 0` it is the only way to learn the port.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import uvicorn

from decentrl.config import RunConfig
from decentrl.coordinator.http.app import create_app
from decentrl.coordinator.http.connections import guarded_protocol
from decentrl.coordinator.run_record import lock_run_dir, write_config
from decentrl.coordinator.trust.auth import TOKENS_FILE
from decentrl.listen import absorb_reraised_signals, bind
from decentrl.monitor.reporting import log_to_file
from decentrl.private_files import write_private_json
from decentrl.writable_dir import writable_dir

ANNOUNCE_FILE = "coordinator.json"
LOG_FILE = "coordinator.log"

log = logging.getLogger("decentrl.coordinator")


def announce_start(run_dir: Path, url: str, dashboard_url: str) -> None:
    """What an operator needs to go on: where it listens, where the tokens are, what to start."""
    log.info("coordinator of %s listening at %s (log: %s)", run_dir, url, run_dir / LOG_FILE)
    # Without its token: logs get pasted into issues; the token is in the run directory.
    log.info("dashboard: %s#token=TOKEN (TOKEN: dashboard.json in the run directory)", dashboard_url)
    log.info(
        "tokens: %s (enroll_token for workers; trainer_token for the trainer, verifier and scorer)",
        run_dir / TOKENS_FILE,
    )
    log.info(
        "start the trainer (`decentrl trainer --coordinator %s --token=TRAINER_TOKEN --run-dir DIR`), "
        "the verifier (`decentrl verifier --coordinator %s --token=TRAINER_TOKEN`) and workers "
        "(`decentrl worker --coordinator %s --token=ENROLL_TOKEN --state-dir DIR`)",
        url,
        url,
        url,
    )


def public_url(host: str, port: int) -> str:
    """A URL local clients can use: a wildcard bind is reached through loopback."""
    if host in ("0.0.0.0", ""):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def serve(config: RunConfig, run_dir: Path, model_dir: Path) -> None:
    """Serve the coordinator of the run in `run_dir` until SIGTERM or SIGINT."""
    writable_dir(run_dir)
    lock = lock_run_dir(run_dir, config)  # held until this process ends, however it ends
    app = create_app(config, run_dir, model_dir)
    log_to_file(run_dir / LOG_FILE)
    write_config(run_dir, config, app.state.context.store)
    sock = bind(config.coordinator.host, config.coordinator.port)
    port = sock.getsockname()[1]
    announce = run_dir / ANNOUNCE_FILE
    url = public_url(config.coordinator.host, port)
    app.state.context.roles.url = url
    dashboard_url = f"{url}/dashboard"
    protocol, app.state.connections = guarded_protocol(config.service)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            http=protocol,
            log_level="warning",
            # uvicorn annotates int but runs the keep-alive timer with any number of seconds
            timeout_keep_alive=config.service.idle_timeout_seconds,  # pyright: ignore[reportArgumentType]
            # No uvicorn-wide limit: it answers 503 to everyone once enough sockets are merely open.
            # `connections.py` caps sockets per address and overall, `budget.py` caps requests.
            limit_concurrency=None,
            proxy_headers=bool(config.service.trusted_proxies),
            forwarded_allow_ips=config.service.trusted_proxies or None,
            timeout_graceful_shutdown=10,
        )
    )
    try:
        # Signals are caught before the run is announced: a launcher that reads the announcement
        # may stop the coordinator at once, and that stop must be graceful (exit status 0).
        with absorb_reraised_signals(server):
            write_private_json(
                announce,
                {
                    "url": url,
                    "pid": os.getpid(),
                    "enroll_token": app.state.tokens.enroll,
                    "trainer_token": app.state.tokens.trainer,
                    # In the fragment: a browser sends it to no server, proxy or Referer (monitor/dashboard.py).
                    "dashboard_url": f"{dashboard_url}#token={app.state.dashboard_token}",
                },
            )
            announce_start(run_dir, url, dashboard_url)
            server.run(sockets=[sock])  # uvicorn handles SIGTERM/SIGINT: stop accepting, finish requests
    finally:
        sock.close()
        announce.unlink(missing_ok=True)
        if lock is not None:
            os.close(lock)
