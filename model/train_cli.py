"""`bert pretrain`, `bert finetune`, `bert evaluate`, and the job functions behind them.

The CLI and the Celery worker run the same code; only the callbacks differ (a tqdm bar here, progress
updates there):

    result = run_pretraining(PretrainJob.from_dict(spec), callbacks=[progress])   # -> TrainResult
    result = run_finetuning(FinetuneJob.from_dict(spec), callbacks=[progress])
    metrics = evaluate_model("runs/x/model", "eval.csv")

A run directory (`out`) holds metrics.jsonl, training.svg, checkpoints/step-N/ and, when the run
completes, model/ (a normal model directory). Running a job again on the same directory resumes
from its latest complete checkpoint (`resume=False` refuses to touch a directory that has one).
User mistakes (missing files, bad options) raise `model.cli.UserError`, which the CLI prints as one
line with exit status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from . import checkpoint as ckpt
from .cli import UserError
from .config import BertConfig
from .modeling import (
    HEAD_NAMES,
    MODEL_CLASSES,
    BertForMaskedLM,
    BertForPreTraining,
    BertForSequenceClassification,
    heads_in,
    load_model,
)
from .tokenizer import BertTokenizer
from .trainer import Callback, TrainConfig, Trainer, TrainResult, evaluate, seed_everything

log = logging.getLogger(__name__)

# Model shapes for training from scratch (Turc et al. 2019 "Well-Read Students Learn Better": BERT-Tiny
# and BERT-Small; BERT-Base from the paper). vocab_size comes from the tokenizer.
MODEL_PRESETS = {
    "tiny": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=512),
    "small": dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, intermediate_size=2048),
    "base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072),
}


# ---------------------------------------------------------------------------- job specifications

@dataclass
class PretrainJob:
    corpus: str  # text corpus: pairs (A<TAB>B), google (sentence per line), text, or jsonl
    out: str  # run directory
    from_model: str | None = None  # warm start: any model directory (encoder weights kept, heads added)
    config: str | None = None  # from scratch: "tiny" | "small" | "base" | path to a config.json
    vocab: str | None = None  # tokenizer directory (needed with `config`; default: the from_model's)
    corpus_format: str | None = None  # None = detect from the file
    text_field: str = "text"  # JSONL field holding the text
    eval_corpus: str | None = None  # held-out corpus; None = hold out `eval_fraction` of the documents
    eval_fraction: float = 0.02  # share of documents held out when there is no eval_corpus (0 = none)
    eval_max_documents: int = 1000  # cap on held-out documents, so evaluation stays quick
    nsp: bool = True  # next-sentence prediction (BertForPreTraining); False = MLM only (BertForMaskedLM)
    batch_size: int = 32
    max_seq_len: int = 128
    masked_lm_prob: float = 0.15
    whole_word_mask: bool = False
    freeze_encoder: bool = False  # train only the heads (and pooler); embeddings and layers stay as loaded
    cache_dir: str | None = None  # token cache; None = beside the corpus if writable, else out/cache
    resume: bool = True  # continue from out/checkpoints when it has a complete checkpoint
    train: TrainConfig = field(default_factory=lambda: TrainConfig(max_steps=1000, lr=1e-4, warmup_ratio=0.01))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "PretrainJob":
        return _job_from_dict(cls, data)


@dataclass
class FinetuneJob:
    train_file: str  # CSV, TSV or JSONL (optionally .gz/.bz2) with text[, text_pair], label columns
    from_model: str  # model directory to start from (with its tokenizer)
    out: str  # run directory
    eval_file: str | None = None  # None = hold out eval_fraction of train_file
    eval_fraction: float = 0.1
    group_column: str | None = None  # hold out whole groups (e.g. one film's reviews) when splitting
    text_column: str = "text"
    text_pair_column: str | None = "text_pair"  # used when the file has it
    label_column: str = "label"
    regression: bool = False  # float labels, MSE loss, one output
    batch_size: int = 32
    max_seq_len: int = 128
    resume: bool = True
    train: TrainConfig = field(default_factory=lambda: TrainConfig(epochs=3, lr=2e-5, warmup_ratio=0.1))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "FinetuneJob":
        return _job_from_dict(cls, data)


def _job_from_dict(cls, data: dict[str, Any]):
    """A job from JSON: unknown keys are errors; `train` overrides the job's default TrainConfig."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"unknown {cls.__name__} field(s) {unknown}; known: {sorted(known)}")
    base = {k: v for k, v in data.items() if k != "train"}
    return cls(**base, train=merge_train_config(default_train_config(cls), data.get("train") or {}))


