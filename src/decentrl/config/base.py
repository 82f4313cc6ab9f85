"""The base of every config section, and the error a configuration mistake raises (defined in
`decentrl.config_error`). Imports nothing else from decentrl: every config module (run, roles, trust,
algorithm, rewards) builds on it."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from decentrl.config_error import ConfigError

__all__ = ["ConfigError", "Section"]


class Section(BaseModel):
    """A config section: unknown fields are refused (a typo is an error, not a silent default),
    each field's docstring is its description, and assignments are validated too."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)
