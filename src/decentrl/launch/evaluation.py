"""The demo's held-out evaluations: greedy accuracy of the warm start and of the last version.

The warm start's is measured aside (`EvaluationAside`): in a child forked with the roles, on one
thread at the lowest priority, so that it takes only the CPU the roles leave instead of delaying
the first versions.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import TracebackType

from decentrl.config import RunConfig
from decentrl.launch.fork import ForkedProcess, RoleFailed, can_fork, computing_with_torch, fork_call
from decentrl.launch.parent import ENV as PARENT_ENV

NICE = 19
"""How much lower than the roles the evaluation aside runs (nice levels). At the lowest priority
a busy core gives it about 1.5 % of its time (CFS weight 15 against a role's 1024), and a role
that wakes preempts it: the before-RL number is only shown once RL ends, and the roles' first
versions are what a run's start is measured by. At +10 (weight 110) on two threads it took
about a tenth of both cores while the colocated trainer made its first versions."""


def held_out_accuracy(
    config: RunConfig, model_dir: Path, state: dict | None = None, threads: int = 2
) -> dict:
    """Greedy accuracy on the held-out split, in this process, on the trainer's device and in its
    dtype (the demo's before/after numbers), on `threads` torch threads."""
    import torch

    from decentrl.engines.hf import HFEngine
    from decentrl.envs import environment_from_config
    from decentrl.envs.chat import ChatFormat
    from decentrl.eval.evaluate import evaluate
    from decentrl.model.precision import Precision
    from decentrl.model.special import read_eos_token_ids, read_max_context, read_pad_token_id
    from decentrl.model.vision import PixelInputs, load_policy

    computing_with_torch()  # its OpenMP pool would hang a role forked from this process later
    torch.set_num_threads(threads)
    precision = Precision.for_evaluation(config)
    model = load_policy(model_dir, precision.dtype)
    eos_ids = read_eos_token_ids(model_dir)
    chat = ChatFormat.from_model_dir(model_dir, eos_ids)
    pixels = PixelInputs.from_model_dir(model_dir)
    engine = HFEngine(
        model, eos_ids, read_pad_token_id(model_dir), device=str(precision.device), pixels=pixels
    )
    if state is not None:
        engine.load_weights(state, version=0)
    env = environment_from_config(config.task)
    max_new_tokens = config.coordinator.max_new_tokens
    result = evaluate(
        engine, env, chat, config.task.eval_size, max_new_tokens, max_context=read_max_context(model_dir)
    )
    return {
        "accuracy": result.accuracy,
        "num_problems": result.num_problems,
        "examples": result.examples,
        "finished": result.finished_share,
        "accuracy_when_finished": result.accuracy_when_finished,
        "answers": result.answers,
    }


class EvaluationAside:
    """The warm start's held-out accuracy, computed in a child process from `start()` on;
    `result()` waits for it. Without fork (threads already running, no os.fork), `result()`
    computes it in this process."""

    def __init__(self, config: RunConfig, model_dir: Path, log_dir: Path):
        self.config = config
        self.model_dir = model_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / "eval-before.log"
        self.result_path = log_dir / "eval-before.json"
        self.process: ForkedProcess | None = None

    def start(self) -> None:
        if not can_fork():
            return

        def run() -> int:
            from decentrl.launch.parent import watch_parent

            watch_parent()  # a launcher killed outright leaves no evaluation running
            result = held_out_accuracy(self.config, self.model_dir, threads=1)  # one core at most
            self.result_path.write_text(json.dumps(result))
            return 0

        with open(self.log_path, "ab") as log:
            environment = {"OMP_NUM_THREADS": "1", PARENT_ENV: str(os.getpid())}
            self.process = fork_call("eval-before", run, log.fileno(), environment, nice=NICE)

    def result(self) -> dict:
        if self.process is None:
            return held_out_accuracy(self.config, self.model_dir)
        status = self.process.wait()
        if status != 0:
            raise RoleFailed(f"the held-out evaluation before RL failed (exit {status}); see {self.log_path}")
        return json.loads(self.result_path.read_text())

    def __enter__(self) -> EvaluationAside:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, trace: TracebackType | None
    ) -> None:
        if self.process is not None and self.process.poll() is None:  # the demo stopped early
            self.process.kill()
            self.process.wait()
