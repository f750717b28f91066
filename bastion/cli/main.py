"""Entry point of the ``bastion`` command: one sub-module per sub-command.

Each command module exposes ``add_parser(subparsers) -> argparse.ArgumentParser`` which registers its
sub-command and sets ``func`` (taking the parsed namespace, returning an exit code) as a default.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import NoReturn

from bastion import __version__
from bastion.utils.logs import LOG_LEVELS

COMMAND_MODULES: tuple[str, ...] = (
    "bastion.cli.plugins_cmd",
    "bastion.cli.train_cmd",
    "bastion.cli.generate_cmd",
    "bastion.cli.run_cmd",
    "bastion.cli.bench_cmd",
    "bastion.cli.calibrate_cmd",
    "bastion.cli.serve_cmd",
)


class _Parser(argparse.ArgumentParser):
    """Command-line mistakes print one line, ``<prog>: error: <message>`` (exit code 2); ``--help`` shows
    the usage."""

    def error(self, message: str) -> "NoReturn":  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="bastion",
        description="Lossless, budget-aware tree speculative decoding (BASTION) for Hugging Face causal LMs.",
    )
    parser.add_argument("--version", action="version", version=f"bastion {__version__}")
    parser.add_argument("--debug", action="store_true", help="show the full traceback when a command fails")
    log_help = ("what the log shows on stderr, bastion's and the libraries' (transformers, torch) alike, Python "
                "warnings included (default: bastion's warnings only, the libraries' errors)")
    parser.add_argument("--log-level", choices=LOG_LEVELS, default=None, help=log_help)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for modname in COMMAND_MODULES:
        importlib.import_module(modname).add_parser(sub)
    _add_to_commands(parser, log_help)  # also after the command name: bastion generate --log-level info
    return parser


def _add_to_commands(parser: argparse.ArgumentParser, log_help: str) -> None:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for command in action.choices.values():
                if "--log-level" not in command._option_string_actions:
                    command.add_argument("--log-level", choices=LOG_LEVELS, default=argparse.SUPPRESS, help=log_help)
                _add_to_commands(command, log_help)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    from bastion.contract.errors import BastionError
    from bastion.utils.logs import configure_logging, request_level

    request_level(args.log_level)
    if args.log_level is not None:
        configure_logging()
    try:
        return int(args.func(args) or 0)
    except BastionError as exc:
        if args.debug:
            raise
        print(f"bastion: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("bastion: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # not one of bastion's errors: one line that says what happened, no traceback
        if args.debug:
            raise
        first = (str(exc).strip().splitlines() or [""])[0]
        print(f"bastion: error: {type(exc).__name__}: {first} (rerun with bastion --debug for the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
