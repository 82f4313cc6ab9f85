"""The run directory must be writable before anything is started in it.

A coordinator writes its database, tokens and weights there; a demo its logs and checkpoints. A
directory on a read-only file system, or one the user may not write, would otherwise surface as a
traceback from whichever file happened to be opened first (SQLite's "unable to open database
file"). Checked once, up front, with a one-line error naming the fix.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from decentrl.config import ConfigError


def writable_dir(path: Path, option: str = "--run-dir", what: str = "run directory") -> Path:
    """Create `path` if needed and prove a file can be written in it; else a ConfigError."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-check-"):
            pass
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise ConfigError(
            f"cannot write in the {what} {path} ({reason}); pass a writable {option}"
            " or make this one writable"
        ) from None
    return path
