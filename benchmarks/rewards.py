"""`decentrl bench rewards --kind math|rm|judge`: one RL run rewarded by each kind of reward.

Each is the demo's whole system (coordinator, trainer, workers on loopback, `launch/local.py`)
with only the reward changed, and each reports the task's held-out greedy accuracy before and
after RL, measured by the task's own verifiable checker, never by the reward that trained it:

- `math`: `configs/math.toml`, solving linear equations, scored by math-verify in the
  coordinator's scoring pool (`envs/mathematics/grading.py`).
- `rm`: the demo's task (sums, exact answers only) rewarded by a reward model alone: a
  `*ForSequenceClassification` model trained here by Bradley–Terry on generated preferences
  (`rewards/train_rm.py`), served by a `decentrl scorer` process.
- `judge`: the same task rewarded by an LLM judge alone: a judge model trained here
  (`rewards/train_judge.py`), served over the OpenAI API by a `decentrl serve` process on
  loopback and called by the judge reward (`rewards/judge.py`) from the scoring pool.

The reward model and the judge are cached next to the warm start (same cache directory, keyed by
the warm start and their training settings), so a second run starts RL at once. Writes
`bench.json` in the run directory and prints it as the last stdout line.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from contextlib import ExitStack
from enum import StrEnum
from pathlib import Path

from benchmarks import ROOT
from decentrl.argparser import Parser
from decentrl.config import DEMO_CONFIG, ConfigError, ModelConfig, RunConfig, load_config
from decentrl.config.rewards import RewardName, RewardTerm
from decentrl.launch.parent import ENV as PARENT_ENV

log = logging.getLogger(__name__)
SERVE_TIMEOUT_S = 300.0
# The judge reads ~90-token prompts (question, reference, candidate), so it is kept smaller than the
# policy: on 2 CPU cores it trains in minutes and answers a call in a few milliseconds.
JUDGE_MODEL = ModelConfig(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128)


class Kind(StrEnum):
    MATH = "math"
    RM = "rm"
    JUDGE = "judge"


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = Parser(prog="decentrl bench rewards", description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--kind", required=True, choices=[k.value for k in Kind])
    parser.add_argument(
        "--config", help="run config (default: configs/math.toml for math, the demo's for rm and judge)"
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one config field (repeatable)",
    )
    parser.add_argument("--num-steps", type=int, default=60, help="policy versions of RL (default 60)")
    parser.add_argument("--rm-steps", type=int, default=300, help="Bradley–Terry steps of the reward model")
    parser.add_argument("--judge-steps", type=int, default=400, help="fine-tuning steps of the judge")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of this process (default 1)")
    parser.add_argument("--run-dir", help="the run directory (default runs/bench-rewards-KIND)")
    return parser.parse_args(argv)


def run_config(args: argparse.Namespace) -> RunConfig:
    path = args.config
    if path is None:
        path = ROOT / "configs" / "math.toml" if args.kind == Kind.MATH else DEMO_CONFIG
        if not Path(path).is_file():
            raise ConfigError(f"{path} is missing: pass --config (a math run config, see docs/rewards.md)")
    config = load_config(path, [*args.overrides, f"trainer.num_steps={args.num_steps}"])
    config.demo.live = False
    config.demo.export = False
    return config


def artefact_dir(config: RunConfig, kind: str, settings: dict) -> Path:
    """A cache directory beside the warm start, keyed by it and by the artefact's own settings."""
    from decentrl.model.warmstart_cache import cache_root, warmstart_key

    key = warmstart_key(config.model, config.task, config.sft)
    digest = hashlib.sha256(json.dumps({"warmstart": key, **settings}, sort_keys=True).encode()).hexdigest()
    return cache_root(config.sft) / f"{kind}-{digest[:16]}"


def reward_model(config: RunConfig, model_dir: Path, steps: int) -> tuple[Path, dict]:
    """The task's reward model, trained from the warm start's body (or found in the cache)."""
    from decentrl.envs import environment_from_config
    from decentrl.rewards.train_rm import train_reward_model

    out = artefact_dir(
        config, "rm", {"steps": steps, "batch_size": 32, "lr": 1e-4, "pairs": 4096, "negatives": "near+other"}
    )
    report_path = out / "train_rm.json"
    if not report_path.is_file():
        started = time.monotonic()
        report = train_reward_model(environment_from_config(config.task), model_dir, out, steps=steps)
        report["train_seconds"] = time.monotonic() - started
        report_path.write_text(json.dumps(report, indent=2))
    return out, json.loads(report_path.read_text())


