"""Manifests: signatures bind every field; layout checks; the catch-up planner picks the cheapest route."""

from __future__ import annotations

import pytest
import torch

from decentrl.protocol import WeightsEntry
from decentrl.weights.codec import published_state, state_hash
from decentrl.weights.manifest import check_layout
from decentrl.weights.planner import NoRoute, plan
from decentrl.weights.publisher import build_manifest
from decentrl.weights.signing import (
    BadSignature,
    load_or_create_key,
    parse_public_key,
    public_key_hex,
    sign,
    verify,
)


def make_manifest(version: int = 3, delta: bool = True):
    old = published_state({"w": torch.zeros(64)}, "bfloat16")
    new = published_state({"w": torch.arange(64.0)}, "bfloat16")
    manifest, pieces = build_manifest(
        version,
        old if delta else None,
        new,
        "bfloat16",
        1024,
        state_hash(new),
        state_hash(old) if delta else None,
    )
    return manifest, pieces


def test_signature_binds_every_field(tmp_path) -> None:
    key = load_or_create_key(tmp_path / "key.pem")
    assert (tmp_path / "key.pem").stat().st_mode & 0o777 == 0o600
    assert public_key_hex(load_or_create_key(tmp_path / "key.pem")) == public_key_hex(key)  # reloaded
    public = parse_public_key(public_key_hex(key))
    manifest, _ = make_manifest()
    with pytest.raises(BadSignature, match="unsigned"):
        verify(manifest, public)
    signed = sign(manifest, key)
    verify(signed, public)
    for change in ({"version": 4}, {"state_sha256": "0" * 64}, {"payload_bytes": signed.payload_bytes + 1}):
        with pytest.raises(BadSignature):
            verify(signed.model_copy(update=change), public)
    other = load_or_create_key(tmp_path / "other.pem")
    with pytest.raises(BadSignature):
        verify(sign(manifest, other), public)
    with pytest.raises(ValueError, match="64 hex digits"):
        parse_public_key("abc")


def test_layout_checks() -> None:
    manifest, _ = make_manifest()
    assert check_layout(manifest) is None
    assert "payload_bytes" in check_layout(manifest.model_copy(update={"payload_bytes": 1}))
    assert "parent" in check_layout(manifest.model_copy(update={"parent": 1}))
    assert "upgrade decentrl" in check_layout(manifest.model_copy(update={"format": 1}))
    snapshot, _ = make_manifest(delta=False)
    assert check_layout(snapshot) is None and snapshot.parent is None


def entries(deltas: dict[int, int], snapshots: dict[int, int]) -> list[WeightsEntry]:
    return [
        WeightsEntry(version=v, kind="delta", payload_bytes=b, state_sha256="0" * 64)
        for v, b in deltas.items()
    ] + [
        WeightsEntry(version=v, kind="snapshot", payload_bytes=b, state_sha256="0" * 64)
        for v, b in snapshots.items()
    ]


def test_planner_prefers_the_cheapest_route() -> None:
    index = entries({v: 10 for v in range(1, 31)}, {0: 1000, 10: 1000, 20: 1000, 30: 1000})
    route = plan(5, 25, index)  # 20 deltas (200 B) beat snapshot 20 + 5 deltas (1050 B)
    assert route.steps == [(v, "delta") for v in range(6, 26)] and route.num_bytes == 200
    route = plan(None, 25, index)
    assert route.steps[0] == (20, "snapshot") and len(route.steps) == 6 and route.num_bytes == 1050
    expensive = entries({v: 100 for v in range(1, 31)}, {0: 1000, 10: 1000, 20: 1000, 30: 1000})
    route = plan(5, 25, expensive)  # 20 x 100 B = 2000 B > 1000 + 5 x 100 B
    assert route.steps[0] == (20, "snapshot") and route.num_bytes == 1500
    assert plan(30, 30, index).steps == []
    gap = [e for e in index if (e.version, e.kind) != (8, "delta")]
    assert plan(5, 15, gap).steps[0] == (10, "snapshot")  # the chain is broken at 8
    with pytest.raises(NoRoute):
        plan(5, 15, [e for e in gap if e.kind == "delta"])  # no snapshot to jump the gap
