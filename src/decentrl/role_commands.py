"""The subcommands that start roles: the demo and `launch` (every role at once), the coordinator,
trainer, worker, trusted verifier, scorer and env server, and `serve`. Each is a function that adds
its arguments and one that runs it; `commands.COMMANDS` names them. A role's modules are imported
by the function that runs it, so the command line starts without them."""

from __future__ import annotations

from pathlib import Path

from decentrl.argparser import Args, Parser
from decentrl.config import RunConfig
from decentrl.model.resolve import join_run, resolve_model_dir


def add_connection(parser: Parser, token_help: str = "the trainer token (coordinator's tokens.json)") -> None:
    parser.add_argument("--coordinator", required=True, metavar="URL")
    parser.add_argument("--token", required=True, help=token_help)


def demo_arguments(parser: Parser) -> None:
    parser.add_argument("--run-dir", help="where to write the run (default runs/<timestamp>/)")
    parser.add_argument("--seed", type=int, help="seed of the task stream, sampling and model init")
    parser.add_argument(
        "--colocate",
        action="store_true",
        help="the trainer samples its own groups (trainer.local_groups = groups_per_step, "
        "coordinator.max_pending_groups raised to the room that needs) and no worker is started "
        "unless --set demo.num_workers=N (docs/trainer.md)",
    )


def run_demo(args: Args, config: RunConfig, argv: list[str]) -> int:
    from decentrl.launch.local import colocated, run_demo

    if args.colocate:
        workers_set = any(item.startswith("demo.num_workers=") for item in args.overrides)
        config = colocated(config, None if workers_set else 0)
    return run_demo(config, args.run_dir)


def launch_arguments(parser: Parser) -> None:
    parser.add_argument("backend", choices=["ray"], help="ray: each role a Ray actor ([ray] config)")
    parser.add_argument("--run-dir", help="the coordinator's run directory (default runs/<timestamp>/)")


def run_launch(args: Args, config: RunConfig, argv: list[str]) -> int:
    from decentrl.launch.local import default_run_dir
    from decentrl.launch.ray import launch_ray

    run_dir = Path(args.run_dir) if args.run_dir else default_run_dir()
    return launch_ray(config, run_dir, resolve_model_dir(config, None))


def coordinator_arguments(parser: Parser) -> None:
    parser.add_argument("--run-dir", required=True, help="durable state of the run")
    parser.add_argument("--model-dir", help="HF model directory (default: model.path or the warm start)")
    parser.add_argument("--port", type=int, help="TCP port (0 = any free one)")


def run_coordinator(args: Args, config: RunConfig, argv: list[str]) -> int:
    from decentrl.coordinator.server import serve
    from decentrl.writable_dir import writable_dir

    run_dir = writable_dir(Path(args.run_dir))  # before the model: its files are checked next
    serve(config, run_dir, resolve_model_dir(config, args.model_dir))
    return 0


def trainer_arguments(parser: Parser) -> None:
    add_connection(parser)
    parser.add_argument("--run-dir", required=True, help="where checkpoints go")
    parser.add_argument("--model-dir", help="initial weights (default: model.path or the warm start)")
    parser.add_argument(
        "--nproc", type=int, help="ranks on this machine under torchrun + FSDP2 (= --set trainer.nproc=N)"
    )


def run_trainer(args: Args, config: RunConfig, argv: list[str]) -> int:
    """One process, a rank under torchrun, or (trainer.nproc > 1, or trainer.pipeline_stages > 1:
    one rank per stage) torchrun started here."""
    from decentrl.launch.torchrun import run_torchrun, under_torchrun
    from decentrl.monitor.reporting import log_to_file
    from decentrl.trainer.loop import main_trainer

    # The coordinator's model and task (from /v1/info), or a one-line refusal.
    config, model_dir = join_run(config, args.coordinator, args.token, "trainer", args.model_dir)
    if under_torchrun():
        return main_trainer(config, model_dir, Path(args.run_dir), torchrun=True)
    ranks = max(config.trainer.nproc, config.trainer.pipeline_stages)
    if ranks > 1:
        # The model is resolved (warm-started) once here, not by every rank at once.
        return run_torchrun(ranks, config.trainer.max_restarts, [*argv, f"--model-dir={model_dir}"])
    log_to_file(Path(args.run_dir) / "trainer.log")
    return main_trainer(config, model_dir, Path(args.run_dir))


