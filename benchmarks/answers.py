"""`decentrl bench answers RUN_DIR`: how much of a run's held-out gain is the format lesson.

The demo keeps every greedy held-out answer before and after RL (`answers-before.jsonl`,
`answers-after.jsonl` in the run directory; `decentrl eval --answers` writes the same records).
A gain can come from learning to answer in a form the reward reads (finishing within the token
budget, ending on the number) or from answering better. This harness separates the two:

- `finished`: the share of answers that ended on their own, and the accuracy among them;
- `same_problems_finished_before`: on the problems whose answer had already finished before RL,
  the accuracy before and after (a fixed set, so no selection by the format);
- for arithmetic (`What is a + b?` or `a+b=`), `stated`: replies that state the asked operation's
  result ("a + b = N") wherever they do it, cut off or not, and how often that N is right; and on
  the problems that state it both before and after, right before and right after.

Prints a table on stderr and one JSON object on the last line of stdout.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from decentrl.argparser import Parser
from decentrl.config import ConfigError

QUESTION = re.compile(r"(-?\d+)\s*([+\-*])\s*(\d+)\s*(?:=|\?)")


def read_answers(path: Path) -> list[dict]:
    if not path.is_file():
        raise ConfigError(
            f"{path} is missing: run `decentrl demo` (it writes it) or `decentrl eval --answers`"
        )
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def stated_result(answer: dict) -> bool | None:
    """Whether the reply states the asked operation's result correctly ("17 + 48 = 65"); None when
    the prompt is not arithmetic or the reply never states it."""
    asked = QUESTION.findall(answer["prompt"])
    if not asked:
        return None
    left, operator, right = asked[-1]
    pattern = rf"{re.escape(left)}\s*{re.escape(operator)}\s*{re.escape(right)}\s*=\s*(-?\d+)"
    stated = re.search(pattern, answer["reply"])
    return None if stated is None else stated.group(1) == answer["expected"]


def share(hits: float, total: int) -> float | None:
    return hits / total if total else None


def compare(before: list[dict], after: list[dict]) -> dict:
    """The figures of the module docstring, for answers to the same problems in the same order."""
    if [a["index"] for a in before] != [a["index"] for a in after]:
        raise ConfigError("the two answer files are not for the same problems in the same order")
    report: dict = {"num_problems": len(before)}
    for name, answers in (("before", before), ("after", after)):
        finished = [a for a in answers if a["finished"]]
        report[name] = {
            "accuracy": share(sum(a["reward"] for a in answers), len(answers)),
            "finished": share(len(finished), len(answers)),
            "accuracy_when_finished": share(sum(a["reward"] for a in finished), len(finished)),
        }
    kept = [i for i, a in enumerate(before) if a["finished"]]
    report["same_problems_finished_before"] = {
        "problems": len(kept),
        "accuracy_before": share(sum(before[i]["reward"] for i in kept), len(kept)),
        "accuracy_after": share(sum(after[i]["reward"] for i in kept), len(kept)),
    }
    stated = [(stated_result(b), stated_result(a)) for b, a in zip(before, after, strict=True)]
    if any(s is not None for pair in stated for s in pair):
        both = [(b, a) for b, a in stated if b is not None and a is not None]
        report["stated"] = {
            moment: {
                "replies": sum(pair[k] is not None for pair in stated),
                "right": share(
                    sum(bool(pair[k]) for pair in stated), sum(pair[k] is not None for pair in stated)
                ),
            }
            for k, moment in enumerate(("before", "after"))
        }
        report["stated"]["both"] = {
            "problems": len(both),
            "right_before": share(sum(b for b, _ in both), len(both)),
            "right_after": share(sum(a for _, a in both), len(both)),
        }
    return report


def main(argv: list[str]) -> int:
    parser = Parser(prog="decentrl bench answers", description=__doc__)
    parser.add_argument("run_dir", help="a demo run directory (answers-before.jsonl, answers-after.jsonl)")
    parser.add_argument("--before", help="another answers file for 'before' (default: the run's)")
    parser.add_argument("--after", help="another answers file for 'after' (default: the run's)")
    args = parser.parse_args(argv)
    run_dir = Path(args.run_dir)
    before = read_answers(Path(args.before) if args.before else run_dir / "answers-before.jsonl")
    after = read_answers(Path(args.after) if args.after else run_dir / "answers-after.jsonl")
    report = compare(before, after)
    for key, value in report.items():
        print(f"{key}: {value}", file=sys.stderr)
    print(json.dumps(report))
    return 0
