"""What a driver and a stage holder say to each other: step requests and answers, and commitments.

A step is one pipeline pass of one stage over a batch of sequences: the prefill of the prompts
(step 0) or one decode position (steps 1, 2, ...). A body is a JSON header line, then the
payload: the stage's input (token ids for stage 0 are never sent; hidden states [B, T, D] in the
named codec otherwise). A non-last stage answers with its output hidden states; the last stage
samples and answers with a token and its log-prob per sequence.

Every holder keeps, per sequence (row) of a session, a hash chain over the payloads it received
and the ones it answered; at the end it signs a `Commitment` to both chains with its registered
key. A driver that altered what passed between stages, or a holder that answered something other
than what it committed to, is caught by comparing chains (docs/pipeline.md). No torch: the
coordinator checks traces with it.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from typing import Literal
from urllib.parse import quote

from pydantic import Field

from decentrl.protocol import API_PREFIX, MAX_VERSION, PEER_ADDRESS, Label, Wire

MAX_HEADER_BYTES = 256 << 10
CODECS = ("float32", "bfloat16", "int8")
MAX_BATCH = 1024
Codec = str  # "float32" | "bfloat16" | "int8": model/boundary_codec.py checks the name
HopFailure = Literal["unreachable", "refused", "bad_answer", "version_mismatch"]


# ---------------------------------------------------------------- holders and the coordinator


class StageAnnounce(Wire):
    """A stage holder offers its stage's steps at `url` (`worker/stage_server.py`), or through the
    coordinator's relay when it has no address drivers can reach."""

    stage: int = Field(..., ge=1, le=1024)
    url: str | None = Field(default=None, max_length=64, pattern=PEER_ADDRESS)
    """Where it accepts drivers' connections; None: it accepts none (behind NAT or a firewall) and
    serves every step through the relay."""
    version: int = Field(..., ge=-1, le=MAX_VERSION)
    """The newest version of its stage it holds (-1: none yet)."""
    held_versions: list[int] = Field(default_factory=list, max_length=64)
    """Every version it serves now: a holder keeps a window of recent versions, so that drivers on
    any of them find a route while the next version spreads (a route may skip some; empty: only
    `version`)."""
    tokens_per_second: float = Field(default=0.0, ge=0.0, le=1e9)
    """Positions it served per second of compute lately (self-reported; a routing hint only)."""


class StageAnnounced(Wire):
    """The coordinator's answer to an announcement."""

    stage: int
    version: int
    relayed: bool
    """Drivers reach this holder through the relay: it announced no address, or the coordinator
    could not connect to the one it announced. The holder then keeps a relay exchange open."""


RELAY_ACTIONS = ("step", "close")
RELAY_REQUEST_HEADER = "X-Decentrl-Relay-Request"
"""On a relay exchange: the id of the request handed over (response), or answered (request)."""
RELAY_STATUS_HEADER = "X-Decentrl-Relay-Status"
"""On a relay exchange request: the HTTP status of the holder's answer."""
RELAY_PATH_HEADER = "X-Decentrl-Relay-Path"
"""On a relay exchange response: the path the driver signed."""


@dataclass(frozen=True)
class RelayedRequest:
    """A driver's request as the relay hands it to a holder: the path the driver signed, its
    signature headers and the body, byte for byte."""

    request_id: str
    path: str
    headers: dict[str, str]
    body: bytes


def relay_path(holder_id: str, lease_id: str, action: str) -> str:
    """The coordinator's path a driver posts a relayed step (or close) of `lease_id` to: what the
    driver signs and the holder checks, so a relayed request is bound to this holder and lease."""
    assert action in RELAY_ACTIONS
    return f"{API_PREFIX}/relay/{quote(holder_id, safe='')}/{quote(lease_id, safe='')}/stage/{action}"


class StageLeaseInfo(Wire):
    """What a holder on a lease's route learns of it: who drives it, with which key, until when."""

    lease_id: str
    driver_id: str
    driver_public_key: str
    version: int
    deadline_unix: float
    stages: list[int]
    """The stages of the route this holder serves (one, normally)."""


class StageReport(Wire):
    """A driver reports a hop of its lease's route that failed (down, refused, malformed answer)."""

    lease_id: Label = Field(..., max_length=64)
    stage: int = Field(..., ge=1, le=1024)
    worker_id: Label = Field(..., max_length=64)
    reason: HopFailure
    detail: Label = Field(default="", max_length=200)


# ---------------------------------------------------------------- driver and holder


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
    """A holder's signed statement of what it received and answered for one row of a session."""

    holder_id: str
    stage: int
    lease_id: str
    session: str
    row: int
    version: int
    steps: int
    input_chain: str
    """The hash chain over this row's inputs, step by step (`chain_next`)."""
    output_chain: str
    signature: str = ""
    """Ed25519 (hex) by the holder's registered key over `commitment_bytes`."""


class Commitments(Wire):
    commitments: list[Commitment]


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
    """One row's sampled answer as the last stage's chain covers it: int32 token, float64 log-prob."""
    return struct.pack("<id", token_id, logprob)


SAMPLED_BYTES = struct.calcsize("<id")


def sampled_values(data: bytes) -> list[tuple[int, float]]:
    """The (token, log-prob) of each step in a last stage's concatenated answers."""
    if len(data) % SAMPLED_BYTES:
        raise ValueError(f"{len(data)} bytes are not whole sampled answers of {SAMPLED_BYTES}")
    return [struct.unpack_from("<id", data, offset) for offset in range(0, len(data), SAMPLED_BYTES)]


def chain_over(start: str, pieces: list[bytes]) -> str:
    chain = start
    for piece in pieces:
        chain = chain_next(chain, piece)
    return chain


def bytes_per_token(codec: str, hidden_size: int) -> int:
    """Bytes one token's hidden vector takes on the wire (`model/boundary_codec.py` encodes it)."""
    if codec == "float32":
        return 4 * hidden_size
    if codec == "bfloat16":
        return 2 * hidden_size
    assert codec == "int8", codec
    return hidden_size + 4  # int8 values and the row's float32 scale


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
