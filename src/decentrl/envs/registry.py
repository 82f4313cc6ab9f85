"""`load_environment(name, **kwargs)`: built-in environments, then third-party packages.

A third-party package registers a loader under the `decentrl.environments` entry-point group:

    [project.entry-points."decentrl.environments"]
    my_env = "my_package:load_environment"

where `load_environment(**kwargs)` returns an object with the `Environment` interface (a class
works too). Built-ins are imported lazily: the reasoning-gym adapter pulls in its package only
when asked for.
"""

from __future__ import annotations

import importlib
import inspect
from importlib.metadata import entry_points

from pydantic import BaseModel

from decentrl.envs.base import Environment

ENTRY_POINT_GROUP = "decentrl.environments"
BUILTINS = {
    "arithmetic": "decentrl.envs.arithmetic:Arithmetic",
    "tool_use": "decentrl.envs.tool_use:ToolUse",
    "code": "decentrl.envs.coding:CodeTask",
    "reasoning_gym": "decentrl.envs.reasoning_gym:ReasoningGym",
    "math": "decentrl.envs.mathematics:MathTask",
    "humaneval": "decentrl.envs.benchmarks:HumanEval",
    "math500": "decentrl.envs.benchmarks:Math500",
    "dataset": "decentrl.envs.dataset:DatasetTask",
    "browser": "decentrl.envs.browser:BrowserTasks",
    "shape_color": "decentrl.envs.vision:ShapeColor",
    "count_shapes": "decentrl.envs.vision:CountShapes",
}


class UnknownEnvironment(ValueError):
    """No built-in or installed environment has this name."""


def available_environments() -> list[str]:
    return sorted(set(BUILTINS) | {ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)})


def _loader(name: str):
    if name in BUILTINS:
        module, attribute = BUILTINS[name].split(":")
        return getattr(importlib.import_module(module), attribute)
    found = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == name]
    if not found:
        raise UnknownEnvironment(
            f"unknown environment {name!r}; available: {', '.join(available_environments())} "
            f"(or install a package that registers it under the {ENTRY_POINT_GROUP!r} entry-point group)"
        )
    return found[0].load()


def load_environment(name: str, **kwargs: object) -> Environment:
    """The environment `name` built with `kwargs`; a bad name or argument is a ValueError naming the fix."""
    loader = _loader(name)
    try:
        env = loader(**kwargs)
    except TypeError as exc:
        raise ValueError(f"environment {name!r}: {exc}; check task.args") from None
    missing = [
        m for m in ("name", "max_turns", "tools", "problem", "respond", "reward") if not hasattr(env, m)
    ]
    if missing:
        raise ValueError(
            f"environment {name!r} does not implement the Environment interface (missing {missing})"
        )
    return env


def task_arguments(task, sandbox: BaseModel | None = None) -> dict:
    """`task.args`, with the run's `[sandbox]` section as `sandbox` for an environment whose loader
    takes one and that `task.args` gives none: the code a run scores obeys the limits its config
    sets. An unknown environment is left to `load_environment` to refuse."""
    args = dict(task.args)
    if sandbox is None or "sandbox" in args:
        return args
    try:
        takes = "sandbox" in inspect.signature(_loader(task.env)).parameters
    except (UnknownEnvironment, TypeError, ValueError):
        return args
    return args | {"sandbox": sandbox.model_dump()} if takes else args


def environment_from_config(task, sandbox: BaseModel | None = None) -> Environment:
    """The environment of a run's `[task]` section (with its `[sandbox]`: `task_arguments`); a
    mistake is a ConfigError naming the fix."""
    from decentrl.config import ConfigError

    try:
        return load_environment(task.env, **task_arguments(task, sandbox))
    except ValueError as exc:
        raise ConfigError(f"task.env = {task.env!r}: {exc}") from None
