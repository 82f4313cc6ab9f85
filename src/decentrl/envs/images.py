"""Images of a task: raw RGB pixels, named by a hash of the pixels, identical on every role.

A visual environment draws its problem's images from the seed (`envs/vision/`). The coordinator,
every worker, the trainer and the verifier draw them again from the same seed and must get the
same image; a rollout names its images by content hash and the coordinator checks each one
(`coordinator/pipeline/image_binding.py`). The hash covers the decoded pixels, not an encoding: two
PNG encoders (another zlib, another Pillow) write different bytes for the same pixels, and an honest
worker must never be refused for that. Pure Python (no numpy, no Pillow): the coordinator draws
and hashes images with its light dependencies only; Pillow is imported only to hand an image to
a model's image processor.
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from dataclasses import dataclass
from functools import cached_property

HASH_DOMAIN = b"decentrl-image-v1\n"
"""Prefix of every hashed image, so an image's hash is never another object's."""
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def image_sha256(width: int, height: int, rgb: bytes) -> str:
    """The content hash of an RGB image: domain, size, then the pixels row by row."""
    header = HASH_DOMAIN + f"rgb8 {width}x{height}\n".encode()
    return hashlib.sha256(header + rgb).hexdigest()


@dataclass(frozen=True)
class TaskImage:
    """An 8-bit RGB image: `rgb` holds width x height x 3 bytes, row after row."""

    width: int
    height: int
    rgb: bytes

    def __post_init__(self) -> None:
        assert self.width > 0 and self.height > 0, "an image has pixels"
        assert len(self.rgb) == self.width * self.height * 3, "rgb holds width x height x 3 bytes"

    @cached_property
    def sha256(self) -> str:
        return image_sha256(self.width, self.height, self.rgb)

    @property
    def num_pixels(self) -> int:
        return self.width * self.height

    def to_pil(self):
        """The image as a Pillow image (for a model's image processor; imports Pillow)."""
        from PIL import Image

        return Image.frombytes("RGB", (self.width, self.height), self.rgb)

    def png(self) -> bytes:
        """A PNG file of the image (the dashboard shows it; no filter, zlib level 6)."""
        rows = b"".join(
            b"\x00" + self.rgb[y * self.width * 3 : (y + 1) * self.width * 3] for y in range(self.height)
        )
        header = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)
        return (
            PNG_SIGNATURE
            + _chunk(b"IHDR", header)
            + _chunk(b"IDAT", zlib.compress(rows, 6))
            + _chunk(b"IEND", b"")
        )


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) from a PNG's header without decoding it, or None when `data` is no PNG:
    the bound on pixels is checked on this, before any decoder could inflate a bomb."""
    if len(data) < 24 or not data.startswith(PNG_SIGNATURE) or data[12:16] != b"IHDR":
        return None
    width, height = struct.unpack(">II", data[16:24])
    return width, height


class Canvas:
    """A mutable RGB image to draw a task's picture on, integer geometry only (every role draws
    the same pixels)."""

    def __init__(self, width: int, height: int, background: tuple[int, int, int]):
        self.width, self.height = width, height
        self.pixels = bytearray(bytes(background) * (width * height))

    def fill(self, x: int, y: int, color: tuple[int, int, int]) -> None:
        if 0 <= x < self.width and 0 <= y < self.height:
            offset = (y * self.width + x) * 3
            self.pixels[offset : offset + 3] = bytes(color)

    def rectangle(self, left: int, top: int, right: int, bottom: int, color: tuple[int, int, int]) -> None:
        """Fill [left, right) x [top, bottom)."""
        for y in range(top, bottom):
            for x in range(left, right):
                self.fill(x, y, color)

    def disc(self, center_x2: int, center_y2: int, radius2: int, color: tuple[int, int, int]) -> None:
        """Fill the pixels whose centres lie within the disc; coordinates and radius are given
        doubled (pixel centres sit at odd doubled coordinates) so that the test is exact."""
        top, bottom = max(0, (center_y2 - radius2) // 2), min(self.height, (center_y2 + radius2) // 2 + 1)
        left, right = max(0, (center_x2 - radius2) // 2), min(self.width, (center_x2 + radius2) // 2 + 1)
        for y in range(top, bottom):
            for x in range(left, right):
                dx, dy = 2 * x + 1 - center_x2, 2 * y + 1 - center_y2
                if dx * dx + dy * dy <= radius2 * radius2:
                    self.fill(x, y, color)

    def image(self) -> TaskImage:
        return TaskImage(self.width, self.height, bytes(self.pixels))
