"""Catch-up patches: exact from every version since the anchor, refused below it, planned when
cheapest, and signed like every manifest."""

from __future__ import annotations

import pytest
import torch

from decentrl.protocol import WeightsEntry
from decentrl.weights.codec import changed_mask, decode_state, encode_patch, published_state, state_hash
from decentrl.weights.manifest import check_layout, signed_bytes
from decentrl.weights.planner import NoRoute, plan
from decentrl.weights.publisher import Anchor, build_manifest, build_patch
from decentrl.weights.signing import (
    BadSignature,
    load_or_create_key,
    parse_public_key,
    public_key_hex,
    sign,
    verify,
)
from decentrl.weights.sync import VerificationFailed, WeightSync

DTYPES = ["bfloat16", "float16", "float32"]
BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def history(dtype: str, versions: int = 7) -> list[dict[str, torch.Tensor]]:
    """Published states v0..v6: `w` moves 1 % of its elements per version (some change at v2 and
    change back at v4), `whole` is rewritten at v3, `frozen` never moves, `special` toggles NaN,
    signed zero and infinity. v1 also moves elements of `w` that never move again."""
    generator = torch.Generator().manual_seed(0)
    current = {
        "w": torch.randn(300, 257, generator=generator) * 0.05,
        "whole": torch.randn(4, 8, generator=generator),
        "frozen": torch.randn(64, generator=generator),
        "special": torch.tensor([1.0, 0.0, 2.0]),
    }
    states = [published_state(current, dtype)]
    for version in range(1, versions):
        current = {name: tensor.clone() for name, tensor in current.items()}
        moved = torch.rand(current["w"].shape, generator=generator) < 0.01
        current["w"] += moved * 0.01 * torch.randn(current["w"].shape, generator=generator)
        if version == 3:
            current["whole"] = torch.randn(4, 8, generator=generator)
        if version == 5:
            current["special"] = torch.tensor([float("nan"), -0.0, float("inf")])
        state = published_state(current, dtype)
        if version == 4:  # back to their v1 values, bit for bit
            back = changed_mask(states[1]["w"], states[2]["w"]).reshape(state["w"].shape)
            state["w"][back] = states[1]["w"][back]
        states.append(state)
    return states


