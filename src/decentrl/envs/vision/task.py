"""`count_shapes`: how many shapes of a colour does the picture show? Exact-match reward.

The problem is one user message holding an image and a short question ("red?"); the answer is
the count ("2"). The picture is drawn from the seed (`scene.py`), so the coordinator and every
worker derive the same pixels; the split is a hash of the scene and the question, so no held-out
picture is ever trained on. The warm-start teacher has a habit RL must unlearn: with probability
`sft.teacher_count_all` it counts every shape, whatever their colour.
"""

from __future__ import annotations

import random

from decentrl.envs.base import Problem, SingleTurnEnv, Split, TeacherHabits, split_of
from decentrl.envs.vision.scene import COLORS, random_scene


class CountShapes(SingleTurnEnv):
    name = "count_shapes"

    def __init__(
        self,
        grid: int = 4,
        cell: int = 8,
        colors: list[str] | tuple[str, ...] = ("red", "green", "blue"),
        min_shapes: int = 2,
        max_shapes: int = 6,
    ) -> None:
        unknown = [color for color in colors if color not in COLORS]
        if unknown or not colors:
            raise ValueError(f"colors must be a non-empty subset of {sorted(COLORS)}, got {list(colors)}")
        if not 1 <= min_shapes <= max_shapes <= grid * grid:
            raise ValueError(
                f"need 1 <= min_shapes <= max_shapes <= grid * grid, got {min_shapes}, {max_shapes}, {grid}"
            )
        if cell < 4:
            raise ValueError(f"cell must be at least 4 pixels, got {cell}")
        self.grid, self.cell = grid, cell
        self.colors = tuple(colors)
        self.min_shapes, self.max_shapes = min_shapes, max_shapes

    def problem(self, seed: int, split: Split) -> Problem:
        rng = random.Random(f"{self.name}:{split}:{seed}")
        while True:  # rejection keeps each problem in the split its hash assigns
            scene = random_scene(rng, self.grid, self.cell, self.colors, self.min_shapes, self.max_shapes)
            color = rng.choice(self.colors)
            if split_of(f"{scene.key}|{color}") != split:
                continue
            question = (
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": f"{color}?"}]},
            )
            return Problem(
                seed=seed,
                split=split,
                prompt=question,
                answer=str(scene.count(color)),
                info={"total": len(scene.shapes), "color": color},
                images=(scene.draw(),),
            )

    def score(self, problem: Problem, completion: str) -> float:
        return 1.0 if completion.strip() == problem.answer else 0.0

    def demonstration(self, problem: Problem, rng: random.Random, teacher: TeacherHabits) -> list[str]:
        """The teacher's answer: the count, or with probability `teacher.count_all` every shape's."""
        if rng.random() < teacher.count_all:
            return [str(problem.info["total"])]
        return [problem.answer]
