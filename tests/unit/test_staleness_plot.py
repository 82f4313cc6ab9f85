"""The staleness study's figure: drawn for a table whose cells never reached the target (a real
model's short study) without matplotlib's empty-legend warning, and for the toy's full table."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

from decentrl.eval.staleness_plot import plot_staleness

DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_a_study_that_never_reached_the_target_is_drawn_without_warnings(tmp_path) -> None:
    for name in ("staleness-smollm2-study.json", "staleness-study-four-steps.json"):
        table = json.loads((DOCS / name).read_text())["table"]
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            path = plot_staleness(table, 0.75, tmp_path / f"{name}.png")
        assert path.stat().st_size > 10_000
