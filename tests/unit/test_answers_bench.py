"""`decentrl bench answers`: the format lesson told apart from better answers, on hand-made records
whose figures are computed by hand below."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchmarks.answers import compare, stated_result


def answer(index: int, question: str, expected: str, reply: str, reward: float, finished: bool) -> dict:
    return {
        "index": index,
        "prompt": f"<|im_start|>user\n{question}<|im_end|>",
        "expected": expected,
        "reply": reply,
        "reward": reward,
        "finished": finished,
    }


BEFORE = [
    answer(0, "What is 1 + 8?", "9", "1 + 8 = 9", 1.0, True),
    answer(1, "What is 22 + 6?", "28", "To add 22 and 6: 22 + 6 = 9 and so", 0.0, False),
    answer(2, "What is 13 + 2?", "15", "13 + 2 = 3", 0.0, True),
    answer(3, "What is 9 + 3?", "12", "To add nine and three we", 0.0, False),
]
AFTER = [
    answer(0, "What is 1 + 8?", "9", "1 + 8 = 9", 1.0, True),
    answer(1, "What is 22 + 6?", "28", "22 + 6 = 28", 1.0, True),
    answer(2, "What is 13 + 2?", "15", "13 + 2 = 16", 0.0, True),
    answer(3, "What is 9 + 3?", "12", "9 + 3 = 12", 1.0, True),
]


def test_stated_result_reads_the_asked_operation_wherever_the_reply_states_it():
    assert stated_result(BEFORE[1]) is False  # "22 + 6 = 9", cut off or not
    assert stated_result(AFTER[1]) is True
    assert stated_result(BEFORE[3]) is None  # never states it
    raw = {"prompt": "12+34=", "expected": "46", "reply": "12+34=46"}
    assert stated_result(raw) is True
    assert stated_result({"prompt": "Name a colour.", "expected": "red", "reply": "red"}) is None


def test_compare_separates_finishing_from_answering_better():
    report = compare(BEFORE, AFTER)
    assert report["before"] == {"accuracy": 0.25, "finished": 0.5, "accuracy_when_finished": 0.5}
    assert report["after"] == {"accuracy": 0.75, "finished": 1.0, "accuracy_when_finished": 0.75}
    # Problems 0 and 2 had finished before: 1 of 2 right before, still 1 of 2 after.
    assert report["same_problems_finished_before"] == {
        "problems": 2,
        "accuracy_before": 0.5,
        "accuracy_after": 0.5,
    }
    # Stated before: problems 0, 1, 2 (1 right); after: all 4 (3 right); both: 0, 1, 2 (1 -> 2 right).
    assert report["stated"]["before"] == {"replies": 3, "right": pytest.approx(1 / 3)}
    assert report["stated"]["after"] == {"replies": 4, "right": 0.75}
    assert report["stated"]["both"] == {
        "problems": 3,
        "right_before": pytest.approx(1 / 3),
        "right_after": pytest.approx(2 / 3),
    }


def test_the_command_reads_a_run_directory_and_refuses_a_missing_file(tmp_path):
    for name, answers in (("before", BEFORE), ("after", AFTER)):
        (tmp_path / f"answers-{name}.jsonl").write_text("".join(json.dumps(a) + "\n" for a in answers))
    done = subprocess.run(
        [sys.executable, "-m", "decentrl", "bench", "answers", str(tmp_path)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == json.loads(json.dumps(compare(BEFORE, AFTER)))
    missing = subprocess.run(
        [sys.executable, "-m", "decentrl", "bench", "answers", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
    )
    assert missing.returncode == 2 and "answers-before.jsonl is missing" in missing.stderr
    assert "Traceback" not in missing.stderr