def default_train_config(job_class) -> TrainConfig:
    return job_class.__dataclass_fields__["train"].default_factory()


def merge_train_config(default: TrainConfig, overrides: dict[str, Any]) -> TrainConfig:
    """`default` with `overrides`; giving max_steps (or epochs) alone clears the other one."""
    values = {**default.to_dict(), **overrides}
    if "max_steps" in overrides and "epochs" not in overrides:
        values["epochs"] = None
    if "epochs" in overrides and "max_steps" not in overrides:
        values["max_steps"] = None
    if "warmup_ratio" in overrides and "warmup_steps" not in overrides:
        values["warmup_steps"] = None
    unknown = sorted(set(values) - {f.name for f in dataclasses.fields(TrainConfig)})
    if unknown:
        raise ValueError(f"unknown TrainConfig field(s) {unknown}")
    return TrainConfig(**values)


# ---------------------------------------------------------------------------- running jobs

def run_pretraining(job: PretrainJob, callbacks: Sequence[Callback] = ()) -> TrainResult:
    """Pretrain (MLM + NSP, or MLM only) from scratch, from a warm start, or resume; see PretrainJob."""
    out = Path(job.out)
    resume_from = _resume_point(out, job.resume)
    with _user_errors():
        tokenizer, model = _pretraining_model(job, resume_from)
        train_data, eval_data = _pretraining_data(job, tokenizer)
        train_data.num_batches(0)  # plans the first epoch now, so a corpus too small is a user error
        trainer = Trainer(model, train_data, job.train, run_dir=out, eval_data=eval_data,
                          tokenizer=tokenizer, callbacks=callbacks)
    return trainer.fit(resume=resume_from or False)


def run_finetuning(job: FinetuneJob, callbacks: Sequence[Callback] = ()) -> TrainResult:
    """Fine-tune a sequence classifier (or regressor) from any model directory; see FinetuneJob."""
    from .data import ClassificationBatches, load_classification_data

    out = Path(job.out)
    resume_from = _resume_point(out, job.resume)
    with _user_errors():
        data = load_classification_data(
            job.train_file, job.eval_file, text_column=job.text_column, text_pair_column=job.text_pair_column,
            label_column=job.label_column, regression=job.regression, eval_fraction=job.eval_fraction,
            group_column=job.group_column, seed=job.train.seed)
        seed_everything(job.train.seed)
        if resume_from is not None:
            tokenizer, model = _model_from_checkpoint(resume_from)
        else:
            tokenizer = _tokenizer_of(job.from_model)
            model = BertForSequenceClassification.from_pretrained(job.from_model, init_missing_heads=True,
                                                                  **data.config_updates())
        _check_seq_len(job.max_seq_len, model.config)
        kw = dict(batch_size=job.batch_size, max_seq_len=job.max_seq_len, regression=data.regression)
        train_data = ClassificationBatches(data.train, tokenizer, seed=job.train.seed, **kw)
        eval_data = ClassificationBatches(data.eval, tokenizer, shuffle=False, **kw) if data.eval else None
        trainer = Trainer(model, train_data, job.train, run_dir=out, eval_data=eval_data,
                          tokenizer=tokenizer, callbacks=callbacks)
    return trainer.fit(resume=resume_from or False)