def judge_model(config: RunConfig, steps: int) -> tuple[Path, dict]:
    """The task's judge model, trained here (or found in the cache)."""
    from decentrl.envs import environment_from_config
    from decentrl.rewards.train_judge import train_judge

    # The prompt's candidate encoding and the decoys are part of what the judge learnt.
    settings = {
        "steps": steps,
        "batch_size": 32,
        "lr": 3e-3,
        "model": JUDGE_MODEL.model_dump(),
        "decoys": 0.25,
        "candidate": "json-escaped",
    }
    out = artefact_dir(config, "judge", settings)
    report_path = out / "train_judge.json"
    if not report_path.is_file():
        started = time.monotonic()
        report = train_judge(environment_from_config(config.task), JUDGE_MODEL, out, steps=steps)
        report["train_seconds"] = time.monotonic() - started
        report_path.write_text(json.dumps(report, indent=2))
    return out, json.loads(report_path.read_text())


def serve(model_dir: Path, log_path: Path, stack: ExitStack) -> str:
    """`decentrl serve` of `model_dir` on a free loopback port; its /v1 URL once it accepts calls.
    Its token goes to the roles (they inherit this environment) as the judge's API key."""
    log_file = stack.enter_context(open(log_path, "w"))  # noqa: SIM115 - closed by the stack
    token = os.environ.setdefault("DECENTRL_JUDGE_API_KEY", secrets.token_urlsafe(24))
    process = subprocess.Popen(
        [sys.executable, "-m", "decentrl", "serve", "--model-dir", str(model_dir), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=log_file,
        text=True,
        env={
            **os.environ,
            "OMP_NUM_THREADS": "1",
            PARENT_ENV: str(os.getpid()),  # ends with us
            "DECENTRL_SERVE_TOKEN": token,
        },
    )

    def stop() -> None:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    stack.callback(stop)
    deadline = time.monotonic() + SERVE_TIMEOUT_S
    assert process.stdout is not None
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line and process.poll() is not None:
            raise RuntimeError(f"decentrl serve exited before serving; see {log_path}")
        if match := re.search(r"serving \S+ at (\S+)", line):
            return match[1]
    raise RuntimeError(f"decentrl serve did not start within {SERVE_TIMEOUT_S:.0f} s; see {log_path}")


def main(argv: list[str]) -> int:
    import torch

    from decentrl.launch.local import run_demo
    from decentrl.model.resolve import resolve_model_dir

    args = parse_args(argv)
    kind = Kind(args.kind)
    # The warm start, the reward model and the judge train in this process; the roles run with one
    # thread each. Two intra-op threads on a loaded 2-core machine ran SFT ten times slower.
    torch.set_num_threads(args.threads)
    # SIGTERM unwinds like Ctrl-C, so the judge server and the roles are stopped on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    config = run_config(args)
    run_dir = Path(args.run_dir or f"runs/bench-rewards-{kind}")
    run_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    model_dir = resolve_model_dir(config, None)  # the warm start: cached after the first run
    result: dict = {"kind": kind.value, "num_steps": args.num_steps, "warmstart": str(model_dir)}
    with ExitStack() as stack:
        if kind == Kind.RM:
            path, report = reward_model(config, model_dir, args.rm_steps)
            result["reward_model"] = {"path": str(path), **report}
            config.reward.terms = [RewardTerm(function=RewardName.REWARD_MODEL, args={"path": str(path)})]
        elif kind == Kind.JUDGE:
            path, report = judge_model(config, args.judge_steps)
            result["judge"] = {"path": str(path), **report}
            url = serve(path, run_dir / "serve.log", stack)
            # The trained judge completes `... VERDICT:`; a chat model would use prompt = "chat".
            args_ = {"base_url": url, "model": path.name, "prompt": "completion", "max_tokens": 12}
            config.reward.terms = [RewardTerm(function=RewardName.JUDGE, args=args_)]
        elif not any(t.function in (RewardName.MATH_VERIFY, RewardName.ENV) for t in config.reward.terms):
            raise ConfigError("--kind math needs a config whose reward uses math_verify (configs/math.toml)")
        result["setup_seconds"] = time.monotonic() - started
        code = run_demo(config, str(run_dir))
    if code != 0:
        return code
    summary = json.loads((run_dir / "summary.json").read_text())
    result |= {
        "task": config.task.env,
        "terms": [t.model_dump(mode="json") for t in config.reward.terms],
        "eval_before": summary["eval_before"],
        "eval_after": summary["eval_after"],
        "eval_num_problems": summary["eval_num_problems"],
        "num_rollouts_accepted": summary["num_rollouts_accepted"],
        "rl_wall_seconds": summary["rl_wall_seconds"],
        "reward_alarms": _alarms(run_dir),
        "run_dir": str(run_dir),
    }
    (run_dir / "bench.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result))
    return 0


def _alarms(run_dir: Path) -> dict[str, int]:
    import sqlite3

    with sqlite3.connect(run_dir / "coordinator.db") as db:
        rows = db.execute("SELECT alarm, COUNT(*) FROM reward_alarms GROUP BY alarm").fetchall()
    return dict(rows)
