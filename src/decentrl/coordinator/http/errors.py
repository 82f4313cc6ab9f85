"""The coordinator's one error type; `http/app.py` turns it into a JSON answer with its status."""

from __future__ import annotations

from enum import StrEnum


class Reason(StrEnum):
    """Why a request was refused, or an accepted rollout failed later (`SCORING_FAILED`): the
    closed set every `ApiError` names (the `rejected` events and `/v1/stats` count them by this
    name; `trust/reputation.HOSTILE_REASONS` picks the strikes)."""

    SCHEMA = "schema"
    OVERSIZED = "oversized"
    SLOW_BODY = "slow_body"
    AUTH = "auth"
    BAD_SIGNATURE = "bad_signature"
    REPLAY = "replay"
    CLOCK_SKEW = "clock_skew"
    REGISTRATION_PROOF = "registration_proof"
    RATE_LIMITED = "rate_limited"
    QUARANTINED = "quarantined"
    SCORING_BUDGET = "scoring_budget"
    DISK_FULL = "disk_full"
    NOT_READY = "not_ready"
    UNKNOWN_LEASE = "unknown_lease"
    FOREIGN_LEASE = "foreign_lease"
    LEASE_EXPIRED = "lease_expired"
    NOT_LEASED = "not_leased"
    DUPLICATE = "duplicate"
    PROMPT = "prompt"
    SAMPLING = "sampling"
    OUT_OF_VOCAB = "out_of_vocab"
    BAD_SEGMENT = "bad_segment"
    BAD_LOGPROBS = "bad_logprobs"
    BAD_FINISH = "bad_finish"
    TOO_LONG = "too_long"
    BAD_VERSION = "bad_version"
    STALE = "stale"
    ENV_MISMATCH = "env_mismatch"
    ENV_SIGNATURE = "env_signature"
    """A served episode's records not signed by the env server granted its slot, bound to another
    slot or episode, or without a reward (`pipeline/served.py`)."""
    UNSCORABLE = "unscorable"
    SCORING_FAILED = "scoring_failed"
    PEER_URL = "peer_url"
    CONFLICT = "conflict"
    HASH = "hash"
    SIGNATURE = "signature"
    STAGE_MAP = "stage_map"
    PRUNED = "pruned"
    UNKNOWN = "unknown"
    UNKNOWN_BATCH = "unknown_batch"
    BATCH_TOO_LARGE = "batch_too_large"
    UNKNOWN_CHUNK = "unknown_chunk"
    UNKNOWN_VERSION = "unknown_version"
    UNKNOWN_FILE = "unknown_file"
    STAGE = "stage"
    """A stage holder or driver whose stage does not fit the run's stage map (or an unstaged run)."""
    STAGE_TRACE = "stage_trace"
    """A staged rollout whose holders' commitments do not match its bytes, route or tokens."""
    HOP_TIMING = "hop_timing"
    """A driver's hop timing (`LeaseRequest.hop_timings`) naming a hop of no lease of its own."""
    IMAGE = "image"
    """A rollout's images malformed (not base64, no PNG, a task's image sent) or on a text-only run."""
    IMAGE_MISMATCH = "image_mismatch"
    """A rollout names images its task did not draw (swapped, foreign, or missing)."""
    IMAGE_TOKENS = "image_tokens"
    """Image tokens where no image goes (in a model or environment segment, or too few or many)."""
    IMAGE_UNSIGNED = "image_unsigned"
    """An image produced by a worker's environment without a trusted env server's signature."""


class ApiError(Exception):
    """An answer other than 2xx: HTTP status, a detail that names the problem, a short reason code."""

    def __init__(
        self, status: int, detail: str, reason: Reason | str, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail
        self.reason = Reason(reason)  # a reason outside the set is a bug: ValueError here
        self.headers = headers or {}
        """Extra response headers (Retry-After on a 429, the server's time on a clock refusal)."""
