"""The delta codec is lossless bit for bit, picks the cheaper encoding, and the hash sees every bit."""

from __future__ import annotations

import pytest
import torch

from decentrl.weights.codec import decode_state, encode_state, encode_tensor, published_state, state_hash

DTYPES = ["bfloat16", "float16", "float32"]


def random_states(dtype: str, fraction: float, seed: int = 0) -> tuple[dict, dict]:
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(300, 257, generator=generator) * 0.05
    moved = weight + 1e-3 * torch.randn(weight.shape, generator=generator) * (
        torch.rand(weight.shape, generator=generator) < fraction
    )
    bias = torch.randn(257, generator=generator)
    old = published_state(
        {"w": weight, "b": bias, "special": torch.tensor([float("nan"), -0.0, float("inf")])}, dtype
    )
    new = published_state(
        {"w": moved, "b": bias, "special": torch.tensor([float("nan"), 0.0, -float("inf")])}, dtype
    )
    return old, new


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fraction", [0.0, 0.01, 0.5, 1.0])
def test_delta_and_snapshot_reconstruct_bit_exactly(dtype: str, fraction: float) -> None:
    old, new = random_states(dtype, fraction)
    entries, payload = encode_state(old, new)
    base = {name: tensor.clone() for name, tensor in old.items()}
    changed = decode_state(entries, payload, base)
    for name in new:  # bit patterns, so NaN payloads and signed zeros count too
        assert torch.equal(base[name].view(torch.uint8), new[name].view(torch.uint8)), name
    assert state_hash(base) == state_hash(new)
    assert "b" not in changed and "special" in changed
    assert ("w" in changed) == (fraction > 0)
    entries, payload = encode_state(None, new)
    fresh: dict = {}
    decode_state(entries, payload, fresh)
    assert state_hash(fresh) == state_hash(new)


def test_sparse_wins_for_few_changes_and_xor_for_many() -> None:
    old, new = random_states("bfloat16", 0.005)
    encoding, sparse = encode_tensor(old["w"], new["w"])
    assert encoding == "sparse"
    dense_bytes = new["w"].numel() * 2
    assert len(sparse) < 0.03 * dense_bytes
    old, new = random_states("bfloat16", 1.0)
    assert encode_tensor(old["w"], new["w"])[0] == "xor"
    assert encode_tensor(old["b"], new["b"]) == ("same", b"")


def test_state_hash_sees_one_flipped_bit_names_and_shapes() -> None:
    _, state = random_states("bfloat16", 0.0)
    reference = state_hash(state)
    flipped = {name: tensor.clone() for name, tensor in state.items()}
    flipped["w"].view(torch.int16).view(-1)[12345] ^= 1
    assert state_hash(flipped) != reference
    assert state_hash({"renamed" if k == "b" else k: v for k, v in state.items()}) != reference
    assert state_hash({**state, "b": state["b"].reshape(1, -1)}) != reference


def test_single_element_and_empty_tensors() -> None:
    old = published_state(
        {"one": torch.tensor([1.0]), "none": torch.zeros(0), "scalar": torch.tensor(2.0)}, "bfloat16"
    )
    new = published_state(
        {"one": torch.tensor([3.0]), "none": torch.zeros(0), "scalar": torch.tensor(5.0)}, "bfloat16"
    )
    entries, payload = encode_state(old, new)
    decode_state(entries, payload, old)
    assert state_hash(old) == state_hash(new)


def test_delta_refuses_a_changed_layout() -> None:
    old, new = random_states("float32", 0.1)
    with pytest.raises(ValueError, match="publish a snapshot"):
        encode_state(old, {**new, "extra": torch.zeros(3)})
