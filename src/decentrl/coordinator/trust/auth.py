"""Who may call: the enrollment token (register only), the trainer token, and each worker.

Shared tokens come from the config or are generated once and kept in `run_dir/tokens.json`
(mode 0600), so a restarted coordinator accepts the same credentials. A worker registers an
Ed25519 public key, proving that it holds the private key by signing a fresh server challenge
(a public key alone is public: without the proof anyone could claim a victim's identity), and gets
a random bearer token whose sha256 alone is stored; with
`trust.signed_requests` every later request must also carry a fresh signature under that key
(`trust/identity.py`, `trust/replay_guard.py`), so neither a copy of the database nor a captured
request lets anyone act as the worker. `Gate` applies all of it, plus the rate limits, to each
worker request (docs/security.md).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
from dataclasses import dataclass
from pathlib import Path

from decentrl.config import CoordinatorConfig
from decentrl.coordinator.context import Context
from decentrl.coordinator.db.store import remember_nonce
from decentrl.coordinator.http.errors import ApiError, Reason
from decentrl.dbapi import Connection
from decentrl.private_files import write_private_json
from decentrl.protocol import Challenge, RegisterRequest, RegisterResponse
from decentrl.trust.identity import registration_message, signature_valid

TOKENS_FILE = "tokens.json"
CHALLENGE_SECONDS = 300.0
"""How long a registration challenge may be used (once)."""


@dataclass(frozen=True)
class Tokens:
    enroll: str
    trainer: str


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
        raise ApiError(401, "missing Authorization header; send 'Authorization: Bearer <token>'", Reason.AUTH)
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise ApiError(401, "malformed Authorization header; expected 'Bearer <token>'", Reason.AUTH)
    return token.strip()


def same_token(given: str, expected: str) -> bool:
    return hmac.compare_digest(given.encode(), expected.encode())


def _mac(context: Context, text: str) -> str:
    return hmac.new(context.challenge_key, text.encode(), hashlib.sha256).hexdigest()[:32]


def issue_challenge(context: Context) -> Challenge:
    """A challenge that needs no storage: issue time and randomness, authenticated by an HMAC under
    the run's secret; it is recorded (spent) only when a registration uses it."""
    now = context.clock()
    body = f"{int(now)}.{secrets.token_hex(16)}"
    return Challenge(challenge=f"{body}.{_mac(context, body)}", server_time=now)


def _check_proof(db: Connection, context: Context, request: RegisterRequest, now: float) -> None:
    """Refuse (401, no state kept) unless `request.proof` signs a fresh, unspent challenge with the
    private key of `request.public_key`."""
    if request.challenge is None or request.proof is None:
        detail = (
            "registering a public key needs proof of its private key: sign a challenge from"
            " POST /v1/workers/challenge and send challenge and proof (decentrl workers do this)"
        )
        raise ApiError(401, detail, Reason.REGISTRATION_PROOF)
    body, _, mac = request.challenge.rpartition(".")
    issued = body.partition(".")[0]
    if not (body and issued.isdigit() and hmac.compare_digest(mac, _mac(context, body))):
        raise ApiError(401, "unknown registration challenge; ask for a new one", Reason.REGISTRATION_PROOF)
    if not 0 <= now - int(issued) <= CHALLENGE_SECONDS:
        raise ApiError(401, "registration challenge expired; ask for a new one", Reason.REGISTRATION_PROOF)
    assert request.public_key is not None
    message = registration_message(request.challenge, request.public_key)
    if not signature_valid(request.public_key, request.proof, message):
        raise ApiError(401, "registration proof does not verify under public_key", Reason.REGISTRATION_PROOF)
    if not remember_nonce(db, "register", request.challenge, int(issued) + CHALLENGE_SECONDS + 1):
        raise ApiError(
            401, "registration challenge already used; ask for a new one", Reason.REGISTRATION_PROOF
        )


def register_worker(context: Context, request: RegisterRequest, address: str = "") -> RegisterResponse:
    """A new worker, or a fresh token for the worker that already holds this public key.

    One key is one identity: re-registering a key returns its worker (still quarantined, if it was),
    so a quarantine cannot be shed by registering again; a new identity needs a new key, which needs
    the enrollment token or, permissionless, fits in the per-address registration limit. Either way
    the registrant proves it holds the key's private half (`_check_proof`).
    """
    if request.public_key is None and context.run.trust.signed_requests:
        raise ApiError(
            422,
            "registration needs public_key (hex Ed25519 key): this coordinator requires signed requests",
            Reason.SCHEMA,
        )
    token = secrets.token_urlsafe(32)
    now = context.clock()
    with context.store.transaction() as db:
        known = None
        if request.public_key is not None:
            _check_proof(db, context, request, now)
            known = db.execute(
                "SELECT worker_id FROM worker_keys WHERE public_key = ?", (request.public_key,)
            ).fetchone()
        if known is not None:
            worker_id = known["worker_id"]
            # The same identity may come back on another engine: it is judged on what it runs now
            # (the tolerance of any class it can declare is bounded, trust/logprob_tolerance.py).
            db.execute(
                "UPDATE workers SET token_sha256 = ?, last_seen = ?, engine = ?, dtype = ?, device = ?"
                " WHERE worker_id = ?",
                (hash_token(token), now, request.engine, request.dtype, request.device, worker_id),
            )
            return RegisterResponse(worker_id=worker_id, token=token)
        worker_id = f"{request.name}-{secrets.token_hex(4)}"
        db.execute(
            "INSERT INTO workers (worker_id, name, engine, dtype, device, token_sha256, registered, last_seen)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (
                worker_id,
                request.name,
                request.engine,
                request.dtype,
                request.device,
                hash_token(token),
                now,
                now,
            ),
        )
        if request.public_key is not None:
            db.execute(
                "INSERT INTO worker_keys (worker_id, public_key, address, registered) VALUES (?, ?, ?, ?)",
                (worker_id, request.public_key, address, now),
            )
    return RegisterResponse(worker_id=worker_id, token=token)
