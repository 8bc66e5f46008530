"""`bert vocab`, `bert import`, `bert info` and `bert evaluate-card`: a WordPiece vocabulary, and model
directories (their card: the held-out scores model/model_card.py measures)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from datadir.cards import CARD, read_card
from datadir.versions import served_dir
from model.errors import UserError
from model.options import IMPORT_POOLINGS, PRECISIONS


def model_dir_arg(value: str) -> str:
    """A model directory argument: a model with versions (DATA_DIR/models/<name>) reads as its promoted
    version, as requests get it; any other path is kept as given."""
    return str(served_dir(value))


# The model's modules (torch) load inside the commands, so `bert info --help` answers without them.


def cmd_vocab(args: argparse.Namespace) -> int:
    from model.tokenizer import train_vocab

    missing = [f for f in args.files if not Path(f).is_file()]
    if missing:
        raise UserError(f"no such file: {', '.join(missing)}")
    tok = train_vocab(
        args.files, args.output, vocab_size=args.vocab_size, lowercase=not args.cased, min_frequency=args.min_frequency
    )
    print(f"wrote a {tok.vocab_size}-token {'cased' if args.cased else 'uncased'} vocabulary to {args.output}")
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    """`bert import SOURCE --name NAME`: a new version of a model in DATA_DIR; `bert import SRC DST`: a directory."""
    if args.dst is not None:
        return _import_to_directory(args)
    if not args.name:
        raise UserError("name the model: bert import SOURCE --name NAME (or give a destination directory: SRC DST)")
    from app.settings import Settings
    from model.sources import import_source

    data_dir = Path(args.data_dir) if args.data_dir else Settings().data_dir
    version, info = import_source(data_dir, args.source, args.name, revision=args.revision, pooling=args.pooling)
    print(
        f"imported {args.source}{f' at {args.revision}' if args.revision else ''} as model '{args.name}' -> {version}"
    )
    _print_summary(_servable(info))
    _print_measured(read_card(version))
    return 0


def _import_to_directory(args: argparse.Namespace) -> int:
    """The directory converted, then measured into its card.json as an import into DATA_DIR is (the held-out
    evaluation and the precisions this CPU runs natively), so a service that serves it chooses its precision at
    load instead of serving fp32 while it measures."""
    from model.model_card import write_card
    from model.model_dir import import_model
    from model.sources import fetch

    if args.name or args.revision:
        raise UserError("--name and --revision import into DATA_DIR: give SOURCE alone, not a destination")
    dst = Path(args.dst)
    if dst.exists() and not args.force:
        raise UserError(f"{dst} exists; pass --force to replace it")
    info = _servable(import_model(args.source, dst, pooling=args.pooling))
    card = write_card(dst, source=fetch(args.source, "directory", dst).source)
    print(f"imported {args.source} -> {dst}")
    _print_summary(info)
    _print_measured(card)
    return 0


def _print_measured(card: dict) -> None:
    """After an import: the precisions measured into its card, and what `auto` serves on this CPU from them."""
    _print_precision_table(card.get("precision") or {})
    print("  auto on this CPU: {} ({})".format(*_auto_on_this_cpu(card)))


def cmd_info(args: argparse.Namespace) -> int:
    from model.model_dir import summarize

    path = Path(args.dir)
    if not (path / "config.json").is_file():
        raise UserError(f"{path} has no config.json: not a model directory")
    try:
        info = _servable(summarize(path))
    except (ValueError, FileNotFoundError) as e:
        raise UserError(str(e)) from None
    info["card"] = read_card(path) or None
    info["kernels"] = _kernels_here(args.device, info["card"] or {})
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        _print_summary(info)
        _print_card(info["card"] or {})
        _print_kernels(info["kernels"])
    return 0


def cmd_evaluate_card(args: argparse.Namespace) -> int:
    from model.model_card import write_card

    path = Path(args.dir)
    if not (path / "config.json").is_file():
        raise UserError(f"{path} has no config.json: not a model directory")
    card = write_card(path)
    if "error" in card["evaluation"]:
        raise UserError(f"the evaluation failed: {card['evaluation']['error']}")
    print(f"wrote {path / CARD}")
    _print_card(card)
    return 0


def _servable(info: dict) -> dict:
    """`model_heads` as GET /models reports `heads`: what the service can serve with the model (mlm, nsp,
    classifier, token_classifier, qa), not the weight groups it holds (a pooler serves no route)."""
    from app.serving.stored_models import servable_heads
    from model.modeling import MODEL_CLASSES

    return {**info, "model_heads": servable_heads(MODEL_CLASSES[info["architecture"]])}


def _kernels_here(device_setting: str, card: dict) -> dict:
    """What this machine would run the model with at each precision (model.compute.kernels), and what auto is
    and why: on a CPU, from the card's measured table (model.precision_choice) within the BERT_AUTO_MIN_* bounds,
    as the service chooses."""
    from model.compute import kernels
    from model.compute.device import resolve_device
    from model.compute.precision import recommendation

    try:
        device = resolve_device(device_setting)
    except ValueError as e:
        raise UserError(str(e)) from None
    where = kernels.cpu().name if device.type == "cpu" else str(device)
    precisions = PRECISIONS if device.type == "cpu" else tuple(p for p in PRECISIONS if p != "int8")  # int8: CPU only
    auto = _auto_on_this_cpu(card) if device.type == "cpu" else recommendation(device)
    return {
        "device": str(device),
        "machine": f"{where}: {kernels.cpu().summary()}" if device.type == "cpu" else where,
        "auto": auto[0],
        "auto_why": auto[1],
        **{p: kernels.describe(p, device) for p in precisions},
    }


def _auto_on_this_cpu(card: dict) -> tuple[str, str]:
    """(precision, why): what auto serves on this CPU from the card's measured table, within the BERT_AUTO_MIN_*
    bounds, as the service chooses."""
    from app.settings import Settings
    from model.precision_choice import Bounds, auto_choice, cpu_kind

    s = Settings()
    bounds = Bounds(s.auto_min_cosine, s.auto_min_agreement, s.auto_min_top5_overlap)
    return auto_choice(card.get("precision"), bounds) or (
        "fp32",
        f"not measured on this kind of CPU ({cpu_kind()}): `bert evaluate-card` measures it, a service at its load",
    )


def _print_kernels(plan: dict) -> None:
    print(f"  this machine: {plan['machine']}")
    print(f"    auto:       {plan['auto']} ({plan['auto_why']})")
    for precision in PRECISIONS:
        if precision in plan:
            name = f"{precision} (auto)" if precision == plan["auto"] else precision
            why = plan[precision]["why"].partition(": ")[2] if ": " in plan[precision]["why"] else ""
            print(f"    {name + ':':12} {plan[precision]['kernels']}{f': {why}' if why else ''}")


def _print_card(card: dict) -> None:
    """The card's evaluation lines and its measured precisions (nothing when the directory has no card)."""
    ev = card.get("evaluation")
    if ev is None:
        pass
    elif "skipped" in ev or "error" in ev:
        print(f"  evaluation:   {ev.get('set')}: {ev.get('skipped') or 'failed: ' + str(ev.get('error'))}")
    else:
        print(
            f"  evaluation:   {ev['set']}, {ev['sequences']} sequences ({ev['tokens']:,} tokens), "
            f"{ev['masked_tokens']} masked"
        )
        print(f"    masked LM:  top-1 {_pct(ev['mlm_top1'])}, top-5 {_pct(ev['mlm_top5'])}")
        print(
            f"    content words ({ev['content_tokens']}): "
            f"top-1 {_pct(ev['content_top1'])}, top-5 {_pct(ev['content_top5'])}"
        )
        print(f"    next sentence: {_pct(ev['nsp_accuracy'])}")
    if card.get("before_after"):
        print("  job's evaluation, before -> after training:")
        for row in card["before_after"]:
            print(f"    {row['metric'] + ':':20} {row['before']:.4g} -> {row['after']:.4g}")
    elif card.get("job_eval"):
        scores = ", ".join(f"{k} {v:.4g}" for k, v in card["job_eval"].items() if isinstance(v, (int, float)))
        print(f"  job's evaluation: {scores}")
    _print_precision_table(card.get("precision") or {})


