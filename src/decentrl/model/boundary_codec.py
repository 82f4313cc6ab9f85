"""The wire format of hidden states passed from one pipeline stage to the next.

A stage holder receives `[B, T, D]` hidden states from the previous stage and sends its own to the
next one, every decode step, so the boundary is the pipeline's steady traffic: D floats per token
per boundary (SmolLM2-1.7B: 2048 x 4 bytes = 8 KiB a token in float32). Three codecs:

- `float32`: exact (the reference; what a verifier's teacher-forced recomputation compares to).
- `bfloat16`: half the bytes, 8 bits of mantissa (relative error <= 2^-9 per element).
- `int8`: a quarter of the bytes plus one float32 scale per token. Symmetric absmax per token row
  (a scale over the D channels of each [b, t] vector), not one scale per tensor: hidden states carry
  a few "massive activations" (Sun et al. 2024, arXiv:2402.17762) that are 100-1000x the rest and
  sit on a few tokens (the first token, delimiters); one tensor-wide scale would give every other
  token a handful of levels, while a per-token scale confines the damage to the outlier's own row.
  The error is at most half a step, absmax / 254, of each row.

Layout (little-endian): float32 and bfloat16 are the tensor's elements in row-major order; int8 is
the B*T float32 scales, then the B*T*D int8 values. `decode` is fed bytes from another machine, so
it checks the byte count against the shape it expects and refuses non-finite or absurd values.
"""

from __future__ import annotations

import math
from typing import Literal, get_args

import numpy as np
import torch

from decentrl.stage_wire import bytes_per_token

Codec = Literal["float32", "bfloat16", "int8"]
CODECS: tuple[Codec, ...] = get_args(Codec)

INT8_LEVELS = 127  # symmetric: -127..127, so +absmax and -absmax are both exact
MAX_ABS = 65504.0
"""Largest magnitude a decoded hidden state may have: float16's largest finite value. Real hidden
states stay far below (massive activations reach a few thousand); a stage computing in float16
would overflow on anything larger, and random bytes read as floats exceed it almost surely."""


class BoundaryDataError(ValueError):
    """Hidden-state bytes from a peer that do not decode to the expected, plausible tensor."""


def encode(hidden_btd: torch.Tensor, codec: Codec) -> bytes:
    """The wire bytes of hidden states [..., D] (any float dtype, any device)."""
    hidden = hidden_btd.detach().to("cpu", torch.float32).contiguous()
    if codec == "float32":
        return hidden.numpy().astype("<f4", copy=False).tobytes()
    if codec == "bfloat16":
        return hidden.to(torch.bfloat16).view(torch.int16).numpy().astype("<i2", copy=False).tobytes()
    rows_nd = hidden.reshape(-1, hidden.shape[-1])
    scale_n = rows_nd.abs().amax(-1) / INT8_LEVELS
    # An all-zero row has scale 0; dividing by a tiny floor keeps its values 0 instead of NaN.
    values_nd = torch.round(rows_nd / scale_n.clamp(min=1e-30)[:, None]).clamp(-INT8_LEVELS, INT8_LEVELS)
    scales = scale_n.numpy().astype("<f4", copy=False).tobytes()
    return scales + values_nd.to(torch.int8).numpy().tobytes()


def decode(data: bytes, codec: str, shape: tuple[int, ...]) -> torch.Tensor:
    """float32 hidden states of `shape` from wire bytes (`codec` as a peer named it); BoundaryDataError
    if they do not fit."""
    if codec not in CODECS:
        raise BoundaryDataError(f"unknown boundary codec {codec!r}; expected one of {list(CODECS)}")
    if not shape or any(n <= 0 for n in shape):
        raise BoundaryDataError(f"hidden-state shape {list(shape)} must have positive sizes")
    rows, hidden_size = math.prod(shape[:-1]), shape[-1]
    expected = rows * bytes_per_token(codec, hidden_size)
    if len(data) != expected:
        raise BoundaryDataError(
            f"{codec} hidden states of shape {list(shape)} take {expected} bytes, got {len(data)}"
        )
    if codec == "float32":
        hidden = torch.from_numpy(np.frombuffer(data, dtype="<f4").astype(np.float32))
    elif codec == "bfloat16":
        raw = torch.from_numpy(np.frombuffer(data, dtype="<i2").astype(np.int16))
        hidden = raw.view(torch.bfloat16).float()
    else:
        scale_n = torch.from_numpy(np.frombuffer(data, dtype="<f4", count=rows).astype(np.float32))
        values = np.frombuffer(data, dtype=np.int8, offset=4 * rows).astype(np.float32)
        if not bool(torch.isfinite(scale_n).all()) or bool((scale_n < 0).any()):
            raise BoundaryDataError("int8 hidden states carry a negative or non-finite row scale")
        hidden = torch.from_numpy(values).reshape(rows, hidden_size) * scale_n[:, None]
    if not bool(torch.isfinite(hidden).all()):
        raise BoundaryDataError(f"{codec} hidden states contain NaN or infinite values")
    if hidden.numel() and float(hidden.abs().max()) > MAX_ABS:
        raise BoundaryDataError(
            f"{codec} hidden states reach {float(hidden.abs().max()):.3g}, beyond the plausible {MAX_ABS:g}"
        )
    return hidden.reshape(shape)
