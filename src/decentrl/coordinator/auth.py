"""Bearer tokens: the enrollment token (register only), the trainer token, one token per worker.

Shared tokens come from the config or are generated once and kept in `run_dir/tokens.json`
(mode 0600), so a restarted coordinator accepts the same credentials. Worker tokens are random
and only their sha256 is stored: a copy of the database does not let anyone act as a worker.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from decentrl.config import CoordinatorConfig
from decentrl.coordinator.context import ApiError, Context
from decentrl.protocol import RegisterRequest, RegisterResponse

TOKENS_FILE = "tokens.json"


@dataclass(frozen=True)
class Tokens:
    enroll: str
    trainer: str


def write_private_json(path: Path, content: dict) -> None:
    """Write `content` readable by the owner only, atomically (temp file + rename)."""
    temporary = path.with_suffix(path.suffix + ".tmp")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as handle:
        json.dump(content, handle, indent=2)
        handle.flush()
        os.fsync(handle.fileno())
    os.chmod(temporary, 0o600)
    os.replace(temporary, path)


def load_tokens(run_dir: Path, config: CoordinatorConfig) -> Tokens:
    """Configured tokens win; otherwise reuse the run's stored ones; otherwise generate new ones."""
    path = run_dir / TOKENS_FILE
    stored = json.loads(path.read_text()) if path.is_file() else {}
    tokens = Tokens(
        enroll=config.enroll_token or stored.get("enroll_token") or secrets.token_urlsafe(24),
        trainer=config.trainer_token or stored.get("trainer_token") or secrets.token_urlsafe(24),
    )
    wanted = {"enroll_token": tokens.enroll, "trainer_token": tokens.trainer}
    if stored != wanted:
        write_private_json(path, wanted)
    return tokens


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def bearer_token(authorization: str | None) -> str:
    if not authorization:
        raise ApiError(401, "missing Authorization header; send 'Authorization: Bearer <token>'", "auth")
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise ApiError(401, "malformed Authorization header; expected 'Bearer <token>'", "auth")
    return token.strip()


def same_token(given: str, expected: str) -> bool:
    return hmac.compare_digest(given.encode(), expected.encode())


def worker_of(context: Context, token: str) -> str | None:
    """The id of the worker holding `token`, or None."""
    with context.store.transaction() as db:
        row = db.execute("SELECT worker_id FROM workers WHERE token_sha256 = ?", (hash_token(token),))
        found = row.fetchone()
    return None if found is None else found["worker_id"]


def register_worker(context: Context, request: RegisterRequest) -> RegisterResponse:
    worker_id = f"{request.name}-{secrets.token_hex(4)}"
    token = secrets.token_urlsafe(32)
    now = context.clock()
    with context.store.transaction() as db:
        db.execute(
            "INSERT INTO workers (worker_id, name, engine, token_sha256, registered, last_seen)"
            " VALUES (?, ?, ?, ?, ?, ?)",
            (worker_id, request.name, request.engine, hash_token(token), now, now),
        )
    return RegisterResponse(worker_id=worker_id, token=token)
