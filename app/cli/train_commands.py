"""`bert pretrain`, `bert finetune` and `bert evaluate`: options in, a spec to model.training.runs, a progress bar out.

Each command only turns its options into a PretrainSpec/FinetuneSpec (or evaluate_model's arguments)
and runs it with the progress bar and the Ctrl-C handler as callbacks; the training itself is
model/training/runs.py, the same code the worker runs.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

from app.cli.launch import add_launch_options, relaunch, wants_launcher
from app.cli.model_commands import model_dir_arg
from model.errors import UserError
from model.options import BY_NAME, KINDS, OPTIONS, Option, format_default, options_for

# torch and model.training.runs load inside the commands, so `bert finetune --help` answers without them.


def _run_with_progress(run, spec) -> int:
    """Run a spec with a progress bar and Ctrl-C handling. Under torchrun, rank 0 alone draws and prints."""
    from app.cli.progress import ProgressBar, SignalStop
    from model.training import checkpoint as ckpt
    from model.training.callbacks import format_metrics
    from model.training.distributed import destroy, env_dist, launched

    main_rank = env_dist().is_main
    # The run functions and the data pipeline log what they do (tokenising, warm start) at INFO.
    logging.basicConfig(level=logging.INFO if main_rank else logging.WARNING, format="%(message)s", stream=sys.stderr)
    bar = ProgressBar()
    latest = ckpt.latest_checkpoint(spec.out)
    if latest is not None and spec.resume and main_rank:
        print(f"resuming from {latest}", file=sys.stderr)
    # Under torchrun a rank's second signal is torchrun passing the first on: it must not abort the step.
    with SignalStop(abort_on_second=not launched()) as stop:
        try:
            result = run(spec, callbacks=[bar, stop] if main_rank else [stop])
        finally:
            bar.close()
    # A rank leaves its process group before it exits: one left to the interpreter's teardown can abort the
    # rank (gloo's threads still hold tensors), and torchrun then calls a finished run failed. Only after a
    # run that returned: with a peer gone, destroying could wait on it.
    destroy()
    if not main_rank:
        return 0
    if result.stopped:
        print(
            f"stopped at step {result.step}/{result.total_steps}; checkpoint {result.checkpoint}. "
            "Run the same command to resume."
        )
        # A rank's non-zero status would make torchrun call the run failed; the launcher says 130.
        return 130 if stop.requested and not launched() else 0
    print(f"done: {result.step} steps; final model in {result.model_dir}")
    if result.eval_metrics:
        print("eval: " + format_metrics(result.eval_metrics))
    return 0


def _set_threads(args: argparse.Namespace) -> None:
    if args.threads is not None:
        if args.threads < 1:
            raise UserError(f"--threads must be >= 1, got {args.threads}")
        import torch

        torch.set_num_threads(args.threads)


def cmd_pretrain(args: argparse.Namespace) -> int:
    if wants_launcher(args):
        return relaunch(args, args.argv)
    from model.training.runs import PretrainSpec, default_train_config, run_pretraining

    _set_threads(args)
    if args.from_model and args.config:
        raise UserError("give --from (warm start) or --config (from scratch), not both")
    if args.freeze_encoder and not args.from_model:
        raise UserError("--freeze-encoder needs --from MODEL_DIR (a fresh encoder has nothing worth freezing)")
    spec = PretrainSpec(
        corpus=_existing_corpus(args.corpus),
        out=args.out,
        from_model=args.from_model,
        config=args.config,
        vocab=args.vocab,
        corpus_format=args.format,
        text_field=args.text_field,
        eval_corpus=_existing_corpus(args.eval_corpus) if args.eval_corpus else None,
        cache_dir=args.cache_dir,
        resume=args.resume,
        train=_train_config(args, "pretrain", default_train_config(PretrainSpec)),
        **_given(args, "pretrain", trainer=False),
    )
    return _run_with_progress(run_pretraining, spec)


def cmd_finetune(args: argparse.Namespace) -> int:
    if wants_launcher(args):
        return relaunch(args, args.argv)
    from model.training.runs import FinetuneSpec, run_finetuning, task_spec_defaults, task_train_config

    _set_threads(args)
    task = args.task or BY_NAME["task"].default_for("finetune")
    for o in OPTIONS:  # an option of another task (model/options.py's `tasks`) given other than its default
        if not o.tasks or task in o.tasks or not o.cli:
            continue
        value = getattr(args, o.name, None)
        if value is not None and value != o.default_for("finetune", task):
            raise UserError(f"{o.cli_flag} is for --task {' or '.join(o.tasks)}, not {task}")
    spec = FinetuneSpec(
        train_file=_existing_file(args.train),
        from_model=args.from_model,
        out=args.out,
        eval_file=_existing_file(args.eval) if args.eval else None,
        resume=args.resume,
        train=_train_config(args, "finetune", task_train_config(task)),
        **{**task_spec_defaults(task), **_given(args, "finetune", trainer=False)},
    )
    return _run_with_progress(run_finetuning, spec)


def cmd_evaluate(args: argparse.Namespace) -> int:
    from model.training.runs import evaluate_model

    _set_threads(args)
    metrics = evaluate_model(
        args.model,
        _existing_corpus(args.data),
        corpus_format=args.format,
        text_column=args.text_column,
        text_pair_column=args.text_pair_column,
        label_column=args.label_column,
        batch_size=args.batch_size,
        max_seq_len=args.max_seq_len,
        seed=args.seed,
        max_batches=args.max_batches,
        device=args.device,
        precision=args.precision,
        doc_stride=args.doc_stride,
        max_query_length=args.max_query_length,
        max_answer_len=args.max_answer_len,
    )
    if args.json:
        print(json.dumps(metrics, indent=2))
    else:
        for key, value in metrics.items():
            print(f"{key:>14}: {value:.4f}" if isinstance(value, float) else f"{key:>14}: {value}")
    return 0


def _existing_file(path: str) -> str:
    if not Path(path).is_file():
        raise UserError(f"no such file: {path}")
    return path


def _existing_corpus(path: str) -> str:
    """A corpus file, or a directory (a token store: its own checks name what is wrong with it)."""
    if not Path(path).exists():
        raise UserError(f"no such file or directory: {path}")
    return path


def _given(args: argparse.Namespace, kind: str, *, trainer: bool) -> dict[str, Any]:
    """The options of `kind` given on the command line (model/options.py), trainer ones or spec ones."""
    return {
        o.name: getattr(args, o.name)
        for o in options_for(kind, trainer=trainer)
        if o.cli and getattr(args, o.name) is not None
    }


def _train_config(args: argparse.Namespace, kind: str, default):
    from model.training.runs import merge_train_config

    overrides = _given(args, kind, trainer=True)
    if args.warmup is not None:
        overrides.update(_parse_warmup(args.warmup))
    try:
        return merge_train_config(default, overrides)
    except ValueError as e:
        raise UserError(str(e)) from None


def _parse_warmup(text: str) -> dict[str, Any]:
    """--warmup 500 (steps) or --warmup 0.1 (a fraction of the total steps)."""
    try:
        value = float(text)
    except ValueError:
        raise UserError(f"--warmup must be a number of steps or a fraction below 1, got {text!r}") from None
    if value < 0:
        raise UserError(f"--warmup must not be negative, got {text!r}")
    if value < 1 and not text.strip().isdigit():
        return {"warmup_ratio": value, "warmup_steps": None}
    if not value.is_integer():
        raise UserError(f"--warmup in steps must be a whole number, got {text!r}")
    return {"warmup_steps": int(value)}


def _add_options(p: argparse.ArgumentParser, kind: str) -> None:
    """The flags of model/options.py's table for `kind`, each with its help and default(s), in three groups."""
    groups = {
        "data": p.add_argument_group("data"),
        kind: p.add_argument_group(kind.replace("finetune", "fine-tuning").replace("pretrain", "pretraining")),
        "training": p.add_argument_group("training"),
    }
    for o in options_for(kind):
        if o.name == "warmup_steps":
            _add_warmup(groups["training"], kind)
        if o.cli:
            group = "training" if o.trainer else "data" if o.kinds == KINDS or o.name.endswith("column") else kind
            add_option_flag(groups[group], o, kind)


