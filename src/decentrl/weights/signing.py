"""Ed25519 signing of manifests (the `cryptography` library).

The trainer's private key lives in its run directory (`trainer/signing_key.pem`, mode 0600) and
never leaves it; the public key (hex of the 32 raw bytes) is registered with the coordinator and
handed to workers, who may also pin it in their config (`worker.trainer_public_key`).
"""

from __future__ import annotations

import os
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from decentrl.weights.manifest import Manifest, signed_bytes


class BadSignature(ValueError):
    """A manifest is unsigned, or its signature does not verify under the trainer's public key."""


def load_or_create_key(path: Path) -> Ed25519PrivateKey:
    """The trainer's key at `path`, created (mode 0600) on first use."""
    if path.is_file():
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
        assert isinstance(key, Ed25519PrivateKey), f"{path} is not an Ed25519 key"
        return key
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "wb") as handle:
        handle.write(pem)
        handle.flush()
        os.fsync(handle.fileno())
    return key


def public_key_hex(key: Ed25519PrivateKey) -> str:
    raw = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return raw.hex()


def parse_public_key(text: str) -> Ed25519PublicKey:
    """A public key from its 64 hex digits; ValueError with the fix when malformed."""
    try:
        raw = bytes.fromhex(text.strip())
        if len(raw) != 32:
            raise ValueError
        return Ed25519PublicKey.from_public_bytes(raw)
    except ValueError:
        raise ValueError(
            f"trainer public key {text[:80]!r} is not 64 hex digits (an Ed25519 public key)"
        ) from None


def sign(manifest: Manifest, key: Ed25519PrivateKey) -> Manifest:
    return manifest.model_copy(update={"signature": key.sign(signed_bytes(manifest)).hex()})


def verify(manifest: Manifest, public_key: Ed25519PublicKey) -> None:
    """Raise `BadSignature` unless the manifest carries a valid signature by `public_key`."""
    if not manifest.signature:
        raise BadSignature(f"manifest v{manifest.version} ({manifest.kind}) is unsigned")
    try:
        public_key.verify(bytes.fromhex(manifest.signature), signed_bytes(manifest))
    except (InvalidSignature, ValueError):
        raise BadSignature(
            f"manifest v{manifest.version} ({manifest.kind}) is not signed by the trainer's key"
        ) from None
