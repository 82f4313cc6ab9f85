"""Environments: problem generation and trusted scoring."""

from decentrl.envs.arithmetic import Arithmetic
from decentrl.envs.base import Environment, Problem, Split

__all__ = ["Arithmetic", "Environment", "Problem", "Split", "make_env"]


def make_env(name: str, **kwargs: object) -> Environment:
    registry = {"arithmetic": Arithmetic}
    if name not in registry:
        raise ValueError(f"unknown environment {name!r}; available: {', '.join(registry)}")
    return registry[name](**kwargs)