def union_since(states: list[dict[str, torch.Tensor]], anchor: int, version: int) -> dict[str, torch.Tensor]:
    union = {name: torch.zeros(t.numel(), dtype=torch.bool) for name, t in states[anchor].items()}
    for step in range(anchor + 1, version + 1):
        for name in union:
            union[name] |= changed_mask(states[step - 1][name], states[step][name])
    return union


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(BITS[a.dtype]), b.view(BITS[b.dtype]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_patch_turns_every_version_since_its_anchor_into_the_target_bit_exactly(dtype: str) -> None:
    states = history(dtype)
    anchor, target = 1, 6
    entries, payload = encode_patch(states[target], union_since(states, anchor, target))
    encodings = {entry.name: entry.encoding for entry in entries}
    assert encodings == {"w": "scatter", "whole": "raw", "frozen": "same", "special": "raw"}
    unmasked = {k: v for k, v in union_since(states, anchor, target).items() if k != "frozen"}
    assert encode_patch(states[target], unmasked) == (entries, payload)  # no mask: never changed
    for held in range(anchor, target):
        state = {name: tensor.clone() for name, tensor in states[held].items()}
        decode_state(entries, payload, state)
        assert all(same_bits(state[name], states[target][name]) for name in state), held
        assert state_hash(state) == state_hash(states[target])
    # Below the anchor, elements that moved only at v1 keep their v0 values: why sync refuses it.
    below = {name: tensor.clone() for name, tensor in states[0].items()}
    decode_state(entries, payload, below)
    assert state_hash(below) != state_hash(states[target])
    # The elements that changed and changed back are in the union, overwritten with their value.
    flipped = changed_mask(states[1]["w"], states[2]["w"])
    assert union_since(states, anchor, target)["w"][flipped].all()


def make_patch(version: int = 6, anchor: int = 1, dtype: str = "bfloat16"):
    states = history(dtype)
    base = Anchor(anchor, state_hash(states[anchor]), 1 << 20, union_since(states, anchor, version), True)
    manifest, _ = build_patch(version, states[version], base, dtype, 1024, state_hash(states[version]))
    return manifest, states


def test_patch_layout_and_signature(tmp_path) -> None:
    patch, states = make_patch()
    assert patch.kind == "patch" and check_layout(patch) is None
    assert "anchor" in check_layout(patch.model_copy(update={"anchor": 6}))
    assert "anchor" in check_layout(patch.model_copy(update={"anchor_state_sha256": None}))
    assert "no parent" in check_layout(patch.model_copy(update={"parent": 5}))
    for encoding in ("xor", "sparse"):  # they depend on the exact base state
        tensors = [patch.tensors[0].model_copy(update={"encoding": encoding}), *patch.tensors[1:]]
        assert f"encoding {encoding}" in check_layout(patch.model_copy(update={"tensors": tensors}))
    delta, _ = build_manifest(
        2, states[1], states[2], "bfloat16", 1024, state_hash(states[2]), state_hash(states[1])
    )
    assert "no anchor" in check_layout(delta.model_copy(update={"anchor": 1}))
    tensors = [t.model_copy(update={"encoding": "scatter"}) for t in delta.tensors]
    assert "encoding scatter" in check_layout(delta.model_copy(update={"tensors": tensors}))
    # Deltas and snapshots sign exactly the bytes they signed before patches existed.
    assert b"anchor" not in signed_bytes(delta) and b'"anchor":1' in signed_bytes(patch)
    key = load_or_create_key(tmp_path / "key.pem")
    public = parse_public_key(public_key_hex(key))
    signed = sign(patch, key)
    verify(signed, public)
    with pytest.raises(BadSignature):  # re-anchoring a signed patch breaks its signature
        verify(signed.model_copy(update={"anchor": 0, "anchor_state_sha256": state_hash(states[0])}), public)
    with pytest.raises(BadSignature):
        verify(sign(patch, load_or_create_key(tmp_path / "other.pem")), public)


@pytest.mark.parametrize("held", [0, 1, 3, 5, 6])
def test_sync_applies_a_patch_only_from_its_anchor_up(held: int) -> None:
    patch, states = make_patch()
    sync = WeightSync(client=None, public_key=None, fetcher=None)  # only its chain check is used
    sync.version, sync._state_sha256 = held, state_hash(states[held])
    if 1 <= held < 6:
        sync._check_chain([patch])
    else:  # below the anchor it would leave stale elements; at or above the target it is no step
        with pytest.raises(VerificationFailed, match="does not apply to"):
            sync._check_chain([patch])
    sync.version, sync._state_sha256 = 1, state_hash(states[2])  # "v1" with another state
    with pytest.raises(VerificationFailed):
        sync._check_chain([patch])


def index(
    deltas: dict[int, int], snapshots: dict[int, int], patches: dict[tuple[int, int], int]
) -> list[WeightsEntry]:
    entry = WeightsEntry.model_validate
    return (
        [
            entry({"version": v, "kind": "delta", "payload_bytes": b, "state_sha256": "0" * 64})
            for v, b in deltas.items()
        ]
        + [
            entry({"version": v, "kind": "snapshot", "payload_bytes": b, "state_sha256": "0" * 64})
            for v, b in snapshots.items()
        ]
        + [
            entry({"version": v, "kind": "patch", "payload_bytes": b, "state_sha256": "0" * 64, "anchor": s})
            for (v, s), b in patches.items()
        ]
    )


def test_planner_takes_a_patch_when_cheaper_and_the_chain_when_that_is() -> None:
    deltas = {v: 10 for v in range(1, 61)}
    snapshots = {0: 1000, 20: 1000, 40: 1000, 60: 1000}
    patches = {(v, 0): 25 for v in range(2, 61)} | {(v, 40): 22 for v in range(42, 61)}
    everything = index(deltas, snapshots, patches)
    route = plan(5, 57, everything)  # 52 deltas (520 B) or snapshot 40 + 17 deltas: the patch (25 B)
    assert route.steps == [(57, "patch")] and route.num_bytes == 25
    assert route.description == "patch v57 (anchor v0)"
    route = plan(45, 57, everything)  # the newer anchor's patch is cheaper and applies from 45
    assert route.description == "patch v57 (anchor v40)" and route.num_bytes == 22
    assert plan(55, 57, everything).steps == [(56, "delta"), (57, "delta")]  # 20 B < 22 B
    route = plan(None, 57, everything)
    assert route.description == "snapshot v40 + patch v57 (anchor v40)" and route.num_bytes == 1022
    # A patch to an intermediate version, then deltas, when the target has no patch.
    gaps = index(deltas, snapshots, {k: b for k, b in patches.items() if k[0] != 57})
    route = plan(5, 57, gaps)
    assert route.description == "patch v56 (anchor v0) + 1 deltas" and route.num_bytes == 35
    # Never from below a patch's anchor: from v39, first the delta up to the anchor.
    only_new = index({v: 100 for v in range(1, 61)}, {0: 10_000}, {(57, 40): 15})
    route = plan(39, 57, only_new)
    assert route.description == "delta v40 + patch v57 (anchor v40)" and route.num_bytes == 115
    with pytest.raises(NoRoute):
        plan(39, 57, index({}, {}, {(57, 40): 15}))
    assert plan(41, 57, index({}, {}, {(57, 40): 15})).steps == [(57, "patch")]
