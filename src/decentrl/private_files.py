"""Files a role writes for its owner alone: tokens, the announce file, the store's address."""

from __future__ import annotations

import json
import os
from pathlib import Path


def write_private_json(path: Path, content: dict) -> None:
    """Write `content` readable by the owner only, atomically (temp file + rename)."""
    temporary = path.with_suffix(path.suffix + ".tmp")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as handle:
        json.dump(content, handle, indent=2)
        handle.flush()
        os.fsync(handle.fileno())
    os.chmod(temporary, 0o600)
    os.replace(temporary, path)
