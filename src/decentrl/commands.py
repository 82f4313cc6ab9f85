"""The subcommands of `decentrl`: `COMMANDS`, a table whose entries name each command's help, its
arguments, the config fields its flags set (as values, merged over `--set`), the config file it
starts from and the function that runs it. `cli.py` builds the parser from it and dispatches.

The commands themselves are in `role_commands.py` (those that start roles: the demo, `launch`, each
role, `serve`) and `tool_commands.py` (the tools around a run and its models).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from decentrl.argparser import Args, Parser
from decentrl.config import DEMO_CONFIG, RunConfig
from decentrl.role_commands import (
    coordinator_arguments,
    demo_arguments,
    envd_arguments,
    launch_arguments,
    run_coordinator,
    run_demo,
    run_envd,
    run_launch,
    run_scorer,
    run_serve,
    run_trainer,
    run_verifier,
    run_worker,
    scorer_arguments,
    serve_arguments,
    trainer_arguments,
    verifier_arguments,
    worker_arguments,
)
from decentrl.tool_commands import (
    add_config_arguments,
    bench_arguments,
    config_arguments,
    eval_arguments,
    export_arguments,
    model_arguments,
    replay_arguments,
    run_bench,
    run_config,
    run_eval,
    run_export,
    run_model,
    run_replay,
    run_train_judge,
    run_train_rm,
    run_verify_release,
    run_warmstart,
    the_run_config,
    the_runs_config,
    train_judge_arguments,
    train_rm_arguments,
    verify_release_arguments,
)

__all__ = ["COMMANDS", "Command", "add_config_arguments"]  # what cli.py builds its parser from


@dataclass(frozen=True)
class Command:
    help: str
    arguments: Callable[[Parser], None]
    run: Callable[[Args, RunConfig, list[str]], int]
    """Runs the command on the resolved config (defaults < file < `--set` < `fields`)."""
    fields: Callable[[Args], dict[str, object]] = lambda args: {}
    """Config fields the command's own flags set, as values (`trainer.nproc` for `--nproc`)."""
    default_config: Callable[[Args], Path | None] = lambda args: None
    """The config file used without `--config` (None: the built-in defaults)."""
    takes_config: bool = True
    """False: no `--config`/`--set`, and `run` gets the defaults."""


def given(**fields: object) -> dict[str, object]:
    """The fields whose flag was given."""
    return {key: value for key, value in fields.items() if value is not None}


COMMANDS: dict[str, Command] = {
    "demo": Command(
        "warm start, then coordinator + trainer + workers on loopback",
        demo_arguments,
        run_demo,
        fields=lambda args: given(seed=args.seed, **{"model.seed": args.seed}),
        default_config=lambda args: DEMO_CONFIG,  # only the demo starts from the demo's settings
    ),
    "launch": Command(
        "start every role on a cluster manager: `launch ray` (docs/scaling.md)", launch_arguments, run_launch
    ),
    "coordinator": Command(
        "run the coordinator (the only server)",
        coordinator_arguments,
        run_coordinator,
        fields=lambda args: given(**{"coordinator.port": args.port}),
    ),
    "trainer": Command(
        "run the trainer",
        trainer_arguments,
        run_trainer,
        fields=lambda args: given(
            **{
                "trainer.coordinator_url": args.coordinator,
                "trainer.token": args.token,
                "trainer.nproc": args.nproc,
            }
        ),
    ),
    "worker": Command(
        "run a rollout worker",
        worker_arguments,
        run_worker,
        fields=lambda args: given(
            **{
                "worker.coordinator_url": args.coordinator,
                "worker.token": args.token or None,
                "worker.name": args.name or None,
                "worker.state_dir": args.state_dir or None,
                "worker.stage": args.stage,
            }
        ),
    ),
    "verifier": Command(
        "run a trusted verifier: recompute sampled rollouts' log-probs (docs/security.md)",
        verifier_arguments,
        run_verifier,
    ),
    "scorer": Command(
        "run a trusted reward scorer: a reward model scores rollouts in batches (docs/rewards.md)",
        scorer_arguments,
        run_scorer,
    ),
    "envd": Command(
        "run a trusted env server: live episodes of a served task, every turn signed (docs/environments.md)",
        envd_arguments,
        run_envd,
        fields=lambda args: given(
            **{"envd.name": args.name, "envd.port": args.port, "envd.state_dir": args.state_dir}
        ),
    ),
    "train-rm": Command(
        "train a reward model (Bradley-Terry) on preference pairs generated for the task",
        train_rm_arguments,
        run_train_rm,
    ),
    "train-judge": Command(
        "train a small LLM judge for the task (VERDICT: CORRECT/INCORRECT), to serve with `decentrl serve`",
        train_judge_arguments,
        run_train_judge,
    ),
    "serve": Command(
        "serve a model over an OpenAI-compatible API (completions, chat; token ids + logprobs)",
        serve_arguments,
        run_serve,
    ),
    "warmstart": Command(
        "build (or find in the cache) the warm-started tiny model", lambda parser: None, run_warmstart
    ),
    "config": Command(
        "print a resolved config (`decentrl config show`)",
        config_arguments,
        run_config,
        default_config=lambda args: DEMO_CONFIG if args.demo else None,
        takes_config=False,  # `config show` takes them
    ),
    "eval": Command(
        "held-out pass@1 (greedy), pass@k and avg@k of a model, a run's version or an endpoint",
        eval_arguments,
        run_eval,
        fields=lambda args: given(**{"eval.num_samples": args.samples}),
        default_config=the_run_config,
    ),
    "export": Command(
        "write a run's version as a Hugging Face model directory with a model card",
        export_arguments,
        run_export,
        default_config=the_run_config,
    ),
    "model": Command(
        "prepare a model directory (`decentrl model import-gguf`)",
        model_arguments,
        run_model,
        takes_config=False,
    ),
    "replay": Command(
        "re-run a served episode of a run on a fresh environment instance: does it reproduce?",
        replay_arguments,
        run_replay,
        default_config=the_runs_config,
    ),
    "verify-release": Command(
        "check an exported model's weights against the run's signed chain",
        verify_release_arguments,
        run_verify_release,
        takes_config=False,
    ),
    "bench": Command(
        "run a benchmark; its last stdout line is one JSON object",
        bench_arguments,
        run_bench,
        takes_config=False,
    ),
}
