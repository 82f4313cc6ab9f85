"""The base of every wire type: strict pydantic models and printable client text (docs/protocol.md).

The wire types `protocol.py` gathers (`registration_wire.py`, `rollout_wire.py`, `training_wire.py`,
`weights_wire.py`, `job_wire.py`), `stage_wire.py` and `envd_wire.py` build on it; it imports
nothing of decentrl.
"""

from __future__ import annotations

import unicodedata
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict

# Hard ceilings on list sizes, checked by the schema before any semantic check. The coordinator
# applies tighter, configured limits (max_new_tokens, group size) on top of these.
MAX_LIST = 65_536
MAX_VERSION = 2**31 - 1
"""Largest policy version on the wire: far beyond any run, and inside SQLite's 64-bit integers."""


def _printable(text: str) -> str:
    """Refuse control, format (bidi overrides, zero-width) and separator characters: a string a
    client chooses ends up in logs, events and the dashboard, where such characters forge lines or
    reorder what an operator reads (CVE-2021-42574, "Trojan Source")."""
    for char in text:
        if unicodedata.category(char)[0] == "C" or unicodedata.category(char) in ("Zl", "Zp"):
            raise ValueError(f"control or bidi character U+{ord(char):04X} is not allowed")
    return text


Label = Annotated[str, AfterValidator(_printable)]
"""A free-text string from a client: printable characters only."""


class Wire(BaseModel):
    # strict: JSON `true` is not the number 1, and "3" is not 3 (a lax parse would let a hostile body
    # through checks written for numbers); extra fields are an error, never silently dropped.
    model_config = ConfigDict(extra="forbid", frozen=False, strict=True)
