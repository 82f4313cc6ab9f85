"""CPU time and bytes per version: K stage trainers against the one-process trainer.

`python -m benchmarks.pipeline.stage_trainers [--versions 6] [--stages 2] [--lora 2]
[--micro-batch-tokens 16384 256]` trains the same versions of the demo's model on the same
demo-shaped batch (16 groups of 8: an arithmetic prompt of 8-12 tokens, 1-6 sampled tokens) with
the trainer's own step in one process, then with K stage trainers under torchrun (gloo, one rank
per stage, `trainer/pipeline_parallel.py`), and reports per version: wall seconds, CPU seconds (user
+ system, summed over the ranks), and the bytes that crossed each stage boundary (hidden states
forward, their gradients backward) plus the tied embedding's gradient exchange. The first version
of each arm is a warm-up and is not counted. One JSON object on the last line of stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from decentrl.config import LoraConfig, load_config
from decentrl.model import lora
from decentrl.model.tiny import build_tiny, save_model_dir
from decentrl.protocol import Segment, TrainGroup, TrainRollout
from decentrl.trainer.batch import collate
from decentrl.trainer.step import Algorithm, train_step


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def demo_batch(vocab: int, seed: int = 0) -> list[TrainGroup]:
    generator = torch.Generator().manual_seed(seed)
    groups = []
    for g in range(16):
        prompt = torch.randint(3, vocab, (8 + g % 5,), generator=generator).tolist()
        rollouts = []
        for i in range(8):
            completion = torch.randint(3, vocab, (1 + (g + i) % 6,), generator=generator).tolist()
            logprobs = (-torch.rand(len(completion), generator=generator) * 3).tolist()
            segment = Segment(
                source="model", token_ids=completion, logprobs=logprobs, policy_versions=[0] * len(completion)
            )
            rollouts.append(
                TrainRollout(
                    rollout_id=f"{g}-{i}",
                    worker_id="w",
                    prompt_token_ids=prompt,
                    segments=[segment],
                    finish_reason="stop",
                    reward=float((g * 3 + i) % 2),
                )
            )
        groups.append(TrainGroup(group_id=str(g), task_id=str(g), rollouts=rollouts))
    return groups


def settings(lora_rank: int, micro_batch_tokens: int) -> list[str]:
    lr = "1e-3" if lora_rank else "1.25e-4"
    return [
        "trainer.lr_warmup_steps=0",
        f"trainer.lr={lr}",
        f"trainer.micro_batch_tokens={micro_batch_tokens}",
    ]


def one_process(model_dir: Path, lora_rank: int, micro_batch_tokens: int, versions: int) -> dict:
    from transformers import AutoModelForCausalLM

    config = load_config("demo", settings(lora_rank, micro_batch_tokens))
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = lora.attach(base, LoraConfig(rank=lora_rank))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=config.trainer.lr)
    algorithm = Algorithm.from_config(config.algorithm)
    groups = demo_batch(base.config.vocab_size)
    tensors = collate(groups, 0, algorithm.advantage)
    wall = cpu = 0.0
    for version in range(versions + 1):
        started, cpu_started = time.perf_counter(), cpu_seconds()
        train_step(model, optimizer, tensors, algorithm, config.trainer, 1.0, version, 6)
        if version:  # the first is a warm-up
            wall += time.perf_counter() - started
            cpu += cpu_seconds() - cpu_started
    return {
        "wall_seconds": wall / versions,
        "cpu_seconds": cpu / versions,
        "tokens": int(tensors.attention_mask_bt.sum()),
    }


def rank_main(model_dir: str, out: str, lora_rank: int, micro_batch_tokens: int, versions: int) -> None:
    """One stage trainer: the same versions through the pipeline; its own wall, CPU and traffic."""
    from decentrl.stage_map import StageMap
    from decentrl.trainer import distributed
    from decentrl.trainer.pipeline_parallel import PipelineRunner
    from decentrl.trainer.pipeline_parallel import train_step as pipeline_step
    from decentrl.trainer.stage_model import load_stage_model

    ranks = distributed.init_process_group(stages=int(os.environ["WORLD_SIZE"]))
    config = load_config("demo", settings(lora_rank, micro_batch_tokens))
    stage_map = StageMap.even(config.model.num_layers, ranks.world_size, tied_embeddings=True)
    stage = load_stage_model(Path(model_dir), stage_map, ranks.rank, LoraConfig(rank=lora_rank), 0)
    runner = PipelineRunner(
        stage, ranks, config.trainer.pipeline_schedule, None, config.trainer.boundary_codec
    )
    trainable = [p for _, p in stage.named_trainable()]
    optimizer = torch.optim.AdamW(trainable, lr=config.trainer.lr)
    algorithm = Algorithm.from_config(config.algorithm)
    groups = demo_batch(stage.stage.config.vocab_size)
    tensors = collate(groups, 0, algorithm.advantage)
    wall = cpu = crossed = tied = 0.0
    for version in range(versions + 1):
        started, cpu_started = time.perf_counter(), cpu_seconds()
        runner.traffic.clear()
        metrics = pipeline_step(runner, optimizer, tensors, algorithm, config.trainer, 1.0, version, 6)
        if version:
            wall += time.perf_counter() - started
            cpu += cpu_seconds() - cpu_started
            tokens = float(tensors.attention_mask_bt.sum())
            # pi_prox's forward pass plus the training passes' (the batch once per epoch)
            forward = metrics["boundary_forward_bytes_per_token"] * tokens * (1 + config.trainer.epochs)
            crossed += forward + metrics["boundary_backward_bytes_per_token"] * tokens * config.trainer.epochs
            tied += metrics["tied_embedding_bytes"]
    Path(f"{out}.{ranks.rank}.json").write_text(
        json.dumps(
            {
                "wall_seconds": wall / versions,
                "cpu_seconds": cpu / versions,
                "boundary_bytes": crossed / versions,
                "tied_embedding_bytes": tied / versions,
            }
        )
    )
    distributed.close_process_group()


def stage_trainers(
    model_dir: Path, stages: int, lora_rank: int, micro_batch_tokens: int, versions: int
) -> dict:
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "rank"
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={stages}",
        ]
        command += ["-m", "benchmarks.pipeline.stage_trainers", "--rank", str(model_dir), str(out)]
        command += [str(lora_rank), str(micro_batch_tokens), str(versions)]
        done = subprocess.run(
            command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}
        )
        if done.returncode:
            raise RuntimeError(done.stderr[-3000:])
        ranks = [json.loads(Path(f"{out}.{rank}.json").read_text()) for rank in range(stages)]
    return {
        "wall_seconds": max(r["wall_seconds"] for r in ranks),
        "cpu_seconds": sum(r["cpu_seconds"] for r in ranks),
        "cpu_seconds_by_rank": [round(r["cpu_seconds"], 4) for r in ranks],
        "boundary_bytes": ranks[0]["boundary_bytes"],
        "tied_embedding_bytes": ranks[0]["tied_embedding_bytes"],
    }


def main(argv: list[str]) -> int:
    if argv and argv[0] == "--rank":
        rank_main(argv[1], argv[2], int(argv[3]), int(argv[4]), int(argv[5]))
        return 0
    parser = argparse.ArgumentParser(prog="python -m benchmarks.pipeline.stage_trainers")
    parser.add_argument("--versions", type=int, default=6)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--lora", type=int, nargs="+", default=[2, 0])
    parser.add_argument("--micro-batch-tokens", type=int, nargs="+", default=[16384, 256])
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    config = load_config("demo", [])
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = save_model_dir(*build_tiny(config.model), Path(scratch) / "model")
        for lora_rank in args.lora:
            for budget in args.micro_batch_tokens:
                single = one_process(model_dir, lora_rank, budget, args.versions)
                staged = stage_trainers(model_dir, args.stages, lora_rank, budget, args.versions)
                row = {
                    "lora_rank": lora_rank,
                    "micro_batch_tokens": budget,
                    "one_process": single,
                    "stages": staged,
                }
                print(json.dumps(row), file=sys.stderr)
                rows.append(row)
    print(json.dumps({"stages": args.stages, "versions": args.versions, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
