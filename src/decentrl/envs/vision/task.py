"""Visual tasks on pictures of coloured shapes (`scene.py`), exact-match rewards.

- `shape_color`: one shape; "color?" -> its colour ("green"). The warm-start teacher is red-green
  colour-blind: with probability `sft.teacher_misread` it calls a green shape red, a habit RL must
  unlearn by looking at the picture (`configs/vision.toml`). (Swapping both ways would leave the
  demonstrations with next to no evidence that red and green differ at all.)
- `count_shapes`: 2-6 shapes; "red?" -> how many are red ("2"). Its teacher misreads by counting
  every shape, whatever the colour. Counting takes a model more than the tiny LLaVA learns in the
  demo's budget.

The picture is drawn from the seed, so the coordinator and every worker derive the same pixels;
the split is a hash of the scene and the question, so no held-out picture is ever trained on.
"""

from __future__ import annotations

import random

from decentrl.envs.base import Problem, SingleTurnEnv, Split, TeacherHabits, split_of
from decentrl.envs.vision.scene import COLORS, Scene, random_scene

MISREAD = {"green": "red"}
"""What a red-green colour-blind teacher calls the colour it confuses."""


class ShapesTask(SingleTurnEnv):
    """Problems of one picture and a short question, drawn from the seed."""

    min_shapes, max_shapes = 1, 1

    def __init__(
        self, grid: int = 4, cell: int = 8, colors: list[str] | tuple[str, ...] = ("red", "green", "blue")
    ):
        unknown = [color for color in colors if color not in COLORS]
        if unknown or not colors:
            raise ValueError(f"colors must be a non-empty subset of {sorted(COLORS)}, got {list(colors)}")
        if grid < 1 or cell < 4:
            raise ValueError(f"need grid >= 1 and cell >= 4 pixels, got {grid} and {cell}")
        self.grid, self.cell = grid, cell
        self.colors = tuple(colors)

    def question(self, scene: Scene, rng: random.Random) -> tuple[str, str, dict]:
        """(question text, answer, info) about `scene`."""
        raise NotImplementedError

    def problem(self, seed: int, split: Split) -> Problem:
        rng = random.Random(f"{self.name}:{split}:{seed}")
        while True:  # rejection keeps each problem in the split its hash assigns
            scene = random_scene(rng, self.grid, self.cell, self.colors, self.min_shapes, self.max_shapes)
            text, answer, info = self.question(scene, rng)
            if split_of(f"{scene.key}|{text}") == split:
                break
        content = [{"type": "image"}, {"type": "text", "text": text}]
        prompt = ({"role": "user", "content": content},)
        return Problem(
            seed=seed, split=split, prompt=prompt, answer=answer, info=info, images=(scene.draw(),)
        )

    def score(self, problem: Problem, completion: str) -> float:
        return 1.0 if completion.strip() == problem.answer else 0.0


class ShapeColor(ShapesTask):
    name = "shape_color"

    def question(self, scene: Scene, rng: random.Random) -> tuple[str, str, dict]:
        return "color?", scene.shapes[0].color, {}

    def demonstration(self, problem: Problem, rng: random.Random, teacher: TeacherHabits) -> list[str]:
        """The teacher's answer: the colour, green called red with probability `teacher.misread`."""
        if rng.random() < teacher.misread:
            return [MISREAD.get(problem.answer, problem.answer)]
        return [problem.answer]


class CountShapes(ShapesTask):
    name = "count_shapes"

    def __init__(
        self,
        grid: int = 4,
        cell: int = 8,
        colors: list[str] | tuple[str, ...] = ("red", "green", "blue"),
        min_shapes: int = 2,
        max_shapes: int = 6,
    ) -> None:
        super().__init__(grid, cell, colors)
        if not 1 <= min_shapes <= max_shapes <= grid * grid:
            raise ValueError(
                f"need 1 <= min_shapes <= max_shapes <= grid * grid, got {min_shapes}, {max_shapes}, {grid}"
            )
        self.min_shapes, self.max_shapes = min_shapes, max_shapes

    def question(self, scene: Scene, rng: random.Random) -> tuple[str, str, dict]:
        color = rng.choice(self.colors)
        return f"{color}?", str(scene.count(color)), {"total": len(scene.shapes), "color": color}

    def demonstration(self, problem: Problem, rng: random.Random, teacher: TeacherHabits) -> list[str]:
        """The teacher's answer: the count, or with probability `teacher.misread` every shape's."""
        if rng.random() < teacher.misread:
            return [str(problem.info["total"])]
        return [problem.answer]
