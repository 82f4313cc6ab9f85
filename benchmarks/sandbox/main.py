"""`decentrl bench sandbox`: sandbox throughput, attack containment and the tool-use run.

- executions_per_s: hidden-test scorings (`score_solution`, one sandboxed Python process each) of
  short correct solutions per second, with one thread per CPU core; also measured sequentially.
  Every execution must pass, or the number would count broken runs.
- attacks_total / attacks_contained: the attack suite of `benchmarks.sandbox.attacks` (the same code
  tests/sandbox/ runs).
- eval_before / eval_after: held-out success of the tool-use run, read from the `summary.json` of
  `decentrl demo --config configs/tool_use.toml` (run here, or read with --tool-use-run-dir); null
  with a reason when skipped (--skip-tool-use) or unavailable, and then, unless skipped on request,
  the bench exits 1: a figure it reports is missing.

Progress goes to stderr; the last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.sandbox.attacks import ATTACKS, attack_config, run_attack
from decentrl.argparser import Parser
from decentrl.config import SandboxConfig
from decentrl.envs.coding.hidden_tests import score_solution

# benchmarks/sandbox/main.py -> the checkout's root, where configs/ sits beside benchmarks/
TOOL_USE_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tool_use.toml"

# Short programs of the kind a code task scores: a solution plus a handful of hidden asserts.
PROGRAMS = [
    (
        "def add(a, b):\n    return a + b\n",
        "assert add(2, 3) == 5\nassert add(-1, 1) == 0\nassert add(10, 5) == 15\n",
    ),
    (
        "def reverse(s):\n    return s[::-1]\n",
        "assert reverse('abc') == 'cba'\nassert reverse('') == ''\nassert reverse('ab') == 'ba'\n",
    ),
    (
        "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
        "assert fib(0) == 0\nassert fib(10) == 55\nassert fib(30) == 832040\n",
    ),
    (
        "def is_prime(n):\n    return n > 1 and all(n % d for d in range(2, int(n ** 0.5) + 1))\n",
        "assert is_prime(2)\nassert not is_prime(91)\nassert is_prime(7919)\nassert not is_prime(1)\n",
    ),
]


def log(message: str) -> None:
    print(f"[bench sandbox] {message}", file=sys.stderr, flush=True)


def executions_per_s(seconds: float, threads: int, config: SandboxConfig) -> tuple[float, int, int]:
    """(scorings per second, how many ran, how many passed) over about `seconds` of wall clock."""
    deadline = time.monotonic() + seconds
    counts = [0, 0]
    lock = threading.Lock()

    def loop(offset: int) -> None:
        index = offset
        while time.monotonic() < deadline:
            solution, tests = PROGRAMS[index % len(PROGRAMS)]
            passed = score_solution(solution, tests, config).passed
            with lock:
                counts[0] += 1
                counts[1] += passed
            index += 1

    start = time.monotonic()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(loop, range(threads)))
    return counts[0] / (time.monotonic() - start), counts[0], counts[1]


def attacks(config: SandboxConfig) -> dict:
    outcomes = []
    for attack in ATTACKS:
        outcome = run_attack(attack, config)
        log(
            f"attack {attack.name}: {'contained' if outcome.contained else 'ESCAPED ' + str(outcome.failures)}"
        )
        outcomes.append(outcome)
    return {
        "attacks_total": len(outcomes),
        "attacks_contained": sum(outcome.contained for outcome in outcomes),
        "attacks_escaped": [outcome.name for outcome in outcomes if not outcome.contained],
    }


def tool_use(args: argparse.Namespace) -> dict:
    if args.skip_tool_use:
        return {"eval_before": None, "eval_after": None, "tool_use_note": "skipped (--skip-tool-use)"}
    run_dir = Path(args.tool_use_run_dir) if args.tool_use_run_dir else None
    if run_dir is None:
        if not TOOL_USE_CONFIG.is_file():
            note = f"{TOOL_USE_CONFIG} does not exist"
            return {"eval_before": None, "eval_after": None, "tool_use_note": note}
        run_dir = Path(tempfile.mkdtemp(prefix="decentrl-tool-use-"))
        command = [sys.executable, "-m", "decentrl", "demo", "--config", str(TOOL_USE_CONFIG)]
        command += ["--run-dir", str(run_dir)]
        command += [argument for override in args.tool_use_set for argument in ("--set", override)]
        log(f"tool-use run: {' '.join(command)}")
        try:
            subprocess.run(command, check=True, timeout=args.tool_use_timeout, stdout=sys.stderr)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
            return {"eval_before": None, "eval_after": None, "tool_use_note": f"tool-use run failed: {exc}"}
    summary_path = run_dir / "summary.json"
    if not summary_path.is_file():
        return {"eval_before": None, "eval_after": None, "tool_use_note": f"no summary.json in {run_dir}"}
    summary = json.loads(summary_path.read_text())
    return {
        "eval_before": summary.get("eval_before"),
        "eval_after": summary.get("eval_after"),
        "tool_use_run_dir": str(run_dir),
    }


def main(argv: list[str]) -> int:
    parser = Parser(prog="decentrl bench sandbox", description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument(
        "--seconds", type=float, default=10.0, help="wall clock of each throughput measurement"
    )
    parser.add_argument(
        "--threads", type=int, default=os.cpu_count() or 1, help="parallel executions (default: cores)"
    )
    parser.add_argument("--skip-attacks", action="store_true", help="do not run the attack suite")
    parser.add_argument("--skip-tool-use", action="store_true", help="do not run (or read) the tool-use run")
    parser.add_argument("--tool-use-run-dir", help="read summary.json of an existing tool-use run instead")
    parser.add_argument(
        "--tool-use-timeout", type=float, default=3600.0, help="seconds before the run is abandoned"
    )
    parser.add_argument(
        "--tool-use-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a --set override of the tool-use run, e.g. trainer.num_steps=2 (repeatable)",
    )
    args = parser.parse_args(argv)

    config = SandboxConfig()
    load_before = os.getloadavg()[0]
    log(f"throughput: {args.seconds:.0f} s sequential, then {args.seconds:.0f} s on {args.threads} threads")
    sequential, sequential_ran, sequential_passed = executions_per_s(args.seconds, 1, config)
    parallel, ran, passed = executions_per_s(args.seconds, args.threads, config)
    log(f"{sequential:.1f}/s sequential, {parallel:.1f}/s on {args.threads} threads ({passed}/{ran} passed)")
    result = {
        "executions_per_s": round(parallel, 1),
        "executions_per_s_sequential": round(sequential, 1),
        "execution_threads": args.threads,
        "executions_all_passed": passed == ran and sequential_passed == sequential_ran,
        "load_average_1m_before": round(load_before, 2),
        "cpu_cores": os.cpu_count(),
    }
    if not args.skip_attacks:
        result |= attacks(attack_config(config))
    result |= tool_use(args)
    print(json.dumps(result))
    if result["eval_before"] is None and not args.skip_tool_use:
        print(
            f"decentrl: error: bench sandbox: no tool-use figures: {result['tool_use_note']}", file=sys.stderr
        )
        return 1
    return 0
