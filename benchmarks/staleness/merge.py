"""`decentrl bench staleness --merge`: pool the cells of several finished staleness studies.

A study run in pieces (more seeds later, some corrections in another process) is one study when
every piece ran the same protocol; this module checks that, pools the cells and writes the same
outputs a single run writes. A cell present in several files is taken from the last of them.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from benchmarks.staleness.table import aggregate, breakdowns, headline
from decentrl.config import ConfigError

# What must agree for cells to be comparable: the run length, the optimiser settings, the target
PROTOCOL = ("benchmark", "num_steps", "lr", "minibatches_per_version", "lora_rank", "target_accuracy")


def _load(path: Path) -> dict:
    try:
        study = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read staleness study {path}: {exc}") from exc
    if study.get("benchmark") != "staleness" or not isinstance(study.get("cells"), list):
        raise ConfigError(f"{path} is not a study.json written by decentrl bench staleness")
    missing = [key for key in PROTOCOL if key not in study]
    if missing:
        raise ConfigError(
            f"{path} does not record {', '.join(missing)}; run its bench staleness command again "
            "with this version (finished cells are reused) to rewrite it"
        )
    return study


def merge_studies(paths: list[Path], out: Path) -> dict:
    """Pool the cells of `paths` into `out`/study.json with its table, headline and figures."""
    studies = [_load(path) for path in paths]
    first = studies[0]
    for path, study in zip(paths[1:], studies[1:], strict=True):
        differs = [key for key in PROTOCOL if study[key] != first[key]]
        if differs:
            detail = ", ".join(f"{key} {study[key]} vs {first[key]}" for key in differs)
            raise ConfigError(f"{path} ran another protocol than {paths[0]} ({detail}); cannot merge")
    cells: dict[tuple[int, str, int], dict] = {}
    for study in studies:
        for cell in study["cells"]:
            cells[(cell["max_staleness"], cell["correction"], cell["seed"])] = cell
    pooled = list(cells.values())
    table = aggregate(pooled)
    result = {
        **{key: first[key] for key in PROTOCOL},
        "seeds": sorted({cell["seed"] for cell in pooled}),
        "merged_from": [str(path) for path in paths],
        "merged_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        # held-out accuracy before RL of every warm start the cells began from: more than one
        # value means the pieces started from different warm starts (compare within each)
        "eval_before": sorted({cell["eval_before"] for cell in pooled if "eval_before" in cell}),
        "headline": headline(table),
        "breaks_down_at": breakdowns(table),
        "table": table,
        "cells": pooled,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "study.json").write_text(json.dumps(result, indent=2))
    from decentrl.eval.staleness_plot import plot_seeds, plot_staleness

    result["plot"] = str(plot_staleness(table, first["target_accuracy"], out / "staleness.png"))
    result["seeds_plot"] = str(plot_seeds([result], out / "seeds.png"))
    return result
