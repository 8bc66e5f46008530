"""`bert pretrain`, `bert finetune` and `bert evaluate`: options in, a spec to model.runs, a progress bar out.

Each command only turns its options into a PretrainSpec/FinetuneSpec (or evaluate_model's arguments)
and runs it with the progress bar and the Ctrl-C handler as callbacks; the training itself is
model/runs.py, the same code the worker runs.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

from model import checkpoint as ckpt
from model.callbacks import format_metrics
from model.distributed import env_dist, launched
from model.errors import UserError
from model.runs import (TASKS, FinetuneSpec, PretrainSpec, default_train_config, evaluate_model, merge_train_config,
                        run_finetuning, run_pretraining, task_train_config)
from model.trainer import TrainConfig

from app.cli.launch import add_launch_options, relaunch, wants_launcher
from app.cli.progress import ProgressBar, SignalStop


def _run_with_progress(run, spec) -> int:
    """Run a spec with a progress bar and Ctrl-C handling. Under torchrun, rank 0 alone draws and prints."""
    main_rank = env_dist().is_main
    # The run functions and the data pipeline log what they do (tokenising, warm start) at INFO.
    logging.basicConfig(level=logging.INFO if main_rank else logging.WARNING, format="%(message)s",
                        stream=sys.stderr)
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
    if not main_rank:
        return 0
    if result.stopped:
        print(f"stopped at step {result.step}/{result.total_steps}; checkpoint {result.checkpoint}. "
              "Run the same command to resume.")
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
    _set_threads(args)
    if args.from_model and args.config:
        raise UserError("give --from (warm start) or --config (from scratch), not both")
    if args.freeze_encoder and not args.from_model:
        raise UserError("--freeze-encoder needs --from MODEL_DIR (a fresh encoder has nothing worth freezing)")
    spec = PretrainSpec(
        corpus=_existing_corpus(args.corpus), out=args.out, from_model=args.from_model, config=args.config,
        vocab=args.vocab, corpus_format=args.format, text_field=args.text_field,
        eval_corpus=_existing_corpus(args.eval_corpus) if args.eval_corpus else None, eval_fraction=args.eval_fraction,
        nsp=not args.no_nsp, batch_size=args.batch_size, max_seq_len=args.max_seq_len,
        masked_lm_prob=args.mlm_probability, whole_word_mask=args.whole_word_mask, cache_dir=args.cache_dir,
        freeze_encoder=args.freeze_encoder,
        resume=args.resume, train=_train_config(args, default_train_config(PretrainSpec)))
    return _run_with_progress(run_pretraining, spec)


def cmd_finetune(args: argparse.Namespace) -> int:
    if wants_launcher(args):
        return relaunch(args, args.argv)
    _set_threads(args)
    if args.regression and args.task != "sequence-classification":
        raise UserError(f"--regression is for --task sequence-classification, not {args.task}")
    spec = FinetuneSpec(
        train_file=_existing_file(args.train), from_model=args.from_model, out=args.out, task=args.task,
        eval_file=_existing_file(args.eval) if args.eval else None, eval_fraction=args.eval_fraction,
        group_column=args.group_column, text_column=args.text_column, text_pair_column=args.text_pair_column,
        label_column=args.label_column, regression=args.regression, batch_size=args.batch_size,
        max_seq_len=args.max_seq_len, doc_stride=args.doc_stride, max_query_length=args.max_query_length,
        max_answer_len=args.max_answer_len, resume=args.resume,
        train=_train_config(args, task_train_config(args.task)))
    return _run_with_progress(run_finetuning, spec)


def cmd_evaluate(args: argparse.Namespace) -> int:
    _set_threads(args)
    metrics = evaluate_model(args.model, _existing_corpus(args.data), corpus_format=args.format,
                             text_column=args.text_column, text_pair_column=args.text_pair_column,
                             label_column=args.label_column, batch_size=args.batch_size,
                             max_seq_len=args.max_seq_len, seed=args.seed, max_batches=args.max_batches,
                             device=args.device, precision=args.precision, doc_stride=args.doc_stride,
                             max_query_length=args.max_query_length, max_answer_len=args.max_answer_len)
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


def _train_config(args: argparse.Namespace, default: TrainConfig) -> TrainConfig:
    overrides = {name: getattr(args, name) for name in
                 ("max_steps", "epochs", "lr", "weight_decay", "grad_accum_steps", "max_grad_norm", "seed",
                  "eval_every", "eval_on_start", "save_every", "keep_last", "log_every", "precision", "device",
                  "compile")
                 if getattr(args, name, None) is not None}
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


def _add_training_options(p: argparse.ArgumentParser, default: TrainConfig) -> None:
    g = p.add_argument_group("training")
    g.add_argument("--out", required=True, metavar="RUN_DIR",
                   help="run directory: metrics.jsonl, training.svg, checkpoints/, model/")
    g.add_argument("--max-steps", type=int, help=f"optimizer steps (default {default.max_steps or 'from --epochs'})")
    g.add_argument("--batch-size", type=int, default=32)
    g.add_argument("--max-seq-len", type=int, default=128)
    g.add_argument("--lr", type=float, help=f"peak learning rate (default {default.lr:g})")
    g.add_argument("--warmup", help="warmup steps (e.g. 500) or fraction of the run (e.g. 0.1)")
    g.add_argument("--weight-decay", type=float, help=f"AdamW weight decay on matrices (default {default.weight_decay})")
    g.add_argument("--grad-accum", dest="grad_accum_steps", type=int, help="micro-batches per optimizer step")
    g.add_argument("--max-grad-norm", type=float, help="gradient clipping norm (default 1.0)")
    g.add_argument("--save-every", type=int, help="checkpoint every N steps (default: only at the end)")
    g.add_argument("--eval-every", type=int, help="evaluate every N steps (default: only at the end)")
    g.add_argument("--eval-on-start", action="store_true", default=None, help="also evaluate before the first step")
    g.add_argument("--keep-last", type=int, help=f"checkpoints kept besides the best (default {default.keep_last})")
    g.add_argument("--log-every", type=int, help=f"steps between progress updates (default {default.log_every})")
    g.add_argument("--seed", type=int, help="seed for init, data order, masking and dropout (default 0)")
    g.add_argument("--precision", choices=("auto", "fp32", "bf16"),
                   help="bf16 autocast or fp32 (default auto: bf16 on CUDA, fp32 on CPU)")
    g.add_argument("--device", help="cpu, cuda, cuda:N (default auto)")
    g.add_argument("--compile", action="store_true", default=None,
                   help="torch.compile the training step (compiling takes the first steps; measure first)")
    g.add_argument("--threads", type=int, help="CPU threads for torch (default: torch's choice; on a busy "
                                               "machine 1 can be several times faster)")
    g.add_argument("--resume", action=argparse.BooleanOptionalAction, default=True,
                   help="continue from RUN_DIR's latest complete checkpoint (default); --no-resume refuses "
                        "a RUN_DIR that has one")
    add_launch_options(p)


def add_commands(sub) -> None:
    """Register pretrain, finetune and evaluate on the `bert` command's subparsers."""
    _add_pretrain(sub)
    _add_finetune(sub)
    _add_evaluate(sub)


