"""`decentrl bench lora`: how much of a LoRA run's update a bf16 worker computes with.

The trainer's model (the tiny model, fp32, rank-r adapters) takes real AdamW steps, one per
version, on a fixed batch of token sequences (next-token loss). Each version is published in
bf16 as the trainer publishes it and handed to two bf16 hf engines with the tensors it changed,
through `update_weights` as a worker does: one given the merged W0 + B @ A (an engine that
cannot serve adapters), one given the adapters as published (served unmerged, model/adapters.py).

Per version: each engine's update error, ||served update - trainer update|| / ||trainer update||
over the adapted layers (`adapters.update_error`; 1 means the worker still computes with the base),
and the fraction of the adapted weights' bf16 elements the merged engine holds changed since v0.
Prints one JSON object on the last line of stdout.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import cast

import torch
from transformers import PreTrainedModel

from decentrl.argparser import Parser
from decentrl.config import LoraConfig, ModelConfig
from decentrl.engines.hf import HFEngine
from decentrl.model import adapters, lora
from decentrl.model.tiny import build_tiny
from decentrl.weights.codec import published_state


@dataclass
class VersionError:
    version: int
    merged: float
    """Update error of the engine given W0 + B @ A."""
    unmerged: float
    """Update error of the engine serving the adapters as published."""
    merged_changed: float
    """Fraction of the adapted weights' elements the merged engine holds changed since v0."""


def trained_versions(
    model: PreTrainedModel, lr: float, versions: int, rank: int = 2, alpha: float = 32.0, seed: int = 0
) -> Iterator[torch.nn.Module]:
    """`model` (fp32) under LoRA adapters at version 0 (B = 0), then after each of `versions`
    AdamW steps: the trainer's model, version by version."""
    torch.manual_seed(seed)  # peft draws A at random
    adapted = lora.attach(model, LoraConfig(rank=rank, alpha=alpha))
    optimizer = torch.optim.AdamW(
        [p for p in adapted.parameters() if p.requires_grad], lr=lr, weight_decay=0.0
    )
    ids = torch.randint(3, model.config.vocab_size, (8, 24), generator=torch.Generator().manual_seed(seed))
    yield adapted
    for _ in range(versions):
        loss = adapted(input_ids=ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        yield adapted


def bf16_engine(dtype: torch.dtype, seed: int) -> HFEngine:
    model, tokenizer = build_tiny(ModelConfig(seed=seed + 1))  # other weights: v0 must overwrite them
    model = model.to(dtype)  # pyright: ignore[reportArgumentType] (transformers' `to` decorator)
    # the tiny tokenizer defines one eos and one pad token (model/tiny.py): plain ints
    eos, pad = cast(int, tokenizer.eos_token_id), cast(int, tokenizer.pad_token_id)
    return HFEngine(model, [eos], pad, device="cpu")


def update_errors(
    lr: float, versions: int, rank: int = 2, alpha: float = 32.0, dtype: str = "bfloat16", seed: int = 0
) -> list[VersionError]:
    """The update error of a merged and an unmerged `dtype` engine at versions 1..`versions`."""
    merged, unmerged = bf16_engine(getattr(torch, dtype), seed), bf16_engine(getattr(torch, dtype), seed)
    previous: dict[str, torch.Tensor] = {}
    starts: tuple[dict, dict, dict] | None = None
    out = []
    model, _ = build_tiny(ModelConfig(seed=seed))
    for version, trainer in enumerate(trained_versions(model, lr, versions, rank, alpha, seed)):
        exact = lora.publication_state(trainer)
        published = published_state(exact, dtype)  # type: ignore[arg-type]  # a DType name
        changed = [
            name
            for name in published
            if name not in previous or not torch.equal(published[name], previous[name])
        ]
        merged.update_weights(lora.merge(published, changed), version)
        unmerged.update_weights({name: published[name] for name in changed}, version)
        previous = published
        names = [f"{module}.weight" for module in lora.adapted_modules(published)]
        trainer_now = {name: tensor for name, tensor in lora.merge(exact).items() if name in names}
        merged_now, unmerged_now = (adapters.effective_weights(engine.model) for engine in (merged, unmerged))
        if starts is None:
            starts = (trainer_now, merged_now, unmerged_now)
            continue
        changed_elements = sum(int((merged_now[n] != starts[1][n]).sum()) for n in names)
        out.append(
            VersionError(
                version=version,
                merged=adapters.update_error(trainer_now, starts[0], merged_now, starts[1]),
                unmerged=adapters.update_error(trainer_now, starts[0], unmerged_now, starts[2]),
                merged_changed=changed_elements / sum(trainer_now[n].numel() for n in names),
            )
        )
    return out


def main(argv: list[str]) -> int:
    parser = Parser(prog="decentrl bench lora", description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--lr", type=float, nargs="+", default=[1e-3, 2e-4, 1e-5], help="learning rates")
    parser.add_argument("--versions", type=int, default=20, help="AdamW steps (versions) per rate")
    parser.add_argument("--rank", type=int, default=2)
    parser.add_argument("--alpha", type=float, default=32.0)
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    runs = []
    for lr in args.lr:
        errors = update_errors(lr, args.versions, args.rank, args.alpha, args.dtype, args.seed)
        run = {
            "lr": lr,
            "median_merged": statistics.median(e.merged for e in errors),
            "median_unmerged": statistics.median(e.unmerged for e in errors),
            "max_unmerged": max(e.unmerged for e in errors),
            "median_merged_changed": statistics.median(e.merged_changed for e in errors),
            "versions": [asdict(e) for e in errors],
        }
        print(
            f"lr {lr:g}: update error merged {run['median_merged']:.3f}, unmerged {run['median_unmerged']:.4f} "
            f"(median over v1-v{args.versions}); merged engine changed {run['median_merged_changed']:.1%} "
            "of the adapted elements",
            file=sys.stderr,
        )
        runs.append(run)
    print(json.dumps({"rank": args.rank, "alpha": args.alpha, "dtype": args.dtype, "runs": runs}))
    return 0
