"""The `bert` command (argparse): model commands, training commands and the service's commands.

    bert vocab | import | info | evaluate-card  app/cli/model_commands.py  (model/ directories)
    bert pretrain | finetune | evaluate        app/cli/train_commands.py  (model/training/runs.py, with a progress bar)
    bert serve | up | worker                   app/cli/service_commands.py
    bert corpus build                          app/cli/corpus_commands.py  (model/data/corpus_build.py)
    bert datasets upload | import | list | show | delete  app/cli/dataset_commands.py  (DATA_DIR/datasets, app/jobs/uploads.py)
    bert keys add | list | revoke | rotate     app/cli/key_commands.py  (app/keys/keyfile.py)

Every command is a function `cmd_<name>(args) -> int`; a model.errors.UserError prints one line and
exits with status 2, never a traceback. Parsing imports no torch (the commands import what they run),
so `bert --help` and every `bert COMMAND --help` answer at once; every option's help shows its default.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from importlib.metadata import PackageNotFoundError, version

from app.cli import (
    corpus_commands,
    dataset_commands,
    key_commands,
    model_commands,
    service_commands,
    train_commands,
)
from model.errors import UserError

DISTRIBUTION = "bertserve"  # pyproject's [project] name


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's "(default: X)" after an option's help, unless the help says its default itself (an
    option whose default is None words what None means) or it has none (a required option)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        help = action.help or ""
        if "default" in help or action.default is None or action.default is argparse.SUPPRESS or action.required:
            return help
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose subcommands' parsers (of the same class) use HelpFormatter, and whose commands
    refuse an unknown option themselves, naming the option it looks like (argparse does from Python 3.12)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        if extras and self._subparsers is None:  # a command's own parser, not `bert`'s (which would not say which)
            self.error(f"unrecognized arguments: {' '.join(extras)}{self._suggestion(extras)}")
        return namespace, extras

    def _suggestion(self, extras: list[str]) -> str:
        known = [o for o in self._option_string_actions if o.startswith("--")]
        for option in (e.split("=", 1)[0] for e in extras if e.startswith("--")):
            if close := difflib.get_close_matches(option, known, n=1):
                return f" (did you mean {close[0]}?)"
        return ""


def package_version() -> str:
    try:
        return version(DISTRIBUTION)
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="bert", description="bertserve: train and serve BERT.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for group in (model_commands, train_commands, corpus_commands, dataset_commands, service_commands, key_commands):
        group.add_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv  # the command line as given: `--nproc-per-node N` runs it again under torchrun
    try:
        return args.func(args)
    except UserError as e:
        print(f"bert {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
