"""The synchronous arm of `decentrl bench throughput`: generate a batch, score it, train on it,
repeat, all in one process with no HTTP and no database.

It is the ceiling this machine reaches for a config, built from the very parts the distributed
roles use: the `hf` engine sampling whole leases (`groups_per_lease` groups per `generate` call,
as a worker does), the environment's episodes and the coordinator's reward rubric, the trainer's
collate, loss, optimizer and LoRA settings (`trainer/step.py`), and greedy held-out evaluation
of version 0 and then every `trainer.eval_every` versions, as the trainer does. Nothing is
published or checkpointed: the new weights are merged into the engine in place. Every version is
on-policy (staleness 0).

Run as `python -m benchmarks.throughput.sync CONFIG_JSON OUT_JSON --budget-s S`; it writes
one JSON object: the time of each trained version, its rollouts and any evaluation.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def play_groups(engine, env, chat, rubric, config, seeds: list[int], lease_seed: int) -> list:
    """`len(seeds)` groups of `group_size` rollouts, sampled one lease at a time, with trusted rewards."""
    from decentrl.envs.episode import run_episodes, start
    from decentrl.protocol import SamplingParams, TrainGroup, TrainRollout
    from decentrl.rewards.rubric import ScoreJob

    sampling = SamplingParams(
        temperature=config.coordinator.temperature, max_new_tokens=config.coordinator.max_new_tokens
    )
    group_size, per_lease = config.coordinator.group_size, config.worker.groups_per_lease
    groups = []
    for first in range(0, len(seeds), per_lease):
        lease = seeds[first : first + per_lease]
        problems = [env.problem(seed, "train") for seed in lease]
        episodes = [start(env, chat, problem) for problem in problems for _ in range(group_size)]
        run_episodes(engine, env, chat, episodes, sampling, lease_seed + first)
        for index, seed in enumerate(lease):
            rollouts = []
            for slot, episode in enumerate(episodes[index * group_size : (index + 1) * group_size]):
                rollout_id = f"s{seed}-{slot}"
                terms = rubric.score_local(ScoreJob(rollout_id, seed, "train", episode.messages)).terms
                rollouts.append(
                    TrainRollout(
                        rollout_id=rollout_id,
                        worker_id="sync",
                        prompt_token_ids=episode.prompt_ids,
                        segments=episode.segments,
                        finish_reason=episode.finish_reason(tuple(chat.eos_token_ids)),
                        reward=rubric.combine(terms),
                    )
                )
            groups.append(TrainGroup(group_id=f"g{seed}", task_id=f"t{seed}", rollouts=rollouts))
    return groups


def run(config_path: Path, out: Path, budget_s: float, process_start: float, num_threads: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from decentrl.config import RunConfig
    from decentrl.engines.hf import HFEngine
    from decentrl.envs import environment_from_config
    from decentrl.envs.chat import ChatFormat
    from decentrl.eval.evaluate import evaluate
    from decentrl.model import lora
    from decentrl.model.precision import Precision
    from decentrl.model.resolve import resolve_model_dir
    from decentrl.model.special import read_eos_token_ids, read_pad_token_id
    from decentrl.rewards.rubric import Rubric
    from decentrl.trainer.batch import collate
    from decentrl.trainer.master_weights import MasterWeights
    from decentrl.trainer.step import Algorithm, train_step

    config = RunConfig.model_validate_json(config_path.read_text())
    torch.manual_seed(config.seed)
    torch.set_num_threads(num_threads)
    model_dir = resolve_model_dir(config, None)
    precision = Precision.from_config(config.trainer)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=precision.dtype)
    model = model.to(precision.device)  # pyright: ignore[reportArgumentType] (transformers' `to` decorator)
    model = lora.attach(model, config.lora)
    master = MasterWeights(model)
    optimizer = torch.optim.AdamW(
        master.parameters(), lr=config.trainer.lr, weight_decay=config.trainer.weight_decay
    )
    algorithm = Algorithm.from_config(config.algorithm)
    eos_ids, pad_id = read_eos_token_ids(model_dir), read_pad_token_id(model_dir)
    engine = HFEngine(
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), eos_ids, pad_id, "cpu"
    )
    engine.load_weights(lora.merge(lora.publication_state(model)), version=0)
    chat = ChatFormat.from_model_dir(model_dir, eos_ids)
    env = environment_from_config(config.task)
    rubric = Rubric(config.reward, env)
    train, max_new = config.trainer, config.coordinator.max_new_tokens
    timeline = [{"version": 0, "time": time.time(), "num_rollouts": 0}]
    seed = config.seed * 1_000_003  # a task stream of its own, like the coordinator's
    version = 0
    result = {"process_start": process_start, "timeline": timeline, "num_threads": num_threads}
    if train.eval_every:  # the trainer evaluates version 0 too, before its first update
        timeline[0]["eval_accuracy"] = evaluate(engine, env, chat, train.eval_size, max_new).accuracy
    try:
        while time.time() - process_start < budget_s and version < train.num_steps:
            seeds = list(range(seed, seed + train.groups_per_step))
            seed += train.groups_per_step
            groups = play_groups(engine, env, chat, rubric, config, seeds, lease_seed=seed)
            shaping = lambda r, n: algorithm.loss.shape_rewards(r, n, max_new)  # noqa: E731
            tensors = collate(groups, pad_id, algorithm.advantage, shaping)
            metrics = train_step(
                model,
                optimizer,
                tensors,
                algorithm,
                train,
                config.coordinator.temperature,
                version,
                max_new,
                None,
                master,
            )
            version += 1
            engine.update_weights(lora.merge(lora.publication_state(model)), version)
            point = {"version": version, "time": time.time(), "num_rollouts": int(metrics["num_rollouts"])}
            point["reward_mean"] = metrics["reward_mean"]
            if train.eval_every and version % train.eval_every == 0:
                point["eval_accuracy"] = evaluate(engine, env, chat, train.eval_size, max_new).accuracy
            timeline.append(point)
            print(
                f"sync v{version} reward {metrics['reward_mean']:.3f} {point.get('eval_accuracy', '')}",
                file=sys.stderr,
            )
    finally:  # what was trained counts, even when interrupted
        out.write_text(json.dumps(result))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.throughput.sync")
    parser.add_argument("config", type=Path, help="the resolved run config (JSON)")
    parser.add_argument("out", type=Path, help="where the timeline goes (JSON)")
    parser.add_argument(
        "--budget-s", type=float, required=True, help="stop after this long from process start"
    )
    parser.add_argument("--process-start", type=float, default=None, help="unix time the process was spawned")
    parser.add_argument("--num-threads", type=int, default=os.cpu_count() or 1, help="torch CPU threads")
    args = parser.parse_args(argv)
    start = args.process_start if args.process_start is not None else time.time()
    run(args.config, args.out, args.budget_s, start, args.num_threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
