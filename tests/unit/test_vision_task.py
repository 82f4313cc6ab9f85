"""The visual task's images: drawn from the seed to the same pixels on every role, named by the hash
of the pixels, counted into image tokens exactly as the model's processor does."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from decentrl.config import ModelConfig
from decentrl.config.run import VisionTowerConfig
from decentrl.envs import load_environment
from decentrl.envs.base import TeacherHabits
from decentrl.envs.chat import ChatFormat
from decentrl.envs.image_tokens import ImageTokens, ImageTokensError, read_image_tokens
from decentrl.envs.images import TaskImage, image_sha256, png_size
from decentrl.model.special import read_eos_token_ids
from decentrl.model.tiny import save_model_dir
from decentrl.model.tiny_vlm import build_tiny_vlm

# The hashes of train problem 0's pictures. Every role draws them; a change to the drawing code
# that moves a pixel makes workers of the old and the new code disagree, and this test says so.
PINNED = {"shape_color": "98bbcfdca9ed", "count_shapes": "2d85c960b4c1"}
TASKS = ("shape_color", "count_shapes")


@pytest.mark.parametrize("name", TASKS)
def test_a_problem_is_drawn_to_the_same_pixels_every_time(name: str) -> None:
    env, again = load_environment(name), load_environment(name)
    for seed in range(20):
        first, second = env.problem(seed, "train"), again.problem(seed, "train")
        assert first.images[0].rgb == second.images[0].rgb and first.answer == second.answer
    assert env.problem(0, "train").images[0].sha256.startswith(PINNED[name])


def cell_colors(image: TaskImage, grid: int = 4, cell: int = 8) -> list[str | None]:
    """The colour at the centre of each cell, read from the pixels (None: background)."""
    from decentrl.envs.vision.scene import COLORS

    pixels = np.frombuffer(image.rgb, dtype=np.uint8).reshape(image.height, image.width, 3)
    by_rgb = {rgb: name for name, rgb in COLORS.items()}
    centres = [
        pixels[row * cell + cell // 2, column * cell + cell // 2]
        for row in range(grid)
        for column in range(grid)
    ]
    return [by_rgb.get(tuple(int(v) for v in rgb)) for rgb in centres]


def test_the_answers_are_read_from_the_pixels() -> None:
    color, count = load_environment("shape_color"), load_environment("count_shapes")
    for seed in range(30):
        problem = color.problem(seed, "train")
        assert [c for c in cell_colors(problem.images[0]) if c] == [problem.answer]
        problem = count.problem(seed, "train")
        assert cell_colors(problem.images[0]).count(problem.info["color"]) == int(problem.answer)


@pytest.mark.parametrize("name", TASKS)
def test_train_and_held_out_pictures_are_disjoint(name: str) -> None:
    env = load_environment(name)

    def key(seed: int, split: str) -> str:
        problem = env.problem(seed, split)  # pyright: ignore[reportArgumentType]
        return problem.images[0].sha256 + problem.text

    train = {key(seed, "train") for seed in range(300)}
    assert not train & {key(seed, "eval") for seed in range(100)}


def test_each_teacher_misreads_as_often_as_told() -> None:
    rng = random.Random(0)
    color, count = load_environment("shape_color"), load_environment("count_shapes")
    problems = [color.problem(seed, "train") for seed in range(400)]
    green = [p for p in problems if p.answer == "green"]
    said = [color.demonstration(p, rng, TeacherHabits(misread=0.6))[0] for p in green]
    assert set(said) == {"green", "red"} and 0.5 < said.count("red") / len(green) < 0.7
    others = [p for p in problems if p.answer != "green"]
    assert all(color.demonstration(p, rng, TeacherHabits(misread=1.0)) == [p.answer] for p in others)
    problems = [count.problem(seed, "train") for seed in range(400)]
    differ = [p for p in problems if p.answer != str(p.info["total"])]
    wrong = sum(count.demonstration(p, rng, TeacherHabits(misread=0.6))[0] != p.answer for p in differ)
    assert 0.5 < wrong / len(differ) < 0.7
    assert all(count.demonstration(p, rng, TeacherHabits())[0] == p.answer for p in problems)


def test_the_png_and_pil_views_hold_the_hashed_pixels(tmp_path: Path) -> None:
    image = load_environment("shape_color").problem(3, "eval").images[0]
    path = tmp_path / "picture.png"
    path.write_bytes(image.png())
    decoded = Image.open(path).convert("RGB")
    assert decoded.tobytes() == image.rgb == image.to_pil().tobytes()
    assert image_sha256(*decoded.size, decoded.tobytes()) == image.sha256
    assert png_size(image.png()) == (32, 32) and png_size(b"GIF89a" + bytes(30)) is None
    assert TaskImage(2, 1, b"\x00" * 6).sha256 != TaskImage(1, 2, b"\x00" * 6).sha256  # the size is hashed


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = ModelConfig(
        hidden_size=64, num_heads=2, intermediate_size=128, vision=VisionTowerConfig(image_size=48)
    )
    return save_model_dir(*build_tiny_vlm(config), tmp_path_factory.mktemp("vlm"))


def test_prompt_ids_are_the_processors_id_for_id(vlm_dir: Path) -> None:
    """The coordinator's prompt (the template rendered with Jinja, image tokens expanded from the
    processor's config, no transformers) is what `LlavaProcessor` makes of the same message."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(vlm_dir)
    chat = ChatFormat.from_model_dir(vlm_dir, read_eos_token_ids(vlm_dir))
    assert chat.image_tokens == read_image_tokens(vlm_dir)
    assert chat.image_tokens is not None and chat.image_tokens.per_image == 36  # (48 / 8)^2
    env = load_environment("shape_color")
    for seed in range(5):
        problem = env.problem(seed, "train")
        messages = [dict(message) for message in problem.prompt]
        text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        expected = processor(
            images=[image.to_pil() for image in problem.images], text=[text], return_tensors="pt"
        )
        assert chat.prompt_ids(problem.prompt) == expected["input_ids"][0].tolist()


