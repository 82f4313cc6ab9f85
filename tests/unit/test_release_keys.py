"""What a release shows others: store passwords masked wherever a config or a connection error is
written, and a trainer key named by its hex or its fingerprint (`--trainer-key`)."""

from __future__ import annotations

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from decentrl import pgsql
from decentrl.config import ConfigError, load_config, redact, shareable
from decentrl.release.signature import fingerprint, key_matches
from decentrl.weights.signing import public_key_hex


def test_redact_masks_url_passwords_and_password_parameters():
    assert redact("postgresql://run:hunter2@db:5432/run") == "postgresql://run:***@db:5432/run"
    assert redact("postgres://run:p@ss@db/run?sslmode=require") == "postgres://run:***@db/run?sslmode=require"
    assert redact("postgresql://db/run?password=hunter2&sslmode=require") == (
        "postgresql://db/run?password=***&sslmode=require"
    )
    assert redact("host=db password=hunter2 user=run") == "host=db password=*** user=run"
    assert redact("postgresql://run@db/run and http://example.org:8000/v1") == (
        "postgresql://run@db/run and http://example.org:8000/v1"
    )


def test_shareable_config_masks_the_store_password_and_leaves_out_tokens():
    config = load_config(
        None, ["coordinator.store='postgresql://run:hunter2@db/run'", "trainer.token='secret-token'"]
    )
    shown = shareable(config)
    assert shown["coordinator"]["store"] == "postgresql://run:***@db/run"
    assert "hunter2" not in str(shown) and "secret-token" not in str(shown)


def test_cannot_connect_names_the_store_without_its_password():
    with pytest.raises(ConfigError, match="cannot connect to coordinator.store") as caught:
        pgsql.connect("postgresql://run:hunter2@127.0.0.1:9/run")  # a closed port: refused at once
    assert "hunter2" not in str(caught.value) and "postgresql://run:***@127.0.0.1:9/run" in str(caught.value)


def test_a_trainer_key_is_pinned_by_its_hex_or_its_fingerprint():
    key, other = (public_key_hex(Ed25519PrivateKey.generate()) for _ in range(2))
    assert fingerprint(key).startswith("sha256:") and len(fingerprint(key)) == len("sha256:") + 32
    assert key_matches(key, key) and key_matches(key.upper(), key) and not key_matches(other, key)
    assert key_matches(fingerprint(key), key) and key_matches(fingerprint(key)[7:], key)
    assert not key_matches(fingerprint(other), key)
    with pytest.raises(ConfigError, match="neither a public key"):
        key_matches(key[:20], key)
