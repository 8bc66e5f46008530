"""The `bert` command (argparse): model commands, training commands and the service's commands.

    bert vocab | import | info              app/cli/model_commands.py  (model/ directories)
    bert pretrain | finetune | evaluate     app/cli/train_commands.py  (model/runs.py, with a progress bar)
    bert serve | up | worker                app/cli/service_commands.py
    bert corpus build                       app/cli/corpus_commands.py  (model/data/corpus_build.py)

Every command is a function `cmd_<name>(args) -> int`; a model.errors.UserError prints one line and
exits with status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import sys

from model.errors import UserError

from app.cli import corpus_commands, model_commands, service_commands, train_commands


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bert", description="bertserve: train and serve BERT.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for group in (model_commands, train_commands, corpus_commands, service_commands):
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
