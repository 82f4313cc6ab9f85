"""`decentrl eval`: run the harness on a source, print a table and one JSON line.

The last stdout line is one JSON object (as for `decentrl bench`): the source, the environment,
and each score with its interval, keyed `pass@1_greedy`, `pass@k`, `avg@k` with k spelled out.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from decentrl.config import RunConfig
from decentrl.envs import environment_from_config
from decentrl.eval.evaluate import EvalResult, evaluate
from decentrl.eval.sources import load_target


def report(result: EvalResult, label: str, config: RunConfig, seconds: float) -> dict:
    k = result.num_samples
    scores = {"pass@1_greedy": result.greedy}
    if result.pass_at_k is not None and result.avg_at_k is not None:
        scores[f"pass@{k}"] = result.pass_at_k
        scores[f"avg@{k}"] = result.avg_at_k
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


def run_report(config: RunConfig, source: str, model_dir: Path | None, version: int | None) -> dict:
    """Evaluate `source` with `config.eval` on `config.task`'s held-out split; the report dict."""
    started = time.monotonic()
    target = load_target(source, config, model_dir, version)
    settings = config.eval
    result = evaluate(
        target.engine,
        environment_from_config(config.task),
        target.chat,
        settings.num_problems or config.task.eval_size,
        config.coordinator.max_new_tokens,
        batch_size=settings.batch_size,
        num_samples=settings.num_samples,
        temperature=settings.temperature,
        confidence=settings.confidence,
        seed=settings.seed,
        max_context=target.max_context,
    )
    return report(result, target.label, config, time.monotonic() - started)


def main_eval(config: RunConfig, source: str, model_dir: Path | None, version: int | None) -> int:
    summary = run_report(config, source, model_dir, version)
    print_table(summary)
    print(json.dumps(summary))
    return 0
