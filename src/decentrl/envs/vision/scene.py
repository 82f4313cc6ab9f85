"""Pictures of coloured shapes on a grid, drawn from a seed with integer geometry only.

A scene is a few shapes (squares and discs) of a few colours, each filling its own cell of a
`grid x grid` board of `cell`-pixel cells: with the tiny LLaVA's patches as large as the cells
(`configs/vision.toml`), each shape is one image token. Every role draws the same scene from the
same seed to the same pixels (`envs/images.py`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from decentrl.envs.images import Canvas, TaskImage

COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 190, 50),
    "blue": (40, 70, 230),
    "yellow": (235, 215, 30),
}
BACKGROUND = (0, 0, 0)


@dataclass(frozen=True)
class Shape:
    cell: int
    """Index of the cell, row after row."""
    color: str
    kind: str
    """"square" (the whole cell) or "disc" (the disc inscribed in the cell)."""


@dataclass(frozen=True)
class Scene:
    grid: int
    cell: int
    shapes: tuple[Shape, ...]

    @property
    def key(self) -> str:
        """The scene as text: what decides its split (two problems with one key are one problem)."""
        return ";".join(f"{s.cell}{s.color}{s.kind[0]}" for s in self.shapes)

    def count(self, color: str) -> int:
        return sum(shape.color == color for shape in self.shapes)

    def draw(self) -> TaskImage:
        size = self.grid * self.cell
        canvas = Canvas(size, size, BACKGROUND)
        for shape in self.shapes:
            row, column = divmod(shape.cell, self.grid)
            left, top = column * self.cell, row * self.cell
            if shape.kind == "square":
                canvas.rectangle(left, top, left + self.cell, top + self.cell, COLORS[shape.color])
            else:  # centre and radius doubled: the disc test is exact (Canvas.disc)
                canvas.disc(2 * left + self.cell, 2 * top + self.cell, self.cell, COLORS[shape.color])
        return canvas.image()


def random_scene(
    rng: random.Random, grid: int, cell: int, colors: tuple[str, ...], min_shapes: int, max_shapes: int
) -> Scene:
    """Between `min_shapes` and `max_shapes` shapes in distinct cells, colours and kinds uniform."""
    count = rng.randint(min_shapes, max_shapes)
    cells = sorted(rng.sample(range(grid * grid), count))
    shapes = tuple(
        Shape(cell=index, color=rng.choice(colors), kind=rng.choice(("square", "disc"))) for index in cells
    )
    return Scene(grid, cell, shapes)
