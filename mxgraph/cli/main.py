"""The `mxgraph` command line.

A user error (`mxgraph.errors.UserError`: a bad plan, model, data file or flag value) is
printed as one line `mxgraph: error: ...` and exits with status 2; `--debug` shows its
traceback instead. Any other exception is a bug and keeps its traceback (status 1).
"""
from __future__ import annotations

import argparse
import os
import sys
import traceback

import models
from mxgraph.cli.data import add_data_parser
from mxgraph.cli.export import add_export_parser
from mxgraph.cli.inspect import add_inspect_parser
from mxgraph.cli.search import add_search_parser
from mxgraph.cli.train import add_train_parser
from mxgraph.errors import UserError

USER_ERRORS = (UserError, models.UnknownPresetError)
DEBUG_HELP = "show the full traceback of a user error instead of one line"


class _CommandParser(argparse.ArgumentParser):
    """The parser of one command: an error in its flags is one line that points to its
    --help (its usage, one line per few flags, would bury the message), and a flag it does
    not know is its error, not the top level's."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")

    def parse_known_args(self, args=None, namespace=None):
        namespace, extra = super().parse_known_args(args, namespace)
        if extra:
            self.error(f"unrecognized arguments: {' '.join(extra)}")
        return namespace, extra


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mxgraph")
    parser.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    # a command's own --debug; SUPPRESS keeps it from resetting the top-level one
    debug = argparse.ArgumentParser(add_help=False)
    debug.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help=DEBUG_HELP)
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_CommandParser)
    # one module per command; this order is the command list of `mxgraph --help`
    add_train_parser(commands, [debug])
    add_inspect_parser(commands, [debug])
    add_search_parser(commands, [debug], models)
    add_export_parser(commands, [debug])
    add_data_parser(commands, [debug])
    parser.description = ("Compile and run PyTorch training steps. Commands: "
                          f"{', '.join(commands.choices)}; 'mxgraph COMMAND --help' for one.")
    return parser


def main(argv=None) -> int:
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except USER_ERRORS as error:
        if args.debug:
            traceback.print_exc()
        else:
            print(f"mxgraph: error: {one_line(error)}", file=sys.stderr)
        return 2


def one_line(error: BaseException) -> str:
    """The first line of the message; the rest, if any, is left to --debug."""
    lines = str(error).strip().splitlines() or [type(error).__name__]
    return lines[0] + (" (more with mxgraph --debug)" if len(lines) > 1 else "")

