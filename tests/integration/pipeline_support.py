"""One version of the tiny model on a fixed batch by K stage trainers (torchrun, one rank per stage).

`python -m torch.distributed.run --nproc-per-node K pipeline_support.py MODEL_DIR OUT NUM_LAYERS
SCHEDULE LORA_RANKS [SETTING ...]` loads stage `rank` of MODEL_DIR alone (`trainer/stage_model.py`)
and, for each LoRA rank of the comma-separated LORA_RANKS, trains one version of
`distributed_support.build_case` through the pipeline and saves each rank's stage state (as
published) to OUT.lora<R>.<rank>.pt, the metrics to OUT.lora<R>.metrics.json and the parameter
names each rank materialised to OUT.lora<R>.<rank>.names. `one_process` is the same version in
one process from the same start (the stage trainers' adapter initialisation applied to it).
"""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path

import torch
from distributed_support import build_case, published

from decentrl.config import LoraConfig
from decentrl.model import lora
from decentrl.stage_map import StageMap
from decentrl.trainer.batch import collate
from decentrl.trainer.stage_model import initial_adapters
from decentrl.trainer.step import train_step

SEED = 0


def settings_of(micro_batch_tokens: int, minibatches: int, extra: tuple[str, ...] = ()) -> tuple[str, ...]:
    return (
        f"trainer.micro_batch_tokens={micro_batch_tokens}",
        f"trainer.minibatches_per_version={minibatches}",
        *extra,
    )


def one_process(lora_rank: int, num_layers: int, settings: tuple[str, ...]) -> tuple[dict, dict]:
    """The one-process trainer's update (as published) and metrics, from the stage trainers' start."""
    model, groups, algorithm, config, info = build_case(lora_rank, num_layers, settings)
    initial_adapters(model, SEED)
    warm_start = copy.deepcopy(model).requires_grad_(False)
    reference = lora.reference_model(model, lambda: warm_start) if algorithm.config.kl_coef > 0 else None
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=config.lr, weight_decay=config.weight_decay
    )
    tensors = collate(groups, info.pad_token_id, algorithm.advantage)
    metrics = train_step(
        model, optimizer, tensors, algorithm, config, 1.0, 0, info.sampling.max_new_tokens, reference
    )
    return published(model), metrics


def initial(lora_rank: int, num_layers: int) -> dict:
    model = build_case(lora_rank, num_layers)[0]
    initial_adapters(model, SEED)
    return published(model)


def stages_main(
    model_dir: str, out: str, num_layers: int, schedule: str, lora_ranks: str, *settings: str
) -> None:
    """Every rank: one version of the case for each LoRA rank of `lora_ranks` (comma-separated),
    from a fresh stage each time."""
    from decentrl.trainer import distributed
    from decentrl.trainer.master_weights import MasterWeights
    from decentrl.trainer.pipeline_parallel import PipelineRunner
    from decentrl.trainer.pipeline_parallel import train_step as pipeline_step
    from decentrl.trainer.stage_model import load_stage_model

    ranks = distributed.init_process_group(stages=int(os.environ["WORLD_SIZE"]))
    stage_map = StageMap.even(num_layers, ranks.world_size, tied_embeddings=True)
    for lora_rank in map(int, lora_ranks.split(",")):
        _, groups, algorithm, config, info = build_case(lora_rank, num_layers, settings)
        lora_config, device = LoraConfig(rank=lora_rank), str(ranks.device)
        stage = load_stage_model(Path(model_dir), stage_map, ranks.rank, lora_config, SEED, device)
        prefix = f"{out}.lora{lora_rank}.{ranks.rank}"
        Path(f"{prefix}.names").write_text("\n".join(sorted(stage.stage.materialised)))
        reference = None
        if algorithm.config.kl_coef > 0 and lora_rank == 0:  # with LoRA: this stage, adapters off
            reference = load_stage_model(
                Path(model_dir), stage_map, ranks.rank, LoraConfig(rank=0), SEED, device
            )
            reference.model.requires_grad_(False)
        runner = PipelineRunner(stage, ranks, schedule, reference, config.boundary_codec)  # type: ignore[arg-type]
        master = MasterWeights(stage.model)
        optimizer = torch.optim.AdamW(master.parameters(), lr=config.lr, weight_decay=config.weight_decay)
        tensors = collate(groups, info.pad_token_id, algorithm.advantage)
        metrics = pipeline_step(
            runner, optimizer, tensors, algorithm, config, 1.0, 0, info.sampling.max_new_tokens
        )
        torch.save({name: tensor.cpu().clone() for name, tensor in stage.state().items()}, f"{prefix}.pt")
        if ranks.is_main:
            Path(f"{out}.lora{lora_rank}.metrics.json").write_text(json.dumps(metrics))
    distributed.close_process_group()


if __name__ == "__main__":
    stages_main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5], *sys.argv[6:])