def _add_pretrain(sub) -> None:
    pre_default = default_train_config(PretrainSpec)
    p = sub.add_parser("pretrain", help="pretrain BERT (MLM + NSP) on a text corpus, from scratch or warm-started")
    p.add_argument("--corpus", required=True,
                   help="pairs (A<TAB>B), google (sentence per line), text or jsonl file, or a token store directory")
    p.add_argument("--format", choices=("pairs", "google", "text", "jsonl"), help="corpus format (default: detect)")
    p.add_argument("--text-field", default="text", help="JSONL field with the text")
    p.add_argument("--eval-corpus",
                   help="held-out corpus or token store (default: hold out --eval-fraction of the documents)")
    p.add_argument("--eval-fraction", type=float, default=0.02, help="share of documents held out (0: no eval)")
    p.add_argument("--from", dest="from_model", metavar="MODEL_DIR", help="warm start from a model directory")
    p.add_argument("--config", help="from scratch: tiny, small, base, or a config.json")
    p.add_argument("--vocab", metavar="DIR", help="tokenizer directory (vocab.txt or tokenizer.json)")
    p.add_argument("--no-nsp", action="store_true", help="masked LM only (BertForMaskedLM)")
    p.add_argument("--freeze-encoder", action="store_true",
                   help="train only the heads (and pooler) of a warm-started model; the encoder stays as loaded")
    p.add_argument("--mlm-probability", type=float, default=0.15)
    p.add_argument("--whole-word-mask", action="store_true")
    p.add_argument("--cache-dir", help="where tokenised corpora are cached (default: beside the corpus)")
    _add_training_options(p, pre_default)
    p.set_defaults(func=cmd_pretrain)