def evaluate_model(model_dir: str | Path, data_path: str | Path, *, corpus_format: str | None = None,
                   text_column: str = "text", text_pair_column: str | None = "text_pair",
                   label_column: str = "label", batch_size: int = 32, max_seq_len: int = 128, seed: int = 0,
                   max_batches: int | None = None, device: str = "auto", precision: str = "auto") -> dict:
    """Metrics of a model directory (or a run directory's model/) on a corpus or a labelled table."""
    from .data import ClassificationBatches, PretrainingData, load_classification_data, load_corpus
    from .trainer import resolve_device, resolve_precision

    model_dir = _model_dir_of(Path(model_dir))
    with _user_errors():
        model, tokenizer = load_model(model_dir), _tokenizer_of(model_dir)
        _check_seq_len(max_seq_len, model.config)
        if isinstance(model, BertForSequenceClassification):
            labels = [model.config.id2label[i] for i in sorted(model.config.id2label)]
            regression = model.num_labels == 1
            table = load_classification_data(data_path, data_path, text_column=text_column,
                                             text_pair_column=text_pair_column, label_column=label_column,
                                             regression=regression, labels=None if regression else labels)
            data = ClassificationBatches(table.eval, tokenizer, batch_size=batch_size, max_seq_len=max_seq_len,
                                         shuffle=False, regression=regression)
        elif isinstance(model, (BertForPreTraining, BertForMaskedLM)):
            corpus = load_corpus(data_path, tokenizer, format=corpus_format, cache_dir=_cache_dir(None, Path(data_path), None))
            data = PretrainingData(corpus, tokenizer, batch_size=batch_size, max_seq_len=max_seq_len, seed=seed,
                                   nsp=isinstance(model, BertForPreTraining))
        else:
            raise UserError(f"{model_dir} has no MLM or classifier head: nothing to evaluate")
        dev = resolve_device(device)
        metrics = evaluate(model.to(dev), data, device=dev, precision=resolve_precision(precision, dev),
                           max_batches=max_batches)
    return {"model": str(model_dir), "data": str(data_path), **metrics}


# ---------------------------------------------------------------------------- job parts

@contextlib.contextmanager
def _user_errors():
    """Turn the ValueError/FileNotFoundError of loading files and options into the one-line UserError."""
    try:
        yield
    except UserError:
        raise
    except (ValueError, FileNotFoundError) as e:
        raise UserError(str(e)) from None


def _resume_point(out: Path, resume: bool) -> Path | None:
    latest = ckpt.latest_checkpoint(out)
    if latest is not None and not resume:
        raise UserError(f"{out} already has checkpoints (latest: {latest.name}); resume it, "
                        "or choose another output directory")
    return latest


def _model_dir_of(path: Path) -> Path:
    if not (path / "config.json").is_file() and (path / "model" / "config.json").is_file():
        return path / "model"  # a run directory
    if not path.is_dir():
        raise UserError(f"model directory {path} does not exist")
    if not (path / "config.json").is_file():
        raise UserError(f"{path} has no config.json: not a model directory")
    return path


def _tokenizer_of(path: str | Path | None) -> BertTokenizer:
    path = Path(path) if path else None
    if path is None or not path.is_dir():
        raise UserError(f"tokenizer directory {path} does not exist")
    if not ((path / "tokenizer.json").is_file() or (path / "vocab.txt").is_file()):
        raise UserError(f"{path} has no vocab.txt or tokenizer.json")
    return BertTokenizer.from_pretrained(path)


def _model_from_checkpoint(path: Path):
    """A model of the checkpoint's class and config (weights are loaded by the trainer) and its tokenizer."""
    config = BertConfig.from_json_file(path / "config.json")
    cls = MODEL_CLASSES[(config.architectures or ["BertForPreTraining"])[0]]
    return BertTokenizer.from_pretrained(path), cls(config)


def _pretraining_model(job: PretrainJob, resume_from: Path | None):
    seed_everything(job.train.seed)  # model init (fresh weights or new heads) is part of the seeded run
    cls = BertForPreTraining if job.nsp else BertForMaskedLM
    if resume_from is not None:
        tokenizer, model = _model_from_checkpoint(resume_from)
    elif job.from_model:
        src = _model_dir_of(Path(job.from_model))
        tokenizer = _tokenizer_of(job.vocab or src)
        model = cls.from_pretrained(src, init_missing_heads=True)
        new = sorted(model.heads - heads_in(src))
        if new:
            log.info("warm start from %s: new %s", src, ", ".join(HEAD_NAMES[h] for h in new))
    elif job.config:
        if not job.vocab:
            raise UserError("--config needs --vocab DIR (a tokenizer directory; make one with `bert vocab`)")
        tokenizer = _tokenizer_of(job.vocab)
        model = cls(_scratch_config(job.config, tokenizer))
    else:
        raise UserError("say where the model comes from: --from MODEL_DIR (warm start) or --config tiny|small|base|FILE")
    if tokenizer.vocab_size != model.config.vocab_size:
        raise UserError(f"tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is "
                        f"{model.config.vocab_size}")
    _check_seq_len(job.max_seq_len, model.config)
    if job.freeze_encoder:
        freeze_encoder(model)
    return tokenizer, model


