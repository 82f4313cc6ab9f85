"""SFT warm start of the tiny default model on the default task, cached on disk.

RL needs a policy that already follows the answer format and is sometimes right: a short SFT on
train-split problems gives that. The result is a plain HF model directory, cached under a key
made of every setting that changes it, so a second `make demo` reuses it.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import random
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import Progress
from transformers import PreTrainedModel

from decentrl.config import ConfigError, ModelConfig, SFTConfig, TaskConfig
from decentrl.envs import Environment, Problem, environment_from_config
from decentrl.envs.base import TeacherHabits
from decentrl.envs.chat import ChatFormat
from decentrl.envs.episode import advance, start
from decentrl.model.special import read_eos_token_ids
from decentrl.model.tiny import build_tiny, save_model_dir
from decentrl.model.vision import PixelInputs
from decentrl.model.warmstart_cache import cache_root, cached_warm_start, warmstart_key
from decentrl.monitor.reporting import eta
from decentrl.protocol import Segment

log = logging.getLogger(__name__)
WARMSTART_LINES = 20
"""Progress lines a warm start logs (besides its progress bar)."""
MAX_DEMONSTRATION_TOKENS = 10**6  # demonstrations are not cut by a token budget


def sft_example(
    env: Environment, chat: ChatFormat, problem: Problem, turns: list[str]
) -> tuple[list[int], list[int]]:
    """Token ids of a demonstrated episode and its loss targets (1 on the assistant's tokens and
    end-of-turn, 0 on the prompt and the environment's turns, which are built by the real env)."""
    episode = start(env, chat, problem)
    ids, targets = list(episode.prompt_ids), [0] * len(episode.prompt_ids)
    for turn in turns:
        turn_ids = chat.tokenizer.encode(turn, add_special_tokens=False).ids + [chat.eos_token_ids[0]]
        episode.segments.append(Segment(source="model", token_ids=turn_ids))
        env_ids = advance(env, chat, episode, turn_ids, budget=MAX_DEMONSTRATION_TOKENS) or []
        ids += turn_ids + env_ids
        targets += [1] * len(turn_ids) + [0] * len(env_ids)
    return ids, targets


def sft_batch(
    env: Environment,
    chat: ChatFormat,
    pad_token_id: int,
    seeds: Sequence[int],
    sft: SFTConfig,
    pixels: PixelInputs | None = None,
    made: dict[int, tuple[list[int], list[int], Any]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor] | None]:
    """Right-padded demonstrations; the loss covers the assistant's tokens only. A
    vision-language model's rows come with their images' pixel inputs. `made` keeps each seed's
    demonstration once made (a warm start that cycles a fixed set plays each one once)."""
    demonstration = getattr(env, "demonstration", None)  # optional: not part of Environment
    if demonstration is None:
        raise ConfigError(
            f"environment {env.name!r} has no demonstration() to warm-start from; "
            "set sft.steps=0 or pass a trained model with model.path"
        )
    teacher = TeacherHabits(
        sft.teacher_carry_drop, sft.teacher_zero_pad, sft.teacher_skip_tool, sft.teacher_misread
    )
    rows, targets, images = [], [], []
    for seed in seeds:
        if made is not None and seed in made:
            ids, target, problem_images = made[seed]
        else:
            problem = env.problem(seed, "train")
            turns = demonstration(problem, random.Random(seed), teacher)
            ids, target = sft_example(env, chat, problem, turns)
            problem_images = problem.images
            if made is not None:
                made[seed] = (ids, target, problem_images)
        rows.append(ids)
        targets.append(target)
        images.append(problem_images)
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    attention = torch.zeros_like(ids)
    loss_mask = torch.zeros_like(ids)
    for i, (row, target) in enumerate(zip(rows, targets, strict=True)):
        ids[i, : len(row)] = torch.tensor(row)
        attention[i, : len(row)] = 1
        loss_mask[i, : len(row)] = torch.tensor(target)
    if any(images) and pixels is None:
        raise ConfigError(
            f"task {env.name!r} draws images: warm-start a vision-language model ([model.vision])"
        )
    return ids, attention, loss_mask, None if pixels is None else pixels.vision_inputs(images)


def model_files(model: PreTrainedModel, tokenizer, directory: Path) -> tuple[ChatFormat, PixelInputs | None]:
    """The chat format and pixel inputs of a model built in memory, read back from its files as
    every role reads them (so the warm start's prompts are the coordinator's, id for id)."""
    save_model_dir(model, tokenizer, directory)
    return ChatFormat.from_model_dir(directory, read_eos_token_ids(directory)), PixelInputs.from_model_dir(
        directory
    )


def sft_seeds(sft: SFTConfig, first_seed: int, step: int) -> list[int]:
    """The demonstrations' seeds of an SFT step: new ones every step, or with `sft.demonstrations`
    the fixed set's, each epoch in its own seeded order."""
    batch = range(step * sft.batch_size, (step + 1) * sft.batch_size)
    if sft.demonstrations is None:
        return [first_seed + index for index in batch]
    seeds = []
    for index in batch:
        epoch, position = divmod(index, sft.demonstrations)
        seeds.append(first_seed + epoch_order(sft.demonstrations, epoch)[position])
    return seeds


@functools.lru_cache(maxsize=4)
def epoch_order(size: int, epoch: int) -> tuple[int, ...]:
    """The order of a fixed set of `size` demonstrations in `epoch` (seeded, shuffled once)."""
    order = list(range(size))
    random.Random(f"sft-epoch:{epoch}").shuffle(order)
    return tuple(order)


def sft_lr(sft: SFTConfig, step: int) -> float:
    """Linear warm-up over the first 50 steps, then cosine decay to 10% of the peak."""
    warmup = min(50, max(1, sft.steps // 10))
    if step < warmup:
        return sft.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, sft.steps - warmup)
    return sft.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train_sft(model_config: ModelConfig, task: TaskConfig, sft: SFTConfig, show_progress: bool = True):
    if model_config.vision is None:
        model, tokenizer = build_tiny(model_config)
    else:
        from decentrl.model.tiny_vlm import build_tiny_vlm

        model, tokenizer = build_tiny_vlm(model_config)  # tokenizer: its processor
    env = environment_from_config(task)
    if model_config.vision is None:
        chat, pixels = ChatFormat.from_hf(tokenizer), None
    else:
        with tempfile.TemporaryDirectory(prefix="decentrl-warmstart-") as directory:
            chat, pixels = model_files(model, tokenizer, Path(directory))
    pad_token_id = model.config.get_text_config().pad_token_id
    if model_config.vision is not None and not sft.train_vision_tower:
        frozen = vision_tower_parameters(model)
        for parameter in frozen:
            parameter.requires_grad_(False)
    trained = [parameter for parameter in model.parameters() if parameter.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=sft.lr, weight_decay=0.0, betas=(0.9, 0.98))
    model.train()
    # SFT seeds come from the top of the seed space, away from the RL task stream.
    first_seed = 10**9 + model_config.seed * 10**7
    # On stderr: stdout is the directory `decentrl warmstart` prints (the demo reads no other).
    started = time.monotonic()
    made: dict | None = None if sft.demonstrations is None else {}
    if sft.demonstrations is not None:
        log.info(
            "warm start: %d demonstrations, made at their first use, %.1f epochs",
            sft.demonstrations,
            sft.steps * sft.batch_size / sft.demonstrations,
        )
    report_every = max(1, sft.steps // WARMSTART_LINES)
    log.info("warm start: training the tiny model, %d SFT steps (cached for later runs)", sft.steps)
    with Progress(console=Console(stderr=True), disable=not show_progress, transient=True) as progress:
        bar = progress.add_task("warm start (SFT)", total=sft.steps)
        for step in range(sft.steps):
            lr = sft_lr(sft, step)
            for group in optimizer.param_groups:
                group["lr"] = lr
            seeds = sft_seeds(sft, first_seed, step)
            ids, attention, loss_mask, vision = sft_batch(env, chat, pad_token_id, seeds, sft, pixels, made)
            logits = model(input_ids=ids, attention_mask=attention, **(vision or {})).logits[:, :-1]
            token_loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1), reduction="none"
            )
            mask = loss_mask[:, 1:].reshape(-1).float()
            loss = (token_loss * mask).sum() / mask.sum()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trained, 1.0)
            optimizer.step()
            progress.update(bar, advance=1, description=f"warm start (SFT) loss {loss.item():.3f}")
            done = step + 1
            if done % report_every == 0:  # the bar shows nothing when stderr is no terminal
                left = eta(time.monotonic() - started, done, sft.steps - done)
                log.info("warm start: step %d/%d, loss %.3f, %s left", done, sft.steps, loss.item(), left)
    model.eval()
    model.requires_grad_(True)  # the RL trainer decides what trains
    return model, tokenizer


def vision_tower_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """A LLaVA's vision encoder's parameters (not the projector's)."""
    towers = [module for name, module in model.named_modules() if name.split(".")[-1] == "vision_tower"]
    assert len(towers) == 1, f"expected one vision_tower in a vision-language model, found {len(towers)}"
    return list(towers[0].parameters())


def warm_start(model: ModelConfig, task: TaskConfig, sft: SFTConfig, show_progress: bool = True) -> Path:
    """Directory of the warm-started model, trained now or taken from the cache."""
    cached = cached_warm_start(model, task, sft)
    if cached is not None:
        return cached
    target = cache_root(sft) / f"warmstart-{warmstart_key(model, task, sft)}"
    trained, tokenizer = train_sft(model, task, sft, show_progress)
    staging = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    save_model_dir(trained, tokenizer, staging)
    staging.rename(target)  # atomic: a crash mid-save never leaves a half cache entry
    return target
