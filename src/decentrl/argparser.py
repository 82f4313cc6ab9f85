"""The argument parser of `decentrl` and of every benchmark: a mistake is one line naming the fix."""

from __future__ import annotations

import argparse

from decentrl.config import ConfigError

Args = argparse.Namespace
"""A parsed command line."""


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line instead of usage + message
        raise ConfigError(f"{message} (see `{self.prog} --help`)")
