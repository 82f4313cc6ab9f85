"""`decentrl` command line: one subcommand per role, plus the demo and the tools around a run.

The subcommands are the table `commands.COMMANDS`; here the parser is built from it and a parsed
command runs on its resolved config (defaults < file < `--set` < the command's own flags). A user's
mistake (bad flag, bad config, missing file) is one line on stderr naming the fix, exit status 2,
no traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys

from decentrl import __version__
from decentrl.argparser import Parser
from decentrl.commands import COMMANDS, add_config_arguments
from decentrl.config import ConfigError, RunConfig, load_config

ROLES = ("coordinator", "trainer", "worker", "verifier", "scorer", "serve")
"""Commands a launcher starts as subprocesses (see `launch/parent.py`)."""


def build_parser() -> Parser:
    parser = Parser(prog="decentrl", description="Asynchronous RL post-training across scattered workers.")
    parser.add_argument("--version", action="version", version=f"decentrl {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for name, command in COMMANDS.items():
        sub = commands.add_parser(name, help=command.help)
        if command.takes_config:
            add_config_arguments(sub)
        command.arguments(sub)
    return parser


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
    command = COMMANDS[args.command]
    check_connection_args(args)
    if not hasattr(args, "overrides"):  # a command without --config/--set
        return command.run(args, RunConfig(), argv)
    config = load_config(args.config or command.default_config(args), args.overrides, command.fields(args))
    return command.run(args, config, argv)


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
