"""Visual tasks: problems whose prompt holds images drawn from the seed (docs/environments.md)."""

from decentrl.envs.vision.task import CountShapes, ShapeColor

__all__ = ["CountShapes", "ShapeColor"]
