"""What a driver and a stage holder say to each other: step requests and answers, and commitments.

A step is one pipeline pass of one stage over a batch of sequences: the prefill of the prompts
(step 0) or one decode position (steps 1, 2, ...). A body is a JSON header line, then the
payload: the stage's input (token ids for stage 0 are never sent; hidden states [B, T, D] in the
named codec otherwise). A non-last stage answers with its output hidden states; the last stage
samples and answers with a token and its log-prob per sequence.

Every holder keeps, per sequence (row) of a session, a hash chain over the payloads it received
and the ones it answered; at the end it signs a `Commitment` to both chains with its registered
key. A driver that altered what passed between stages, or a holder that answered something other
than what it committed to, is caught by comparing chains (docs/pipeline.md). No torch.
"""

from __future__ import annotations

import hashlib
import json

from pydantic import Field

from decentrl.protocol import MAX_VERSION, Label, Wire

MAX_HEADER_BYTES = 256 << 10
MAX_BATCH = 1024
Codec = str  # "float32" | "bfloat16" | "int8": model/boundary_codec.py checks the name


class StepRequest(Wire):
    lease_id: Label = Field(..., max_length=64)
    session: Label = Field(..., min_length=8, max_length=64)
    step: int = Field(..., ge=0, le=1 << 20)
    version: int = Field(..., ge=0, le=MAX_VERSION)
    codec: Label = Field(..., max_length=16)
    shape: list[int] = Field(..., min_length=3, max_length=3)
    """[B, T, D] of the hidden states in the payload (T = 1 for a decode step)."""
    prompt_lengths: list[int] | None = Field(default=None, max_length=MAX_BATCH)
    """Step 0 only: each row's real prompt length (the rest of the T columns is left padding)."""
    temperature: float | None = Field(default=None, ge=0.0, le=10.0)
    """Step 0 only, last stage only: the lease's sampling temperature."""
    seed: int | None = Field(default=None, ge=0, le=1 << 62)
    """Step 0 only, last stage only: the seed of the session's sampling generator."""


class StepAnswer(Wire):
    session: str
    step: int
    version: int
    codec: str | None = None
    shape: list[int] | None = None
    token_ids: list[int] | None = None
    logprobs: list[float] | None = None


class CloseRequest(Wire):
    lease_id: Label = Field(..., max_length=64)
    session: Label = Field(..., min_length=8, max_length=64)


class Commitment(Wire):
    """A holder's signed statement of what it received and answered for each row of a session."""

    holder_id: str
    stage: int
    lease_id: str
    session: str
    version: int
    steps: int
    input_chains: list[str]
    """Per row: the hash chain over the rows of the inputs it received, step by step."""
    output_chains: list[str]
    signature: str = ""
    """Ed25519 (hex) by the holder's registered key over `commitment_bytes`."""


def commitment_bytes(commitment: Commitment) -> bytes:
    """The bytes a holder signs (the one definition for holder and verifier)."""
    fields = commitment.model_dump(exclude={"signature"})
    return (
        b"decentrl-stage-commitment-v1\n" + json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
    )


def chain_start(lease_id: str, session: str, stage: int, row: int, side: str) -> str:
    return hashlib.sha256(
        f"decentrl-stage-chain-v1|{lease_id}|{session}|{stage}|{row}|{side}".encode()
    ).hexdigest()


def chain_next(chain: str, payload: bytes) -> str:
    return hashlib.sha256(bytes.fromhex(chain) + hashlib.sha256(payload).digest()).hexdigest()


def sampled_bytes(token_id: int, logprob: float) -> bytes:
    """The canonical bytes of one row's sampled answer, as the last stage's chain covers them."""
    return json.dumps([token_id, float(logprob)]).encode()


def pack(header: Wire, payload: bytes = b"") -> bytes:
    return header.model_dump_json().encode() + b"\n" + payload


def unpack(body: bytes) -> tuple[bytes, bytes]:
    """(header JSON, payload); ValueError when there is no header line within the limit."""
    end = body.find(b"\n", 0, MAX_HEADER_BYTES)
    if end < 0:
        raise ValueError(
            f"a stage message starts with a JSON header line of at most {MAX_HEADER_BYTES} bytes"
        )
    return body[:end], body[end + 1 :]
