"""One training step of the tiny model on a fixed batch, in 1 process or on N ranks (torchrun).

`python -m torch.distributed.run --nproc-per-node N distributed_support.py OUT LORA_RANK` runs the
trainer's step on N ranks on the batch and rank 0 saves the gathered updated weights (as
published) to OUT and the step's metrics to OUT.metrics.json; `one_process_step` is the same step
in one process. Everything is deterministic in the seed, so both start from identical weights.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from decentrl.algo.logprobs import sequence_logprobs
from decentrl.config import LoraConfig, ModelConfig, load_config
from decentrl.model import lora
from decentrl.model.tiny import build_tiny
from decentrl.protocol import SamplingParams, Segment, ServerInfo, TrainGroup, TrainRollout
from decentrl.trainer.batch import collate
from decentrl.trainer.master_weights import MasterWeights
from decentrl.trainer.step import Algorithm, train_step
from decentrl.weights.unique_storage import state_for_publication

GROUP_SIZE = 3
NUM_GROUPS = 3
"""9 sequences: an uneven split over 2 ranks (5 + 4 rows)."""


def build_case(lora_rank: int, num_layers: int = 2, settings: tuple[str, ...] = ()):
    """(model, groups, algorithm, trainer config, info): lengths differ, rewards differ within groups,
    the behaviour log-probs are the model's own plus noise (a slightly stale worker). `settings`:
    more `section.key=value` over the case's config."""
    config = load_config(None, ["trainer.lr_warmup_steps=0", "trainer.lr=1e-3", *settings])
    torch.manual_seed(0)
    base, tokenizer = build_tiny(ModelConfig(num_layers=num_layers))
    model = lora.attach(base.float(), LoraConfig(rank=lora_rank))
    generator = torch.Generator().manual_seed(1)
    groups = []
    for g in range(NUM_GROUPS):
        prompt = torch.randint(3, 20, (4 + g,), generator=generator).tolist()
        rollouts = []
        for i in range(GROUP_SIZE):
            completion = torch.randint(3, 20, (2 + (g + i) % 4,), generator=generator).tolist()
            ids = torch.tensor([prompt + completion])
            with torch.no_grad():
                logprobs, _ = sequence_logprobs(model, ids, torch.ones_like(ids), 1.0)
            behaviour = logprobs[0, len(prompt) :] + 0.05 * torch.randn(len(completion), generator=generator)
            segment = Segment(
                source="model",
                token_ids=completion,
                logprobs=behaviour.tolist(),
                policy_versions=[0] * len(completion),
            )
            rollouts.append(
                TrainRollout(
                    rollout_id=f"{g}-{i}",
                    worker_id="w",
                    prompt_token_ids=prompt,
                    segments=[segment],
                    finish_reason="length",
                    reward=float((g + i) % 2),
                )
            )
        groups.append(TrainGroup(group_id=str(g), task_id=str(g), rollouts=rollouts))
    info = ServerInfo(
        run_id="test",
        vocab_size=tokenizer.vocab_size,
        eos_token_ids=[tokenizer.eos_token_id],
        pad_token_id=tokenizer.pad_token_id,
        group_size=GROUP_SIZE,
        max_staleness=4,
        sampling=SamplingParams(max_new_tokens=8),
        latest_version=0,
        model_files=[],
    )
    return model, groups, Algorithm.from_config(config.algorithm), config.trainer, info


def published(model: torch.nn.Module, state: dict[str, torch.Tensor] | None = None) -> dict:
    """The state as the trainer publishes it (LoRA: adapters in the published layout)."""
    state = state if state is not None else state_for_publication(model)
    if lora._is_peft(model):
        (peft_config,) = model.peft_config.values()
        return lora.publication_layout(state, peft_config.lora_alpha / peft_config.r)
    return state


def one_process_step(lora_rank: int) -> dict[str, torch.Tensor]:
    return one_process_step_and_metrics(lora_rank)[0]


def one_process_step_and_metrics(lora_rank: int) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """The updated weights (as published) and the step's metrics of the 1-process trainer."""
    model, groups, algorithm, config, info = build_case(lora_rank)
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=config.lr, weight_decay=config.weight_decay
    )
    tensors = collate(groups, info.pad_token_id, algorithm.advantage)
    metrics = train_step(model, optimizer, tensors, algorithm, config, 1.0, 0, info.sampling.max_new_tokens)
    return published(model), metrics


def sharded_step(model, optimizer, master, groups, algorithm, config, info, version, ranks) -> dict:
    """The trainer's step on N ranks: every rank collates the whole batch."""
    tensors = collate(groups, info.pad_token_id, algorithm.advantage)
    return train_step(
        model,
        optimizer,
        tensors,
        algorithm,
        config,
        1.0,
        version,
        info.sampling.max_new_tokens,
        None,
        master,
        ranks,
    )


def sharded_main(out: str, lora_rank: int, minibatches: int | None = None) -> None:
    """`minibatches`: mini-batches asked of the version (default the config's)."""
    from decentrl.trainer import distributed

    ranks = distributed.init_process_group()
    model, groups, algorithm, config, info = build_case(lora_rank)
    if minibatches is not None:
        config = config.model_copy(update={"minibatches_per_version": minibatches})
    names = list(state_for_publication(model))
    distributed.shard_model(model, ranks.device)
    master = MasterWeights(model)
    optimizer = torch.optim.AdamW(master.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    groups = distributed.broadcast(groups, ranks)
    metrics = sharded_step(model, optimizer, master, groups, algorithm, config, info, 0, ranks)
    state = distributed.full_state(model, names, ranks)
    if ranks.is_main:
        torch.save(published(model, state), out)
        Path(f"{out}.metrics.json").write_text(json.dumps(metrics))
    distributed.close_process_group()


def checkpoint_main(directory: str, mode: str, lora_rank: int) -> None:
    """save: one step, then a sharded checkpoint; load: a fresh model and optimizer resumed from it.
    Either way rank 0 writes the gathered model and optimizer state to directory/<mode>.pt."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    from decentrl.trainer import distributed
    from decentrl.trainer.checkpoint import TrainerState
    from decentrl.trainer.sharded_checkpoint import ShardedCheckpointer

    ranks = distributed.init_process_group()
    model, groups, algorithm, config, info = build_case(lora_rank)
    names = list(state_for_publication(model))
    distributed.shard_model(model, ranks.device)
    master = MasterWeights(model)
    optimizer = torch.optim.AdamW(master.parameters(), lr=config.lr)
    checkpointer = ShardedCheckpointer(Path(directory) / "sharded", ranks)
    if mode == "save":
        sharded_step(model, optimizer, master, groups, algorithm, config, info, 0, ranks)
        checkpointer.save(model, optimizer, TrainerState(policy_version=1, batch_id="b1"))
    else:
        assert checkpointer.load(model, optimizer) == TrainerState(policy_version=1, batch_id="b1")
    state = distributed.full_state(model, names, ranks)
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    optimizer_state = get_optimizer_state_dict(model, optimizer, options=full)
    if ranks.is_main:
        torch.save({"model": state, "optimizer": optimizer_state["state"]}, Path(directory) / f"{mode}.pt")
    distributed.close_process_group()


if __name__ == "__main__":
    if sys.argv[1] == "checkpoint":
        checkpoint_main(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        sharded_main(sys.argv[1], int(sys.argv[2]), *map(int, sys.argv[3:]))
