"""Images on the wire, attacked: a vision-language rollout names its images by the hash of their
pixels, and the coordinator draws the task's images again from its seed. A rollout with a swapped
image, an image its task did not draw, an oversized image (by its declared size, before any decoder
runs), an image from the worker's own environment without an env server's signature, or image
tokens where no image goes is refused with a 4xx, a strike, and nothing stored.

A real coordinator process on a tiny LLaVA, the `count_shapes` task, real signed clients; honest
rollouts are played by the worker's own `Player` on the hf engine, with the images.
"""

from __future__ import annotations

import base64
import json
import struct
import zlib
from collections.abc import Callable

import pytest

from adversarial.processes import vision_arena
from benchmarks.adversarial.arena import Agent, Arena
from benchmarks.adversarial.attacks import submit
from decentrl.envs.images import PNG_SIGNATURE, TaskImage
from decentrl.protocol import Rollout, RolloutImage, Segment

pytestmark = pytest.mark.integration

OVERRIDES = [
    'task.env="shape_color"',
    "task.args={}",
    "coordinator.group_size=2",
    "coordinator.max_new_tokens=6",
    "coordinator.max_image_pixels=4096",
    "trust.verify_fraction=1.0",
]


@pytest.fixture(scope="module")
def arena(tmp_path_factory: pytest.TempPathFactory):
    with vision_arena(tmp_path_factory, OVERRIDES) as arena:
        yield arena


def attempt(
    arena: Arena, name: str, change: Callable[[list[Rollout]], None], groups: int = 1
) -> tuple[int, int, list]:
    """A fresh identity plays a lease honestly, `change` edits its rollouts, it submits them:
    (status, rollouts it has stored, its strikes)."""
    agent = arena.agent(name)
    try:
        rollouts = agent.play(agent.lease(groups))
        assert all(rollout.images for rollout in rollouts), "a visual task's rollouts name their images"
        change(rollouts)
        status = submit(agent, rollouts)
        strikes = arena.query(
            "SELECT reason FROM events WHERE kind = 'violation' AND worker_id = ?", agent.worker_id
        )
        return status, arena.stored(agent.worker_id), [reason for (reason,) in strikes]
    finally:
        agent.close()


def png_header(width: int, height: int) -> str:
    """A PNG whose header declares `width` x `height` (its data is a stub: it is never decoded)."""
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunk = (
        struct.pack(">I", len(header)) + b"IHDR" + header + struct.pack(">I", zlib.crc32(b"IHDR" + header))
    )
    return base64.b64encode(PNG_SIGNATURE + chunk).decode()


def test_honest_visual_rollouts_are_accepted_and_verified(arena: Arena) -> None:
    agent = arena.agent("honest")
    try:
        lease = agent.lease(2)
        assert submit(agent, agent.play(lease)) == 200
        arena.settle()
        rows = arena.query("SELECT verdict FROM verify_jobs WHERE worker_id = ?", agent.worker_id)
        verdicts = [json.loads(verdict) for (verdict,) in rows]
        assert arena.stored(agent.worker_id) == 4 and arena.quarantined(agent.worker_id) is None
        # the verifier recomputed every token with the pixels the task drew: the worker's own log-probs
        assert len(verdicts) == 4 and all(v["unverifiable"] is None for v in verdicts), verdicts
        assert all(v["logprob_tokens"] > 0 and v["max_logprob_error"] < 1e-4 for v in verdicts), verdicts
    finally:
        agent.close()


def test_a_swapped_image_is_refused(arena: Arena) -> None:
    def swap(rollouts: list[Rollout]) -> None:  # two tasks' rollouts, each naming the other's picture
        first, last = rollouts[0], rollouts[-1]
        assert first.task_id != last.task_id
        first.images, last.images = last.images, first.images

    assert attempt(arena, "swapper", swap, groups=2) == (422, 0, ["image_mismatch"])


def test_an_image_the_task_did_not_draw_is_refused(arena: Arena) -> None:
    blank = TaskImage(32, 32, bytes(32 * 32 * 3))

    def replace(rollouts: list[Rollout]) -> None:
        rollouts[0].images = [RolloutImage(sha256=blank.sha256)]

    assert attempt(arena, "forger", replace) == (422, 0, ["image_mismatch"])

    def add(rollouts: list[Rollout]) -> None:
        rollouts[0].images = [*(rollouts[0].images or []), RolloutImage(sha256=blank.sha256)]

    assert attempt(arena, "adder", add) == (422, 0, ["image_mismatch"])


def test_an_oversized_image_is_refused_by_its_declared_size(arena: Arena) -> None:
    def huge(rollouts: list[Rollout]) -> None:  # 100 Mpx declared in a few bytes: a decompression bomb
        rollouts[0].images = [
            *(rollouts[0].images or []),
            RolloutImage(sha256="0" * 64, source="env", png=png_header(10_000, 10_000)),
        ]

    assert attempt(arena, "bomber", huge) == (413, 0, [])

    def many(rollouts: list[Rollout]) -> None:
        rollouts[0].images = (rollouts[0].images or []) * 9  # coordinator.max_images_per_rollout = 8

    assert attempt(arena, "hoarder", many) == (413, 0, [])


def test_an_unsigned_image_from_the_workers_environment_is_refused(arena: Arena) -> None:
    small = TaskImage(4, 4, bytes(4 * 4 * 3))

    def unsigned(rollouts: list[Rollout]) -> None:
        encoded = base64.b64encode(small.png()).decode()
        rollouts[0].images = [
            *(rollouts[0].images or []),
            RolloutImage(sha256=small.sha256, source="env", png=encoded),
        ]

    assert attempt(arena, "screenshotter", unsigned) == (422, 0, ["image_unsigned"])


def image_token(arena: Arena) -> int:
    from decentrl.envs.image_tokens import read_image_tokens

    found = read_image_tokens(arena.model_dir)
    assert found is not None
    return found.token_id


def test_image_tokens_at_wrong_positions_are_refused(arena: Arena) -> None:
    token = image_token(arena)

    eos = arena.trainer.info().eos_token_ids[0]

    def in_completion(rollouts: list[Rollout]) -> None:  # an image token in the model's own turn
        versions = [arena.latest] * 2
        turn = Segment(
            source="model", token_ids=[token, eos], logprobs=[-1.0, -1.0], policy_versions=versions
        )
        rollouts[0].segments, rollouts[0].finish_reason = [turn], "stop"

    assert attempt(arena, "sampler", in_completion) == (422, 0, ["image_tokens"])

    def moved(rollouts: list[Rollout]) -> None:  # the prompt's image tokens shifted one place left
        ids = rollouts[0].prompt_token_ids
        first, last = ids.index(token), len(ids) - ids[::-1].index(token) - 1
        ids[first - 1], ids[last] = ids[last], ids[first - 1]

    assert attempt(arena, "mover", moved) == (422, 0, ["prompt"])


def test_strikes_come_from_the_key_holder_only(arena: Arena) -> None:
    """A refused image costs the sender a strike; an honest identity beside it keeps working."""
    agent: Agent = arena.agent("bystander")
    try:
        assert submit(agent, agent.play(agent.lease(1))) == 200
        assert arena.quarantined(agent.worker_id) is None
    finally:
        agent.close()