def freeze_encoder(model) -> None:
    """Heads-only training: embeddings and encoder layers get no gradient (the pooler and heads do).

    The MLM decoder's weight is the word-embedding matrix, so it stays frozen too; its bias trains.
    """
    for module in (model.bert.embeddings, model.bert.encoder):
        module.requires_grad_(False)


def _scratch_config(name: str, tokenizer: BertTokenizer) -> BertConfig:
    vocab = {"vocab_size": tokenizer.vocab_size, "pad_token_id": tokenizer.pad_token_id}
    if name in MODEL_PRESETS:
        return BertConfig(**MODEL_PRESETS[name], **vocab)
    path = Path(name)
    if not path.is_file():
        raise UserError(f"--config {name!r} is neither a preset ({', '.join(MODEL_PRESETS)}) nor a JSON file")
    return BertConfig.from_dict({**BertConfig.from_json_file(path).to_dict(), **vocab})


def _check_seq_len(max_seq_len: int, config: BertConfig) -> None:
    if max_seq_len > config.max_position_embeddings:
        raise UserError(f"--max-seq-len {max_seq_len} exceeds the model's max_position_embeddings "
                        f"{config.max_position_embeddings}")


def _cache_dir(explicit: str | None, corpus: Path, out: Path | None) -> Path | None:
    if explicit:
        return Path(explicit)
    if os.access(corpus.parent, os.W_OK) or out is None:
        return None  # beside the corpus, shared by every run on it
    return out / "cache"


def _pretraining_data(job: PretrainJob, tokenizer: BertTokenizer):
    from .data import PretrainingData, load_corpus

    def corpus_of(path: str):
        return load_corpus(path, tokenizer, format=job.corpus_format, text_field=job.text_field,
                           cache_dir=_cache_dir(job.cache_dir, Path(path), Path(job.out)))

    corpus, eval_corpus = corpus_of(job.corpus), None
    if job.eval_corpus:
        eval_corpus = corpus_of(job.eval_corpus)
    elif job.eval_fraction > 0:
        corpus, eval_corpus = holdout_documents(corpus, job.eval_fraction, job.eval_max_documents,
                                                min_documents=2 if job.nsp else 1)
    kw = dict(batch_size=job.batch_size, max_seq_len=job.max_seq_len, seed=job.train.seed, nsp=job.nsp,
              masked_lm_prob=job.masked_lm_prob, whole_word_mask=job.whole_word_mask)
    train = PretrainingData(corpus, tokenizer, **kw)
    return train, PretrainingData(eval_corpus, tokenizer, **kw) if eval_corpus is not None else None


def holdout_documents(corpus, fraction: float, max_documents: int, min_documents: int = 2):
    """(train, eval) views of a TokenizedCorpus: the last documents are held out (no copy: array slices).

    Returns (corpus, None) when the corpus is too small to spare `min_documents` on each side.
    """
    from .data import TokenizedCorpus

    n = corpus.num_documents
    k = min(max(min_documents, round(n * fraction)), max_documents)
    if n - k < min_documents or k < 1:
        return corpus, None
    d = n - k
    s = int(corpus.document_offsets[d])  # first held-out sentence
    t = int(corpus.sentence_offsets[s])  # its first token
    train = TokenizedCorpus(corpus.path, corpus.format, corpus.tokens[:t], corpus.sentence_offsets[: s + 1],
                            corpus.document_offsets[: d + 1])
    held = TokenizedCorpus(corpus.path, corpus.format, corpus.tokens[t:], corpus.sentence_offsets[s:] - t,
                           corpus.document_offsets[d:] - s)
    return train, held


# ---------------------------------------------------------------------------- CLI callbacks

