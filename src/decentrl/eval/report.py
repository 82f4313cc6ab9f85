"""`decentrl eval`: run the harness on one or more sources, print a table and one JSON line.

The last stdout line is one JSON object (as for `decentrl bench`): the source, the environment,
and each score with its interval, keyed `pass@1_greedy`, `pass@k`, `avg@k` with k spelled out.
With several sources or `--benchmark`s it is `{"results": [one such object per pair]}`.

A benchmark (`--benchmark humaneval`, `--benchmark math500`; envs/benchmarks.py) replaces the
config's task for that evaluation: its held-out problems are all of the benchmark's (or
`eval.num_problems` of them), with `BENCHMARK_MAX_NEW_TOKENS` tokens per answer unless
`--max-new-tokens` says otherwise.
"""

from __future__ import annotations

import json
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import TextIO

from decentrl.config import ConfigError, RunConfig, TaskConfig
from decentrl.envs import environment_from_config
from decentrl.eval.evaluate import EvalResult, evaluate
from decentrl.eval.sources import Target, load_target

BENCHMARKS = ("humaneval", "math500")
BENCHMARK_MAX_NEW_TOKENS = 512
"""Room for a function or a worked solution; the task's own budget (a few tokens for the demo's
sums) would cut every answer short."""
BENCHMARK_BATCH_SIZE = 32
"""Benchmark episodes generated together at most: at 512 new tokens the KV cache of 32 SmolLM2-135M
episodes is about 1 GB in fp32 (a batch of 256 would take 8 GB), and each batch reports progress."""


def report(result: EvalResult, label: str, config: RunConfig, seconds: float) -> dict:
    k = result.num_samples
    scores = {"pass@1_greedy": result.greedy}
    if result.pass_at_k is not None and result.avg_at_k is not None:
        scores[f"pass@{k}"] = result.pass_at_k
        scores[f"avg@{k}"] = result.avg_at_k
    if result.answers:
        scores.update(result.format_scores(config.eval.confidence))
    return {
        "source": label,
        "env": config.task.env,
        "env_args": config.task.args,
        "split": "eval",
        "num_problems": result.num_problems,
        "num_samples": k,
        "temperature": config.eval.temperature,
        "confidence": config.eval.confidence,
        **{name: score.model_dump() for name, score in scores.items()},
        "seconds": round(seconds, 2),
    }


def print_table(summary: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"{summary['source']} on {summary['env']} (eval split, {summary['num_problems']} problems)"
    )
    for column in ("score", "value", f"{100 * summary['confidence']:.0f} % interval"):
        table.add_column(column)
    for name, score in summary.items():
        if isinstance(score, dict) and "value" in score:
            table.add_row(name, f"{score['value']:.3f}", f"[{score['low']:.3f}, {score['high']:.3f}]")
    Console(file=sys.stdout, width=None if sys.stdout.isatty() else 110).print(table)


def benchmark_config(config: RunConfig, benchmark: str, max_new_tokens: int | None) -> RunConfig:
    """`config` with `benchmark` as its task, every one of its problems held out."""
    from decentrl.envs import load_environment

    size = len(load_environment(benchmark))  # type: ignore[arg-type]  # a Benchmark has a length
    coordinator = config.coordinator.model_copy(
        update={"max_new_tokens": max_new_tokens or BENCHMARK_MAX_NEW_TOKENS}
    )
    settings = config.eval.model_copy(
        update={"batch_size": min(config.eval.batch_size, BENCHMARK_BATCH_SIZE)}
    )
    return config.model_copy(
        update={
            "task": TaskConfig(env=benchmark, eval_size=size),
            "coordinator": coordinator,
            "eval": settings,
        }
    )


def evaluate_target(target: Target, config: RunConfig, answers: TextIO | None = None) -> dict:
    """Evaluate a loaded `target` with `config.eval` on `config.task`'s held-out split; with
    `answers`, every greedy answer is written to it as a JSON line (source, env and the answer)."""
    started = time.monotonic()
    settings = config.eval
    result = evaluate(
        target.engine,
        environment_from_config(config.task, config.sandbox),
        target.chat,
        settings.num_problems or config.task.eval_size,
        config.coordinator.max_new_tokens,
        batch_size=settings.batch_size,
        num_samples=settings.num_samples,
        temperature=settings.temperature,
        confidence=settings.confidence,
        seed=settings.seed,
        max_context=target.max_context,
        progress=f"{target.label} on {config.task.env}",
    )
    if answers is not None:
        for answer in result.answers:
            answers.write(json.dumps({"source": target.label, "env": config.task.env, **answer}) + "\n")
        answers.flush()
    return report(result, target.label, config, time.monotonic() - started)


def run_report(config: RunConfig, source: str, model_dir: Path | None, version: int | None) -> dict:
    """Evaluate `source` with `config.eval` on `config.task`'s held-out split; the report dict."""
    return evaluate_target(load_target(source, config, model_dir, version), config)


def open_answers(path: Path) -> TextIO:
    """The `--answers` file, opened before any model is loaded: a path that cannot be written is a
    one-line error now, not after the evaluation's minutes."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return path.open("w")
    except OSError as exc:
        raise ConfigError(
            f"cannot write --answers {path} ({exc.strerror or exc}); pass a writable path"
        ) from None


def main_eval(
    config: RunConfig,
    sources: list[str],
    model_dir: Path | None,
    version: int | None,
    benchmarks: list[str] | None = None,
    max_new_tokens: int | None = None,
    answers_path: Path | None = None,
) -> int:
    """Each source (loaded once) on each benchmark, or on the config's task when none is named;
    with `answers_path`, every greedy answer as a JSON line there."""
    if max_new_tokens is not None and not benchmarks:
        config = config.model_copy(
            update={"coordinator": config.coordinator.model_copy(update={"max_new_tokens": max_new_tokens})}
        )
    configs = [benchmark_config(config, b, max_new_tokens) for b in benchmarks] if benchmarks else [config]
    summaries = []
    with open_answers(answers_path) if answers_path is not None else nullcontext() as answers:
        for source in sources:
            target = load_target(source, config, model_dir, version)
            for setting in configs:
                summary = evaluate_target(target, setting, answers)
                print_table(summary)
                summaries.append(summary)
    print(json.dumps(summaries[0] if len(summaries) == 1 else {"results": summaries}))
    return 0
