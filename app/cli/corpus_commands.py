"""`bert corpus build`: raw text (files, folders, globs; plain or compressed; Wikipedia XML dumps) into a
sharded token store that pretraining streams from. The work is model/data/corpus_build.py; this turns
options into its arguments and shows a progress bar and a summary line."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from app.cli.model_commands import model_dir_arg
from model.data.corpus import READ_FORMATS
from model.data.corpus_build import DEFAULT_SHARD_TOKENS, DEFAULT_UNIT_BYTES, BuildOptions, build_store
from model.errors import UserError


def cmd_corpus_build(args: argparse.Namespace) -> int:
    from app.cli.progress import BuildProgressBar
    from model.tokenizer import BertTokenizer

    if args.workers < 1:
        raise UserError(f"--workers must be >= 1, got {args.workers}")
    try:
        tokenizer = BertTokenizer.from_pretrained(args.tokenizer)
        options = BuildOptions(
            format=args.format,
            text_field=args.text_field,
            shard_tokens=args.shard_tokens,
            unit_bytes=int(args.unit_mb * 2**20),
        )
    except (ValueError, FileNotFoundError) as e:
        raise UserError(str(e)) from None
    bar, started = BuildProgressBar(), time.monotonic()
    try:
        manifest = build_store(args.inputs, tokenizer, args.out, workers=args.workers, options=options, on_progress=bar)
    except (ValueError, FileNotFoundError) as e:
        raise UserError(str(e)) from None
    finally:
        bar.close()
    _print_summary(manifest, Path(args.out), time.monotonic() - started)
    return 0


def _print_summary(manifest: dict, out: Path, seconds: float) -> None:
    totals, stats = manifest["totals"], manifest["stats"]
    size = sum(s["bytes"] for s in manifest["sources"])
    print(
        f"{out}: {len(manifest['shards'])} shards, {totals['documents']:,} documents, "
        f"{totals['sentences']:,} sentences, {totals['tokens']:,} tokens from {len(manifest['sources'])} files "
        f"({size / 2**20:,.1f} MiB) in {seconds:.1f} s ({size / 2**20 / max(seconds, 1e-9):,.1f} MiB/s, "
        f"{totals['tokens'] / max(seconds, 1e-9):,.0f} tokens/s); dropped {stats['paragraphs_duplicate']:,} "
        f"duplicate paragraphs, {stats['sentences_near_empty']:,} near-empty and "
        f"{stats['sentences_non_text']:,} non-text sentences"
    )


def add_commands(sub) -> None:
    """Register `corpus` (with `build`) on the `bert` command's subparsers."""
    corpus = sub.add_parser("corpus", help="prepare pretraining corpora at scale")
    corpus_sub = corpus.add_subparsers(dest="corpus_command", required=True, metavar="SUBCOMMAND")
    p = corpus_sub.add_parser(
        "build",
        help="tokenise raw text into a sharded token store (resumable)",
        description="Tokenise files, folders and globs (text, google, pairs, jsonl, "
        "Wikipedia XML; .gz/.bz2/.xz/.zst) into STORE_DIR. Rerun the same "
        "command to resume a build that was killed.",
    )
    p.add_argument("inputs", nargs="+", metavar="INPUT", help="file, folder (every file below) or glob")
    p.add_argument(
        "--tokenizer",
        type=model_dir_arg,
        required=True,
        metavar="MODEL_OR_VOCAB_DIR",
        help="directory with tokenizer.json or vocab.txt (a model directory works)",
    )
    p.add_argument("--out", required=True, metavar="STORE_DIR", help="the store directory (created)")
    p.add_argument("--workers", type=int, default=1, help="tokenising processes (default 1: this process)")
    p.add_argument("--format", choices=READ_FORMATS, help="input format of every file (default: detect per file)")
    p.add_argument("--text-field", default="text", help="JSONL field with the text")
    p.add_argument(
        "--shard-tokens",
        type=int,
        default=DEFAULT_SHARD_TOKENS,
        help=f"tokens per shard before it is closed (default {DEFAULT_SHARD_TOKENS:,})",
    )
    p.add_argument(
        "--unit-mb",
        type=float,
        default=DEFAULT_UNIT_BYTES / 2**20,
        help="large uncompressed files are cut into work units of about this size "
        f"(default {DEFAULT_UNIT_BYTES // 2**20})",
    )
    p.set_defaults(func=cmd_corpus_build)
