"""`decentrl bench sandbox`: one JSON object on the last stdout line, with its documented keys."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.sandbox import main as sandbox


def test_bench_reports_throughput_and_reads_a_tool_use_run(tmp_path, capsys) -> None:
    (tmp_path / "summary.json").write_text(json.dumps({"eval_before": 0.25, "eval_after": 0.5}))
    argv = ["--seconds", "0.5", "--skip-attacks", "--tool-use-run-dir", str(tmp_path)]
    assert sandbox.main(argv) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["executions_per_s"] > 0 and result["executions_all_passed"] is True
    assert (result["eval_before"], result["eval_after"]) == (0.25, 0.5)


def test_bench_says_why_the_tool_use_numbers_are_missing(capsys) -> None:
    assert sandbox.main(["--seconds", "0.2", "--skip-attacks", "--skip-tool-use"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["eval_before"] is None and "skipped" in result["tool_use_note"]


def test_the_tool_use_run_is_the_checkout_config() -> None:
    assert Path(__file__).resolve().parents[2] / "configs" / "tool_use.toml" == sandbox.TOOL_USE_CONFIG
    assert sandbox.TOOL_USE_CONFIG.is_file()


def test_missing_tool_use_figures_fail_the_bench(tmp_path, capsys) -> None:
    """A part the bench reports but could not measure is an error, not a silent null."""
    assert sandbox.main(["--seconds", "0.2", "--skip-attacks", "--tool-use-run-dir", str(tmp_path)]) == 1
    captured = capsys.readouterr()
    assert json.loads(captured.out.strip().splitlines()[-1])["eval_before"] is None
    assert captured.err.strip().splitlines()[-1] == (
        f"decentrl: error: bench sandbox: no tool-use figures: no summary.json in {tmp_path}"
    )
