"""A worker's identity: an Ed25519 key (`worker_key.pem`, made on first start) that signs every
request, and the worker id + token the coordinator gave it for that key (`credentials.json`)."""

from __future__ import annotations

import fcntl
import json
import logging
import os
from pathlib import Path

from pydantic import BaseModel

from decentrl.client import CoordinatorClient, RequestRejected
from decentrl.config import ConfigError, WorkerConfig
from decentrl.engines.registry import declared_precision
from decentrl.protocol import RegisterRequest
from decentrl.trust.identity import Signer, load_or_create_worker_key
from decentrl.trust.logprob_tolerance import engine_class

log = logging.getLogger(__name__)

CREDENTIALS_FILE = "credentials.json"
LOCK_FILE = "worker.lock"


def hold_state_dir(state_dir: Path) -> int:
    """Take `state_dir` for this process (an flock, released when it exits, however it exits) and
    return the lock's descriptor. Two workers on one state directory share one key: each
    registering again would replace the other's token, so the second is refused at start."""
    fd = os.open(state_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise ConfigError(
            f"another worker (pid {holder}) uses --state-dir {state_dir}: give each worker its own"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


class Credentials(BaseModel):
    worker_id: str
    token: str
    coordinator_url: str
    engine_class: str | None = None
    """The engine/dtype/device registered with; another one on a later start registers again, so
    that the verifier holds the worker to the tolerance of what it runs now."""


def load_credentials(state_dir: Path, coordinator_url: str) -> Credentials | None:
    """Saved credentials for this coordinator, or None (none saved, unreadable, or another coordinator)."""
    path = state_dir / CREDENTIALS_FILE
    if not path.is_file():
        return None
    try:
        credentials = Credentials.model_validate_json(path.read_text())
    except ValueError as exc:
        log.warning("ignoring unreadable %s (%s); registering again", path, exc)
        return None
    return credentials if credentials.coordinator_url == coordinator_url.rstrip("/") else None


def save_credentials(state_dir: Path, credentials: Credentials) -> None:
    """Write atomically, readable by the owner only (the token is a secret)."""
    state_dir.mkdir(parents=True, exist_ok=True)
    path = state_dir / CREDENTIALS_FILE
    temporary = path.with_suffix(".tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as file:
        json.dump(credentials.model_dump(), file)
    os.replace(temporary, path)


def use_key(client: CoordinatorClient, state_dir: Path) -> Signer:
    """Sign `client`'s requests with this worker's key (created in `state_dir` on first start)."""
    if client.signer is None:
        client.signer = Signer(load_or_create_worker_key(state_dir))
    return client.signer


def register(
    client: CoordinatorClient, config: WorkerConfig, state_dir: Path, refused: str | None = None
) -> Credentials:
    """Register this worker's key (with the enrollment token unless the coordinator is
    permissionless), save the credentials and use them on `client`. `refused`: whose the saved
    credentials are that this coordinator does not accept (another run's)."""
    signer = use_key(client, state_dir)
    dtype, device = declared_precision(config)
    request = RegisterRequest(
        name=config.name, engine=config.engine, dtype=dtype, device=device, public_key=signer.public_key
    )
    try:
        answer = client.register(request, config.token)
    except RequestRejected as exc:
        if exc.status == 401 and config.token is None:  # a permissionless coordinator needs no token
            saved = (
                f"the credentials saved in {state_dir} are {refused}, not this run's"
                if refused
                else "this worker has no saved credentials"
            )
            raise ConfigError(
                f"{saved} and the coordinator at {client.url} is permissioned; pass its "
                "enrollment token with --token (from tokens.json in the coordinator's run directory)"
            ) from None
        raise
    credentials = Credentials(
        worker_id=answer.worker_id,
        token=answer.token,
        coordinator_url=client.url,
        engine_class=engine_class(config.engine, dtype, device),
    )
    save_credentials(state_dir, credentials)
    client.token = credentials.token
    log.info("registered as %s (credentials in %s)", answer.worker_id, state_dir / CREDENTIALS_FILE)
    return credentials


def authenticate(client: CoordinatorClient, config: WorkerConfig, state_dir: Path) -> Credentials:
    """Reuse saved credentials when the coordinator still accepts them, else register; sets `client.token`."""
    use_key(client, state_dir)
    credentials = load_credentials(state_dir, client.url)
    if credentials is None and (state_dir / CREDENTIALS_FILE).is_file():
        log.warning("the credentials in %s are for another coordinator; registering again", state_dir)
        return register(client, config, state_dir, refused="another coordinator's")
    if credentials is not None and credentials.engine_class != engine_class(
        config.engine, *declared_precision(config)
    ):
        log.info("the engine class changed since %s registered; registering it again", credentials.worker_id)
        credentials = None
    if credentials is not None:
        client.token = credentials.token
        try:
            client.info()
            log.info("reusing credentials of %s", credentials.worker_id)
            return credentials
        except RequestRejected as exc:
            if exc.status != 401:  # 403 (e.g. quarantined) must not be dodged by re-registering
                raise
            log.warning("saved credentials refused (%s); registering again", exc.detail)
            return register(client, config, state_dir, refused=f"{credentials.worker_id}'s")
    return register(client, config, state_dir)
