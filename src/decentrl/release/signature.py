"""The trainer key's signature of a release's provenance, and how a reader names that key.

`decentrl export` signs the exact bytes of `provenance/provenance.json` with the run's trainer key
(the key that signed every weight manifest) and writes the signature next to it. A key is named by
its 64 hex digits or by its fingerprint, `sha256:` and the first 32 hex digits of the SHA-256 of
its raw bytes (128 bits: no one can make a second key with the same fingerprint).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from decentrl.config import ConfigError
from decentrl.release.provenance import ReleaseInvalid
from decentrl.weights.signing import parse_public_key, public_key_hex

DOMAIN = b"decentrl release provenance v1\n"
"""Prefixed to the signed bytes, so no signature of a weight manifest can pass for a release's."""


def fingerprint(public_key: str) -> str:
    return "sha256:" + hashlib.sha256(bytes.fromhex(public_key)).hexdigest()[:32]


def load_signing_key(path: Path, run_public_key: str) -> Ed25519PrivateKey:
    """The run's trainer key from `path`, or a ConfigError naming the fix."""
    if not path.is_file():
        raise ConfigError(
            f"export signs the release with the run's trainer key, and {path} does not exist; run it "
            "where the trainer ran or pass --signing-key (the trainer run directory's trainer/signing_key.pem)"
        )
    key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    if not isinstance(key, Ed25519PrivateKey) or public_key_hex(key) != run_public_key:
        raise ConfigError(
            f"{path} is not the key this run's trainer signed with ({fingerprint(run_public_key)}); "
            "pass --signing-key with the trainer run directory's trainer/signing_key.pem"
        )
    return key


def sign(body: bytes, key: Ed25519PrivateKey) -> str:
    return key.sign(DOMAIN + body).hex()


def check_signature(body: bytes, signature: str, public_key: str) -> None:
    """Raise ReleaseInvalid unless `signature` (hex) signs `body` under `public_key` (hex)."""
    try:
        parse_public_key(public_key).verify(bytes.fromhex(signature.strip()), DOMAIN + body)
    except (InvalidSignature, ValueError):
        raise ReleaseInvalid(
            f"provenance.json is not signed by the key it names ({public_key[:16]}...)"
        ) from None


def key_matches(pinned: str, public_key: str) -> bool:
    """Whether `pinned` (a key's 64 hex digits or its fingerprint) names `public_key`."""
    text = pinned.strip().lower()
    digits = text.removeprefix("sha256:")
    if len(digits) == 64 and not text.startswith("sha256:"):
        return digits == public_key.lower()
    if len(digits) == 32 and all(c in "0123456789abcdef" for c in digits):
        return "sha256:" + digits == fingerprint(public_key)
    raise ConfigError(
        f"--trainer-key {pinned[:80]!r} is neither a public key (64 hex digits) nor its fingerprint "
        "(sha256: and 32 hex digits, as `decentrl verify-release` prints it)"
    )
