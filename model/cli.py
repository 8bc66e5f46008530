"""`bert` commands that need only model/: vocab, import, info (training commands register here too).

`app.cli` builds the full `bert` command from `build_parser()` and adds `serve` and `worker`.
Every command is a function `cmd_<name>(args) -> int`; errors a user can fix print one line and
exit 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .config import BertConfig
from .io import load_state_dict
from .modeling import HEAD_NAMES, LEGACY_KEYS, class_for_heads, heads_of, normalize_state_dict


class UserError(Exception):
    """A problem with the user's input: printed as one line, exit status 2."""


def cmd_vocab(args: argparse.Namespace) -> int:
    from .tokenizer import train_vocab

    missing = [f for f in args.files if not Path(f).is_file()]
    if missing:
        raise UserError(f"no such file: {', '.join(missing)}")
    tok = train_vocab(args.files, args.output, vocab_size=args.vocab_size,
                      lowercase=not args.cased, min_frequency=args.min_frequency)
    print(f"wrote a {tok.vocab_size}-token {'cased' if args.cased else 'uncased'} vocabulary to {args.output}")
    return 0


def import_model(src: str | Path, dst: str | Path) -> dict:
    """Validate any HF BERT directory and write it in the project's layout; returns `describe(dst)`.

    The weights go through our own model class (so a directory that would not load is refused
    before anything is written), and out as safetensors with tokenizer.json beside them.
    """
    from .tokenizer import BertTokenizer

    src, dst = Path(src), Path(dst)
    if not src.is_dir():
        raise UserError(f"{src} is not a directory")
    if not (src / "config.json").is_file():
        raise UserError(f"{src} has no config.json: not a Hugging Face model directory")
    try:
        state = normalize_state_dict(load_state_dict(src))
        cls = class_for_heads(heads_of(state))
        model = cls._from_state(src, state, "cpu", False, {})
        tokenizer = BertTokenizer.from_pretrained(src)
    except (ValueError, FileNotFoundError) as e:
        raise UserError(str(e)) from None
    if tokenizer.vocab_size != model.config.vocab_size:
        raise UserError(f"tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is "
                        f"{model.config.vocab_size}")
    model.save_pretrained(dst, tokenizer=tokenizer)
    return describe(dst)


def describe(path: str | Path) -> dict:
    """Architecture, parameter count, heads and vocabulary of a model directory."""
    path = Path(path)
    config = BertConfig.from_json_file(path / "config.json")
    state = normalize_state_dict(load_state_dict(path))
    heads = heads_of(state)
    vocab = None
    if (path / "tokenizer.json").is_file() or (path / "vocab.txt").is_file():
        from .tokenizer import BertTokenizer
        tok = BertTokenizer.from_pretrained(path)
        vocab = {"size": tok.vocab_size, "lowercase": tok.lowercase}
    return {
        "path": str(path),
        "architecture": class_for_heads(heads).__name__,
        "layers": config.num_hidden_layers,
        "hidden_size": config.hidden_size,
        "heads": config.num_attention_heads,
        "max_position_embeddings": config.max_position_embeddings,
        "parameters": sum(v.numel() for k, v in state.items() if k not in LEGACY_KEYS),
        "model_heads": sorted(heads),
        "labels": [config.id2label[i] for i in sorted(config.id2label)] if config.id2label else None,
        "vocab": vocab,
    }


def cmd_import(args: argparse.Namespace) -> int:
    dst = Path(args.dst)
    if dst.exists() and not args.force:
        raise UserError(f"{dst} exists; pass --force to replace it")
    info = import_model(args.src, dst)
    print(f"imported {args.src} -> {dst}")
    _print_info(info)
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    path = Path(args.dir)
    if not (path / "config.json").is_file():
        raise UserError(f"{path} has no config.json: not a model directory")
    try:
        info = describe(path)
    except (ValueError, FileNotFoundError) as e:
        raise UserError(str(e)) from None
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        _print_info(info)
    return 0


def _print_info(info: dict) -> None:
    heads = ", ".join(HEAD_NAMES[h] for h in info["model_heads"]) or "none"
    print(f"  architecture: {info['architecture']} ({info['layers']} layers, hidden {info['hidden_size']}, "
          f"{info['heads']} heads, max {info['max_position_embeddings']} positions)")
    print(f"  parameters:   {info['parameters']:,}")
    print(f"  heads:        {heads}")
    if info["labels"]:
        print(f"  labels:       {', '.join(info['labels'])}")
    if info["vocab"]:
        case = "uncased" if info["vocab"]["lowercase"] else "cased"
        print(f"  vocabulary:   {info['vocab']['size']:,} tokens, {case}")


def build_parser(add_commands=None) -> argparse.ArgumentParser:
    """The `bert` parser; `add_commands(subparsers)` lets app/ add serve, up and worker."""
    parser = argparse.ArgumentParser(prog="bert", description="bertserve: train and serve BERT.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("vocab", help="train a WordPiece vocabulary from text files")
    p.add_argument("files", nargs="+", help="plain-text training files")
    p.add_argument("-o", "--output", required=True, help="directory for vocab.txt and tokenizer.json")
    p.add_argument("--vocab-size", type=int, default=30522)
    p.add_argument("--min-frequency", type=int, default=2)
    p.add_argument("--cased", action="store_true", help="keep case (default: lowercase)")
    p.set_defaults(func=cmd_vocab)

    p = sub.add_parser("import", help="convert a Hugging Face BERT directory into the project's layout")
    p.add_argument("src", help="HF model directory (config.json, weights, vocab.txt or tokenizer.json)")
    p.add_argument("dst", help="destination, e.g. data/models/NAME")
    p.add_argument("--force", action="store_true", help="replace an existing destination")
    p.set_defaults(func=cmd_import)

    p = sub.add_parser("info", help="architecture, parameters, heads and vocabulary of a model directory")
    p.add_argument("dir")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_info)

    from . import train_cli  # here, not at the top: train_cli imports UserError from this module

    train_cli.add_commands(sub)
    if add_commands is not None:
        add_commands(sub)
    return parser


def run(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> int:
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except UserError as e:
        print(f"bert {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def main(argv: list[str] | None = None) -> int:
    return run(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
