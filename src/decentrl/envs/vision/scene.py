"""Scenes of coloured shapes on a grid, drawn from a seed with integer geometry only.

A scene is a few shapes (squares and discs) of a few colours, each in its own cell of a
`grid x grid` board of `cell`-pixel cells, slightly offset inside its cell. Every role draws the
same scene from the same seed to the same pixels (`envs/images.py`).
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
    """"square" or "disc"."""
    offset: tuple[int, int]
    """Pixels the shape is moved from the cell's centre (x, y)."""


@dataclass(frozen=True)
class Scene:
    grid: int
    cell: int
    shapes: tuple[Shape, ...]

    @property
    def key(self) -> str:
        """The scene as text: what decides its split (two problems with one key are one problem)."""
        return ";".join(f"{s.cell}{s.color[0]}{s.kind[0]}{s.offset[0]}{s.offset[1]}" for s in self.shapes)

    def count(self, color: str) -> int:
        return sum(shape.color == color for shape in self.shapes)

    def draw(self) -> TaskImage:
        size = self.grid * self.cell
        canvas = Canvas(size, size, BACKGROUND)
        for shape in self.shapes:
            row, column = divmod(shape.cell, self.grid)
            # doubled coordinates of the shape's centre: the cell's centre plus the offset
            center_x2 = (2 * column + 1) * self.cell + 2 * shape.offset[0]
            center_y2 = (2 * row + 1) * self.cell + 2 * shape.offset[1]
            half = self.cell // 2 - 1  # the shape's half width, one pixel of margin each side
            if shape.kind == "square":
                left, top = (center_x2 // 2) - half + 1, (center_y2 // 2) - half + 1
                canvas.rectangle(left, top, left + 2 * half - 2, top + 2 * half - 2, COLORS[shape.color])
            else:
                canvas.disc(center_x2, center_y2, 2 * half - 1, COLORS[shape.color])
        return canvas.image()


def random_scene(
    rng: random.Random, grid: int, cell: int, colors: tuple[str, ...], min_shapes: int, max_shapes: int
) -> Scene:
    """Between `min_shapes` and `max_shapes` shapes in distinct cells, colours and kinds uniform."""
    count = rng.randint(min_shapes, max_shapes)
    cells = sorted(rng.sample(range(grid * grid), count))
    jitter = max(0, cell // 8)
    shapes = tuple(
        Shape(
            cell=index,
            color=rng.choice(colors),
            kind=rng.choice(("square", "disc")),
            offset=(rng.randint(-jitter, jitter), rng.randint(-jitter, jitter)),
        )
        for index in cells
    )
    return Scene(grid, cell, shapes)