def worker_arguments(parser: Parser) -> None:
    parser.add_argument("--coordinator", required=True, metavar="URL")
    parser.add_argument("--token", help="enrollment token (not needed when --state-dir holds credentials)")
    parser.add_argument("--name", help="worker name shown in the coordinator's logs")
    parser.add_argument("--state-dir", help="keeps credentials and model files across restarts")
    parser.add_argument(
        "--stage", type=int, help="a staged run: hold only this pipeline stage (docs/pipeline.md)"
    )


def run_worker(args: Args, config: RunConfig, argv: list[str]) -> int:
    from decentrl.monitor.reporting import log_to_file
    from decentrl.worker import main_worker
    from decentrl.writable_dir import writable_dir

    if config.worker.state_dir:
        state_dir = writable_dir(Path(config.worker.state_dir), "--state-dir", "state directory")
        log_to_file(state_dir / "worker.log")
    return main_worker(config.worker)


def verifier_arguments(parser: Parser) -> None:
    add_connection(parser)
    parser.add_argument("--model-dir", help="model config (default: model.path or the warm start)")


def run_verifier(args: Args, config: RunConfig, argv: list[str]) -> int:
    from decentrl.model.precision import Precision
    from decentrl.verifier.main import main_verifier

    # It checks the coordinator's model on its task: those come from /v1/info; it computes on
    # the trainer's device and in its dtype.
    config, model_dir = join_run(config, args.coordinator, args.token, "verifier", args.model_dir)
    return main_verifier(args.coordinator, args.token, model_dir, Precision.from_config(config.trainer))


def scorer_arguments(parser: Parser) -> None:
    add_connection(parser)
    parser.add_argument(
        "--reward-model", required=True, help="directory of a *ForSequenceClassification model"
    )
    parser.add_argument("--device", default="auto", help="auto (cuda when present), cpu, cuda, ...")
    parser.add_argument("--term", help="score only this reward_model term of the rubric (default: any)")


def run_scorer(args: Args, config: RunConfig, argv: list[str]) -> int:
    from decentrl.scorer.main import main_scorer

    return main_scorer(args.coordinator, args.token, Path(args.reward_model), args.term, args.device)


def envd_arguments(parser: Parser) -> None:
    add_connection(parser)
    parser.add_argument("--name", help="the server's id in the run (= --set envd.name=NAME)")
    parser.add_argument("--port", type=int, help="TCP port (0 = any free one)")
    parser.add_argument("--state-dir", help="keeps the server's signing key across restarts")


def run_envd(args: Args, config: RunConfig, argv: list[str]) -> int:
    from decentrl.envd.main import main_envd

    return main_envd(args.coordinator, args.token, config.envd)


def serve_arguments(parser: Parser) -> None:
    parser.add_argument("--model-dir", help="HF model directory (default: model.path or the warm start)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="TCP port (0 = any free one)")
    parser.add_argument("--name", help="model name in responses (default: the directory's name)")
    parser.add_argument(
        "--token",
        help="bearer token (API key) every request must send (default: $DECENTRL_SERVE_TOKEN, "
        "else one generated and printed)",
    )


def run_serve(args: Args, config: RunConfig, argv: list[str]) -> int:
    from decentrl.engines.openai_server import main_serve

    model_dir = resolve_model_dir(config, args.model_dir)
    return main_serve(model_dir, args.host, args.port, args.name, token=args.token)
