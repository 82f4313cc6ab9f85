"""Worker identity: an Ed25519 key pair made on first start, and the request signature it produces.

A signed request carries `X-Decentrl-Timestamp`, `X-Decentrl-Nonce` and `X-Decentrl-Signature`; the
signature covers the method, the path (with query), the timestamp, the nonce and the sha256 of the
body, so a captured request can be neither altered nor (see `replay_guard.py`) sent again. Public keys
travel as the hex of their 32 raw bytes. Imports no torch: the coordinator verifies with it.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from decentrl.weights.signing import load_or_create_key, public_key_hex

KEY_FILE = "worker_key.pem"
TIMESTAMP_HEADER = "X-Decentrl-Timestamp"
NONCE_HEADER = "X-Decentrl-Nonce"
SIGNATURE_HEADER = "X-Decentrl-Signature"
SIGNED_HEADERS = (TIMESTAMP_HEADER, NONCE_HEADER, SIGNATURE_HEADER)


def signed_message(method: str, path: str, timestamp: str, nonce: str, body: bytes) -> bytes:
    """The bytes a request signature covers (the one definition for signer and verifier)."""
    digest = hashlib.sha256(body).hexdigest()
    return "\n".join(("decentrl-v1", method.upper(), path, timestamp, nonce, digest)).encode()


def load_or_create_worker_key(state_dir: Path) -> Ed25519PrivateKey:
    """The worker's key in `state_dir/worker_key.pem` (mode 0600), created on first start."""
    return load_or_create_key(state_dir / KEY_FILE)


class Signer(httpx.Auth):
    """Signs requests with a worker's private key; as an `httpx.Auth`, every send (each retry
    included) gets a fresh timestamp and nonce."""

    requires_request_body = True

    def __init__(self, key: Ed25519PrivateKey) -> None:
        self.key = key
        self.public_key = public_key_hex(key)
        self.offset = 0.0
        """Seconds added to the local clock: the coordinator's time minus ours, once it told us."""

    def headers(self, method: str, path: str, body: bytes, now: float | None = None) -> dict[str, str]:
        timestamp = f"{time.time() + self.offset if now is None else now:.3f}"
        nonce = secrets.token_hex(16)
        signature = self.key.sign(signed_message(method, path, timestamp, nonce, body))
        return {TIMESTAMP_HEADER: timestamp, NONCE_HEADER: nonce, SIGNATURE_HEADER: signature.hex()}

    def prove(self, challenge: str) -> str:
        """Hex signature of the registration message for `challenge`: proof that we hold the key."""
        return self.key.sign(registration_message(challenge, self.public_key)).hex()

    def auth_flow(self, request: httpx.Request) -> Iterator[httpx.Request]:
        request.headers.update(self.headers(request.method, request.url.raw_path.decode(), request.content))
        yield request


def registration_message(challenge: str, public_key: str) -> bytes:
    """What a worker signs to prove it holds the key it registers (one definition for both sides)."""
    return "\n".join(("decentrl-register-v1", challenge, public_key)).encode()


def signature_valid(public_key: str, signature_hex: str, message: bytes) -> bool:
    """True when `signature_hex` is a valid Ed25519 signature of `message` under the hex public key."""
    try:
        key = Ed25519PublicKey.from_public_bytes(bytes.fromhex(public_key))
        key.verify(bytes.fromhex(signature_hex), message)
    except (ValueError, InvalidSignature):
        return False
    return True
