"""The hidden-state wire codec between pipeline stages: its error bounds, its byte counts, and the
bytes from a peer it refuses."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from decentrl.model.boundary_codec import CODECS, BoundaryDataError, bytes_per_token, decode, encode

SHAPE = (2, 5, 64)


def hidden_states() -> torch.Tensor:
    """Hidden states with one massive activation, as real models have on their first token."""
    hidden_btd = torch.randn(SHAPE, generator=torch.Generator().manual_seed(0))
    hidden_btd[0, 0, 3] = 900.0
    return hidden_btd


def test_float32_is_exact_and_bfloat16_is_within_its_rounding() -> None:
    hidden_btd = hidden_states()
    assert torch.equal(decode(encode(hidden_btd, "float32"), "float32", SHAPE), hidden_btd)
    bf16 = decode(encode(hidden_btd, "bfloat16"), "bfloat16", SHAPE)
    assert bf16.dtype == torch.float32
    assert float(((bf16 - hidden_btd).abs() / hidden_btd.abs()).max()) < 1e-2  # 2^-9 rounding


def test_int8_error_is_a_fraction_of_each_rows_absmax() -> None:
    hidden_btd = hidden_states()
    int8 = decode(encode(hidden_btd, "int8"), "int8", SHAPE)
    absmax_bt1 = hidden_btd.abs().amax(-1, keepdim=True)
    assert float(((int8 - hidden_btd).abs() / absmax_bt1).max()) < 1.5e-2
    # The outlier's row alone is coarse; a per-tensor scale would give every row 900 / 127 steps.
    others = (int8 - hidden_btd)[1].abs().max()
    assert float(others) < float(hidden_btd[1].abs().max()) / 200
    zeros = torch.zeros(1, 2, 8)
    assert torch.equal(decode(encode(zeros, "int8"), "int8", (1, 2, 8)), zeros)  # no 0 / 0


def test_bytes_per_token_by_hand() -> None:
    assert bytes_per_token("float32", 2048) == 8192
    assert bytes_per_token("bfloat16", 2048) == 4096
    assert bytes_per_token("int8", 2048) == 2052  # 2048 int8 values + one float32 scale
    for codec in CODECS:
        data = encode(hidden_states(), codec)
        assert len(data) == math.prod(SHAPE[:-1]) * bytes_per_token(codec, SHAPE[-1])


@pytest.mark.parametrize("codec", CODECS)
def test_wrong_byte_counts_are_refused(codec) -> None:
    data = encode(hidden_states(), codec)
    with pytest.raises(BoundaryDataError, match=f"take {len(data)} bytes, got {len(data) - 1}"):
        decode(data[:-1], codec, SHAPE)
    with pytest.raises(BoundaryDataError, match="bytes"):
        decode(data, codec, (2, 4, 64))
    with pytest.raises(BoundaryDataError, match="positive"):
        decode(b"", codec, (0, 64))


def test_nan_infinite_and_absurd_values_are_refused() -> None:
    for bad, message in [
        (float("nan"), "NaN or infinite"),
        (float("inf"), "NaN or infinite"),
        (1e9, "plausible"),
    ]:
        hidden_btd = hidden_states()
        hidden_btd[1, 2, 3] = bad
        for codec in ("float32", "bfloat16"):
            with pytest.raises(BoundaryDataError, match=message):
                decode(encode(hidden_btd, codec), codec, SHAPE)
    data = bytearray(encode(hidden_states(), "int8"))
    data[:4] = np.array([np.nan], dtype="<f4").tobytes()  # the first row's scale
    with pytest.raises(BoundaryDataError, match="row scale"):
        decode(bytes(data), "int8", SHAPE)
    with pytest.raises(BoundaryDataError, match="unknown boundary codec"):
        decode(b"", "fp8", SHAPE)  # pyright: ignore[reportArgumentType]
