"""Environments: problems from seeds, multi-turn episodes as chat messages, trusted rewards."""

from decentrl.envs.arithmetic import Arithmetic
from decentrl.envs.base import Environment, Message, Problem, SingleTurnEnv, Split
from decentrl.envs.registry import (
    UnknownEnvironment,
    available_environments,
    environment_from_config,
    load_environment,
)

__all__ = [
    "Arithmetic",
    "Environment",
    "Message",
    "Problem",
    "SingleTurnEnv",
    "Split",
    "UnknownEnvironment",
    "available_environments",
    "environment_from_config",
    "load_environment",
    "make_env",
]

make_env = load_environment
"""The name the rest of the code base used before multi-turn environments; same function."""