class ProgressBar(Callback):
    """A tqdm bar: step, loss, lr, tokens/s; tqdm shows the ETA. Evaluations print above it."""

    def __init__(self, stream=None):
        self.stream, self.bar = stream or sys.stderr, None

    def on_step(self, state: dict[str, Any]) -> None:
        from tqdm import tqdm

        if self.bar is None:
            self.bar = tqdm(total=state["total_steps"], initial=0, unit="step", file=self.stream, dynamic_ncols=True)
        self.bar.update(state["step"] - self.bar.n)
        self.bar.set_postfix_str(f"loss={state['loss']:.4f} lr={state['lr']:.2e} tok/s={state['tokens_per_s']:,.0f} "
                                 f"epoch={state['epoch']:.2f}")

    def on_eval(self, metrics: dict[str, Any]) -> None:
        self._write(f"step {metrics['step']}: eval " + _format_metrics(metrics))

    def _write(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line, file=self.stream)
        else:
            print(line, file=self.stream)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class SignalStop(Callback):
    """First Ctrl-C (or SIGTERM) asks the loop to stop after this step, saving a checkpoint; a second Ctrl-C aborts."""

    def __init__(self):
        self.requested = False
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "SignalStop":
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame) -> None:
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True
        print("\nstopping after this step (a checkpoint is saved; Ctrl-C again to abort)", file=sys.stderr)

    def should_stop(self) -> bool:
        return self.requested


def _format_metrics(metrics: dict[str, Any]) -> str:
    skip = {"type", "step", "model", "data"}
    return " ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items() if k not in skip)


def _run_with_progress(run, job) -> int:
    # The job layer and the data pipeline log what they do (tokenising, warm start) at INFO.
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    bar = ProgressBar()
    latest = ckpt.latest_checkpoint(job.out)
    if latest is not None and job.resume:
        print(f"resuming from {latest}", file=sys.stderr)
    with SignalStop() as stop:
        try:
            result = run(job, callbacks=[bar, stop])
        finally:
            bar.close()
    if result.stopped:
        print(f"stopped at step {result.step}/{result.total_steps}; checkpoint {result.checkpoint}. "
              "Run the same command to resume.")
        return 130 if stop.requested else 0
    print(f"done: {result.step} steps; final model in {result.model_dir}")
    if result.eval_metrics:
        print("eval: " + _format_metrics(result.eval_metrics))
    return 0


# ---------------------------------------------------------------------------- commands

def _set_threads(args: argparse.Namespace) -> None:
    if args.threads is not None:
        if args.threads < 1:
            raise UserError(f"--threads must be >= 1, got {args.threads}")
        import torch

        torch.set_num_threads(args.threads)


def cmd_pretrain(args: argparse.Namespace) -> int:
    _set_threads(args)
    if args.from_model and args.config:
        raise UserError("give --from (warm start) or --config (from scratch), not both")
    if args.freeze_encoder and not args.from_model:
        raise UserError("--freeze-encoder needs --from MODEL_DIR (a fresh encoder has nothing worth freezing)")
    job = PretrainJob(
        corpus=_existing_file(args.corpus), out=args.out, from_model=args.from_model, config=args.config,
        vocab=args.vocab, corpus_format=args.format, text_field=args.text_field,
        eval_corpus=_existing_file(args.eval_corpus) if args.eval_corpus else None, eval_fraction=args.eval_fraction,
        nsp=not args.no_nsp, batch_size=args.batch_size, max_seq_len=args.max_seq_len,
        masked_lm_prob=args.mlm_probability, whole_word_mask=args.whole_word_mask, cache_dir=args.cache_dir,
        freeze_encoder=args.freeze_encoder,
        resume=args.resume, train=_train_config(args, default_train_config(PretrainJob)))
    return _run_with_progress(run_pretraining, job)


def cmd_finetune(args: argparse.Namespace) -> int:
    _set_threads(args)
    job = FinetuneJob(
        train_file=_existing_file(args.train), from_model=args.from_model, out=args.out,
        eval_file=_existing_file(args.eval) if args.eval else None, eval_fraction=args.eval_fraction,
        group_column=args.group_column, text_column=args.text_column, text_pair_column=args.text_pair_column,
        label_column=args.label_column, regression=args.regression, batch_size=args.batch_size,
        max_seq_len=args.max_seq_len, resume=args.resume,
        train=_train_config(args, default_train_config(FinetuneJob)))
    return _run_with_progress(run_finetuning, job)