def _print_precision_table(table: dict) -> None:
    """One line per kind of CPU and precision: its speed against fp32 and each output's scores."""
    for kind, row in sorted(table.items()):
        if "error" in row:
            print(f"  precisions on {kind}: the measurement failed: {row['error']}")
            continue
        if set(row.get("precisions", {})) <= {"fp32"}:
            print(f"  precisions on {kind}: fp32 only (no other precision is native there)")
            continue
        print(f"  precisions on {kind} (measured {row.get('measured')}, against fp32):")
        for precision, scores in row.get("precisions", {}).items():
            if precision == "fp32":
                continue
            parts = [_speed_words(scores)] + [
                f"{output} {', '.join(f'{k} {v:.6g}' for k, v in values.items())}"
                for output, values in scores.items()
                if isinstance(values, dict)
            ]
            print(f"    {precision + ':':12} {'; '.join(parts)}")


def _speed_words(scores: dict) -> str:
    """ "1.54x fp32 (short texts 1.54x, long 1.78x)": the speed that orders the precision, the lower of its two."""
    each = [
        f"{texts} {scores[key]:g}x"
        for texts, key in (("short texts", "speed_short"), ("long", "speed_long"))
        if key in scores
    ]
    return f"{scores.get('speed', 0):g}x fp32" + (f" ({', '.join(each)})" if len(each) == 2 else "")


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _print_summary(info: dict) -> None:
    heads = ", ".join(info["model_heads"]) or "none"
    print(
        f"  architecture: {info['architecture']} ({info['layers']} layers, hidden {info['hidden_size']}, "
        f"{info['heads']} heads, max {info['max_position_embeddings']} positions)"
    )
    print(f"  parameters:   {info['parameters']:,}")
    print(f"  heads:        {heads}")
    if info["labels"]:
        print(f"  labels:       {', '.join(info['labels'])}")
    if info["vocab"]:
        case = "uncased" if info["vocab"]["lowercase"] else "cased"
        print(f"  vocabulary:   {info['vocab']['size']:,} tokens, {case}")