def add_option_flag(g, o: Option, kind: str, default: Any = None, help: str | None = None) -> None:
    """One option's flag. `default` None: unset unless given (the run spec's default applies)."""
    shown = format_default(o, kind) if default is None else default
    help = f"{help or o.help} (default: {shown})"
    if o.type is bool:
        g.add_argument(o.cli_flag, dest=o.name, action=argparse.BooleanOptionalAction, default=default, help=help)
        return
    if o.items is not None:  # comma-separated: --matryoshka-dims 384,256,128
        g.add_argument(o.cli_flag, dest=o.name, type=_list_of(o), default=default, help=help, metavar=o.name.upper())
        return
    g.add_argument(
        o.cli_flag,
        dest=o.name,
        type=o.type,
        choices=o.choices,
        default=default,
        help=help,
        metavar=None if o.choices else o.name.upper(),
    )


def _list_of(o: Option):
    """argparse's `type` for a list option: comma-separated items, each of the option's item type and choices."""
    item = o.items
    assert item is not None

    def parse(text: str) -> list:
        try:
            values = [item(part.strip()) for part in text.split(",") if part.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a comma-separated list of {item.__name__}: {text!r}") from None
        bad = [v for v in values if o.choices is not None and v not in o.choices]
        if not values or bad:
            wanted = f" of {', '.join(o.choices)}" if o.choices else ""
            raise argparse.ArgumentTypeError(f"not a comma-separated list{wanted}: {text!r}")
        return values

    return parse


def _add_warmup(g, kind: str) -> None:
    steps, ratio = BY_NAME["warmup_steps"], BY_NAME["warmup_ratio"]
    g.add_argument(
        "--warmup",
        help=f"warmup steps (e.g. 500) or a fraction of the run (e.g. 0.1) (default: "
        f"{format_default(ratio, kind)} of the run, as "
        f"{ratio.name}; {steps.name}: {format_default(steps, kind)})",
    )


def _add_run_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("run")
    g.add_argument(
        "--out",
        required=True,
        metavar="RUN_DIR",
        help="run directory: metrics.jsonl, training.svg, checkpoints/, model/",
    )
    g.add_argument(
        "--threads",
        type=int,
        help="CPU threads for torch (default: torch's choice; on a busy machine 1 can be several times faster)",
    )
    g.add_argument(
        "--resume",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="continue from RUN_DIR's latest complete checkpoint; --no-resume refuses a RUN_DIR that has one",
    )
    add_launch_options(p)


def add_commands(sub) -> None:
    """Register pretrain, finetune and evaluate on the `bert` command's subparsers."""
    _add_pretrain(sub)
    _add_finetune(sub)
    _add_evaluate(sub)


def _add_pretrain(sub) -> None:
    p = sub.add_parser("pretrain", help="pretrain BERT (MLM + NSP) on a text corpus, from scratch or warm-started")
    p.add_argument(
        "--corpus",
        required=True,
        help="pairs (A<TAB>B), google (sentence per line), text or jsonl file, or a token store directory",
    )
    p.add_argument("--format", choices=("pairs", "google", "text", "jsonl"), help="corpus format (default: detect)")
    p.add_argument("--text-field", default="text", help="JSONL field with the text")
    p.add_argument(
        "--eval-corpus", help="held-out corpus or token store (default: hold out --eval-fraction of the documents)"
    )
    p.add_argument(
        "--from",
        dest="from_model",
        type=model_dir_arg,
        metavar="MODEL_DIR",
        help="warm start from a model directory (default: from scratch, with --config)",
    )
    p.add_argument(
        "--config", help="from scratch: tiny, small, base, or a config.json (default: none; give it or --from)"
    )
    p.add_argument(
        "--vocab", metavar="DIR", help="tokenizer directory, vocab.txt or tokenizer.json (default: the --from model's)"
    )
    p.add_argument("--cache-dir", help="where tokenised corpora are cached (default: beside the corpus)")
    _add_run_options(p)
    _add_options(p, "pretrain")
    p.set_defaults(func=cmd_pretrain)


def _add_finetune(sub) -> None:
    p = sub.add_parser(
        "finetune",
        help="fine-tune a model directory as a text classifier (or regressor), "
        "a token classifier (NER), an extractive QA model, an embedding model, a reranker (cross-encoder) "
        "or a sparse (SPLADE) retrieval model",
    )
    p.add_argument(
        "--train",
        required=True,
        help="CSV, TSV or JSONL with text[, text_pair], label; CoNLL or "
        "JSONL {tokens, tags} (token-classification); SQuAD JSON (QA); pairs, scored pairs or "
        "labelled pairs (cross-encoder); pairs (sparse-embedding)",
    )
    p.add_argument("--eval", help="held-out file (default: hold out --eval-fraction of --train)")
    p.add_argument(
        "--from",
        dest="from_model",
        type=model_dir_arg,
        required=True,
        metavar="MODEL_DIR",
        help="the model directory to start from, with its tokenizer",
    )
    _add_run_options(p)
    _add_options(p, "finetune")
    p.set_defaults(func=cmd_finetune)


def _add_evaluate(sub) -> None:
    p = sub.add_parser("evaluate", help="MLM/NSP, classification, NER or QA metrics of a model on a data file")
    p.add_argument("--model", required=True, type=model_dir_arg, metavar="DIR", help="model directory or run directory")
    p.add_argument(
        "--data",
        required=True,
        help="corpus or token store (MLM models), labelled table (classifiers), "
        "CoNLL/JSONL tagged sentences (token classifiers) or SQuAD JSON (QA models)",
    )
    p.add_argument("--format", choices=("pairs", "google", "text", "jsonl"), help="corpus format (default: detect)")
    p.add_argument("--max-batches", type=int, help="evaluate at most N batches (default: all)")
    p.add_argument("--threads", type=int, help="CPU threads for torch (default: torch's choice)")
    p.add_argument(
        "--json",
        action="store_true",
        help="print the metrics as JSON: f1, precision, recall, accuracy (NER); exact_match, f1 (QA)",
    )
    g = p.add_argument_group("options (as `bert finetune` has them)")
    helps = {"batch_size": "examples per batch", "seed": "masking seed for corpora"}
    for name in (
        "batch_size",
        "max_seq_len",
        "seed",
        "device",
        "precision",
        "text_column",
        "text_pair_column",
        "label_column",
        "max_query_length",
        "max_answer_len",
    ):
        o = BY_NAME[name]
        add_option_flag(g, o, "finetune", default=o.default_for("finetune"), help=helps.get(name))
    add_option_flag(g, BY_NAME["doc_stride"], "finetune")
    p.set_defaults(func=cmd_evaluate)
