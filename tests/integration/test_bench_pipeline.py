"""`decentrl bench pipeline` in its smallest configuration, end to end: a 2-stage pipeline of a tiny
model over loopback HTTP through the delaying proxy, against the whole model, and each codec's
bytes and log-prob gap. The figures it reports must be consistent with what it ran."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.pipeline.main import main
from decentrl.config import ModelConfig
from decentrl.model.tiny import build_tiny, save_model_dir

pytestmark = pytest.mark.integration
HIDDEN = 64
NEW_TOKENS = 3


def test_the_smallest_bench_pipeline_runs_and_its_figures_add_up(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model_dir = save_model_dir(
        *build_tiny(ModelConfig(hidden_size=HIDDEN, num_layers=2, num_heads=2, intermediate_size=64)),
        tmp_path / "model",
    )
    argv = ["--model", str(model_dir), "--batch-sizes", "1", "2", "--rtts-ms", "0", "30"]
    argv += ["--new-tokens", str(NEW_TOKENS), "--repeats", "1", "--min-seconds", "0", "--threads", "1"]
    argv += ["--gap-rollouts", "8", "--plot", str(tmp_path / "plot.png")]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    assert [c["batch"] for c in summary["full_model"]] == [1, 2]
    pipeline = {(c["server"], c["rtt_ms"], c["batch"]): c for c in summary["pipeline"]}
    assert len(pipeline) == 2 * 2 * 2  # both servers, both RTTs, both batch sizes
    for (_, rtt_ms, batch), cell in pipeline.items():
        assert cell["tokens"] == batch * NEW_TOKENS  # EOS is off: every sequence decodes them all
        # each of the NEW_TOKENS steps and the close is one request, each at least one added RTT
        assert cell["seconds"] >= (NEW_TOKENS + 1) * rtt_ms / 1000
    assert pipeline[("as shipped", 30, 1)]["connections_per_generation_per_hop"] == 0  # one kept connection
    for row in summary["reading"]:
        # at least one round trip per step per hop (kept connections: about 1.15 measured); the
        # slope of two noisy cells, so a margin below the bound the cells' times already assert
        assert row["added_rtts_per_token_per_hop"] >= 0.8

    codecs = {row["codec"]: row for row in summary["codecs"]}
    assert {name: row["bytes_per_token"] for name, row in codecs.items()} == {
        "float32": 4 * HIDDEN,
        "bfloat16": 2 * HIDDEN,
        "int8": HIDDEN + 4,
    }
    for row in codecs.values():  # the wire carries the hidden states plus headers
        assert row["wire_bytes_per_position_to_holder"] > row["bytes_per_token"]
        assert row["gap"]["rollouts"] == 8
    # float32 across the boundary: the pipeline computes what the whole model computes
    assert codecs["float32"]["gap"]["max"] < 1e-4
    assert codecs["int8"]["gap"]["mean"] > codecs["float32"]["gap"]["mean"]
    assert Path(summary["plot"]).stat().st_size > 10_000