def test_image_token_runs_are_counted_or_refused() -> None:
    tokens = ImageTokens("<image>", 9, per_image=3)
    assert tokens.expand([1, 9, 2, 9]) == [1, 9, 9, 9, 2, 9, 9, 9]
    assert tokens.count([1, 9, 9, 9, 2, 9, 9, 9]) == 2 and tokens.count([1, 2]) == 0
    with pytest.raises(ImageTokensError):
        tokens.count([1, 9, 9, 2])


def test_an_unsupported_processor_is_named(vlm_dir: Path, tmp_path: Path) -> None:
    import json
    import shutil

    other = tmp_path / "other"
    shutil.copytree(vlm_dir, other)
    settings = json.loads((other / "processor_config.json").read_text())
    settings["processor_class"] = "Qwen2VLProcessor"
    (other / "processor_config.json").write_text(json.dumps(settings))
    with pytest.raises(ValueError, match="Qwen2VLProcessor.*LlavaProcessor"):
        read_image_tokens(other)


def test_the_coordinator_refuses_a_visual_task_it_cannot_serve(vlm_dir: Path, tmp_path: Path) -> None:
    """At start: a text-only policy, or image limits below what the task draws, is one line."""
    from decentrl.config import ConfigError, CoordinatorConfig, RunConfig, TaskConfig
    from decentrl.coordinator.context import build_context
    from decentrl.model.tiny import build_tiny

    task = TaskConfig(env="shape_color")
    text_model = save_model_dir(*build_tiny(ModelConfig()), tmp_path / "text")
    with pytest.raises(ConfigError, match="draws images but the policy is text-only"):
        build_context(RunConfig(task=task), tmp_path / "a", text_model, lambda: 0.0)
    small = RunConfig(task=task, coordinator=CoordinatorConfig(max_image_pixels=1000))
    with pytest.raises(ConfigError, match="max_image_pixels"):
        build_context(small, tmp_path / "b", vlm_dir, lambda: 0.0)
    context = build_context(RunConfig(task=task), tmp_path / "c", vlm_dir, lambda: 0.0)
    assert context.model.image_tokens is not None and context.model.max_context == 256
    assert "processor_config.json" in context.model.files  # workers download it
