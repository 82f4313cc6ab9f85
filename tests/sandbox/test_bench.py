"""`decentrl bench sandbox`: one JSON object on the last stdout line, with its documented keys."""

from __future__ import annotations

import json

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