def add_commands(sub) -> None:
    """Register vocab, import and info on the `bert` command's subparsers."""
    p = sub.add_parser("vocab", help="train a WordPiece vocabulary from text files")
    p.add_argument("files", nargs="+", help="plain-text training files")
    p.add_argument("-o", "--output", required=True, help="directory for vocab.txt and tokenizer.json")
    p.add_argument("--vocab-size", type=int, default=30522, help="tokens in the vocabulary (BERT's 30522)")
    p.add_argument("--min-frequency", type=int, default=2, help="pairs seen fewer times are not merged")
    p.add_argument("--cased", action="store_true", help="keep case (default: lowercase)")
    p.set_defaults(func=cmd_vocab)

    p = sub.add_parser(
        "import",
        help="import a BERT from a Hugging Face Hub repo, a directory or an archive as a model in DATA_DIR "
        "(or convert a directory into another: SRC DST)",
    )
    p.add_argument(
        "source",
        help="a Hub repo id (google-bert/bert-base-uncased), a Hugging Face model directory, "
        "or a .tar, .tar.gz, .tgz or .zip of one",
    )
    p.add_argument(
        "dst",
        nargs="?",
        help="instead of --name: write the converted directory here (default: none, import into DATA_DIR)",
    )
    p.add_argument(
        "--name",
        help="the model's name in DATA_DIR/models, imported as its next version (no default: required without DST)",
    )
    p.add_argument("--revision", help="a Hub branch, tag or commit (default: the repo's main branch)")
    p.add_argument(
        "--pooling",
        choices=IMPORT_POOLINGS,
        help="splade: a sparse encoder served by /embed_sparse, for a masked-LM model whose files do not say so "
        "(default: as its files say)",
    )
    p.add_argument("--data-dir", help="default BERT_DATA_DIR or ./data")
    p.add_argument("--force", action="store_true", help="with DST: replace an existing destination")
    p.set_defaults(func=cmd_import)

    p = sub.add_parser(
        "info",
        help="architecture, parameters, heads and vocabulary of a model directory, "
        "and the kernels this machine would run it with at each precision",
    )
    p.add_argument("dir", type=model_dir_arg, help="a model directory (a model with versions: its promoted one)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--device", default="auto", help="where the kernels would run: auto, cpu, cuda or cuda:N")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser(
        "evaluate-card",
        help="measure a model directory on the held-out Wikipedia set (masked-token and next-sentence "
        "accuracy), and each precision this CPU runs natively against fp32 (what auto chooses from), and write both "
        "into its card.json",
    )
    p.add_argument("dir", type=model_dir_arg, help="a model directory (a model with versions: its promoted one)")
    p.set_defaults(func=cmd_evaluate_card)