def _add_finetune(sub) -> None:
    ft_default = default_train_config(FinetuneSpec)
    p = sub.add_parser("finetune", help="fine-tune a model directory as a text classifier (or regressor), "
                                        "a token classifier (NER) or an extractive QA model")
    p.add_argument("--task", choices=TASKS, default=TASKS[0],
                   help="sequence-classification (default; a table), token-classification (CoNLL or JSONL "
                        "tokens/tags; best checkpoint by entity f1) or question-answering (SQuAD v1.1/v2.0 JSON; "
                        "best checkpoint by f1)")
    p.add_argument("--train", required=True, help="CSV, TSV or JSONL with text[, text_pair], label; CoNLL or "
                                                  "JSONL {tokens, tags} (token-classification); SQuAD JSON (QA)")
    p.add_argument("--eval", help="held-out file (default: hold out --eval-fraction of --train)")
    p.add_argument("--eval-fraction", type=float, default=0.1)
    p.add_argument("--group-column", help="hold out whole groups of this column (e.g. a film)")
    p.add_argument("--from", dest="from_model", required=True, metavar="MODEL_DIR")
    p.add_argument("--epochs", type=float, help=f"passes over the data (default {ft_default.epochs:g}) "
                                                "unless --max-steps is given")
    p.add_argument("--regression", action="store_true", help="float labels, MSE loss")
    _add_table_options(p)
    _add_qa_options(p)
    _add_training_options(p, ft_default)
    p.set_defaults(func=cmd_finetune)


def _add_evaluate(sub) -> None:
    p = sub.add_parser("evaluate", help="MLM/NSP, classification, NER or QA metrics of a model on a data file")
    p.add_argument("--model", required=True, metavar="DIR", help="model directory or run directory")
    p.add_argument("--data", required=True, help="corpus or token store (MLM models), labelled table (classifiers), "
                                                 "CoNLL/JSONL tagged sentences (token classifiers) or SQuAD JSON (QA models)")
    p.add_argument("--format", choices=("pairs", "google", "text", "jsonl"), help="corpus format (default: detect)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-seq-len", type=int, default=128)
    p.add_argument("--max-batches", type=int, help="evaluate at most N batches")
    p.add_argument("--seed", type=int, default=0, help="masking seed for corpora")
    p.add_argument("--device", default="auto")
    p.add_argument("--precision", choices=("auto", "fp32", "bf16"), default="auto")
    p.add_argument("--threads", type=int, help="CPU threads for torch (default: torch's choice)")
    p.add_argument("--json", action="store_true",
                   help="print the metrics as JSON: f1, precision, recall, accuracy (NER); exact_match, f1 (QA)")
    _add_table_options(p)
    _add_qa_options(p)
    p.set_defaults(func=cmd_evaluate)


def _add_table_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--text-column", default="text")
    p.add_argument("--text-pair-column", default="text_pair")
    p.add_argument("--label-column", default="label")


def _add_qa_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("question answering")
    g.add_argument("--doc-stride", type=int, help="context tokens that windows of a long context share "
                                                  "(default 128, or half a short window's context)")
    g.add_argument("--max-query-length", type=int, default=64, help="question tokens kept (default 64)")
    g.add_argument("--max-answer-len", type=int, default=30, help="longest answer in tokens when evaluating "
                                                                  "(default 30)")