def cmd_evaluate(args: argparse.Namespace) -> int:
    _set_threads(args)
    metrics = evaluate_model(args.model, _existing_file(args.data), corpus_format=args.format,
                             text_column=args.text_column, text_pair_column=args.text_pair_column,
                             label_column=args.label_column, batch_size=args.batch_size,
                             max_seq_len=args.max_seq_len, seed=args.seed, max_batches=args.max_batches,
                             device=args.device, precision=args.precision)
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


def _train_config(args: argparse.Namespace, default: TrainConfig) -> TrainConfig:
    overrides = {name: getattr(args, name) for name in
                 ("max_steps", "epochs", "lr", "weight_decay", "grad_accum_steps", "max_grad_norm", "seed",
                  "eval_every", "eval_on_start", "save_every", "keep_last", "log_every", "precision", "device")
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
    g.add_argument("--threads", type=int, help="CPU threads for torch (default: torch's choice; on a busy "
                                               "machine 1 can be several times faster)")
    g.add_argument("--resume", action=argparse.BooleanOptionalAction, default=True,
                   help="continue from RUN_DIR's latest complete checkpoint (default); --no-resume refuses "
                        "a RUN_DIR that has one")


def add_commands(sub) -> None:
    """Register pretrain, finetune and evaluate on the `bert` command's subparsers."""
    pre_default = default_train_config(PretrainJob)
    p = sub.add_parser("pretrain", help="pretrain BERT (MLM + NSP) on a text corpus, from scratch or warm-started")
    p.add_argument("--corpus", required=True, help="pairs (A<TAB>B), google (sentence per line), text or jsonl file")
    p.add_argument("--format", choices=("pairs", "google", "text", "jsonl"), help="corpus format (default: detect)")
    p.add_argument("--text-field", default="text", help="JSONL field with the text")
    p.add_argument("--eval-corpus", help="held-out corpus (default: hold out --eval-fraction of the documents)")
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

    ft_default = default_train_config(FinetuneJob)
    p = sub.add_parser("finetune", help="fine-tune a model directory as a text classifier (or regressor)")
    p.add_argument("--train", required=True, help="CSV, TSV or JSONL with text[, text_pair], label")
    p.add_argument("--eval", help="held-out file (default: hold out --eval-fraction of --train)")
    p.add_argument("--eval-fraction", type=float, default=0.1)
    p.add_argument("--group-column", help="hold out whole groups of this column (e.g. a film)")
    p.add_argument("--from", dest="from_model", required=True, metavar="MODEL_DIR")
    p.add_argument("--epochs", type=float, help=f"passes over the data (default {ft_default.epochs:g}) "
                                                "unless --max-steps is given")
    p.add_argument("--regression", action="store_true", help="float labels, MSE loss")
    _add_table_options(p)
    _add_training_options(p, ft_default)
    p.set_defaults(func=cmd_finetune)

    p = sub.add_parser("evaluate", help="MLM/NSP or classification metrics of a model on a data file")
    p.add_argument("--model", required=True, metavar="DIR", help="model directory or run directory")
    p.add_argument("--data", required=True, help="corpus (MLM models) or labelled table (classifiers)")
    p.add_argument("--format", choices=("pairs", "google", "text", "jsonl"), help="corpus format (default: detect)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-seq-len", type=int, default=128)
    p.add_argument("--max-batches", type=int, help="evaluate at most N batches")
    p.add_argument("--seed", type=int, default=0, help="masking seed for corpora")
    p.add_argument("--device", default="auto")
    p.add_argument("--precision", choices=("auto", "fp32", "bf16"), default="auto")
    p.add_argument("--threads", type=int, help="CPU threads for torch (default: torch's choice)")
    p.add_argument("--json", action="store_true")
    _add_table_options(p)
    p.set_defaults(func=cmd_evaluate)


def _add_table_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--text-column", default="text")
    p.add_argument("--text-pair-column", default="text_pair")
    p.add_argument("--label-column", default="label")
