"""The error a user's mistake raises, below every other module: `stage_map` and `protocol` raise it
and `config` re-exports it, so it imports nothing from decentrl (importing `decentrl.config.base`
would run `decentrl.config`'s package, which imports `protocol`: a cycle for whichever is first)."""

from __future__ import annotations


class ConfigError(ValueError):
    """A user's configuration mistake; the message says how to fix it."""
