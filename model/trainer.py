"""A model-agnostic training loop that reports through callbacks (after karpathy/minGPT's trainer.py).

The loop knows only that `model(**batch).loss` is a scalar to minimise. Everything else, a tqdm bar,
a Celery progress update, a stop request, enters through `Callback` objects, so model/ never learns
about the CLI or the worker:

    trainer = Trainer(model, train_data, TrainConfig(lr=1e-4, max_steps=1000), run_dir="runs/x",
                      eval_data=eval_data, tokenizer=tok, callbacks=[my_callback])
    result = trainer.fit(resume=True)        # continue from runs/x/checkpoints/ if a checkpoint is there

Data is anything with `num_batches(epoch) -> int` and `iter_batches(epoch, start_batch) -> iterator of
dict[str, Tensor]` whose batches are a pure function of (seed, epoch, batch index): the checkpoint
stores (epoch, batch), the RNG states and the optimizer, so a resumed run is bit-identical on CPU.

Optimisation is BERT's (Devlin et al. 2018, appendix A.2): AdamW with decoupled weight decay on
matrices only (biases and LayerNorm excluded, nanoGPT's `configure_optimizers` rule: dim >= 2),
linear warmup then linear decay to zero (HF's `get_linear_schedule_with_warmup`), gradient
clipping, gradient accumulation, optional bf16 autocast.

Evaluation (`evaluate`): pretraining models report MLM loss/accuracy/perplexity over the predicted
tokens and NSP loss/accuracy; classifiers report accuracy and macro-F1 (regression: MSE).
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Protocol, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from . import checkpoint as ckpt
from .files import atomic_write_bytes, read_jsonl
from .modeling import IGNORE_INDEX, BertForSequenceClassification
from .plot import write_training_plot
from .device import resolve_device
from .precision import autocast, resolve_precision

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "training.svg"
FINAL_MODEL = "model"
PRECISIONS = ("auto", "fp32", "bf16")


@dataclass
class TrainConfig:
    lr: float = 1e-4  # peak learning rate, reached at the end of warmup (BERT pretraining: 1e-4)
    weight_decay: float = 0.01  # AdamW decoupled decay, on weight matrices only (BERT: 0.01)
    adam_betas: tuple[float, float] = (0.9, 0.999)  # BERT's values
    adam_eps: float = 1e-6  # BERT's value (torch's default 1e-8 is for other models)
    max_steps: int | None = None  # optimizer steps to train; None = `epochs` passes over the data
    epochs: float | None = None  # used only when max_steps is None (fine-tuning: 2-4 in the paper)
    warmup_steps: int | None = None  # linear warmup length; None = warmup_ratio * total steps
    warmup_ratio: float = 0.0  # fraction of total steps to warm up over when warmup_steps is None
    grad_accum_steps: int = 1  # micro-batches per optimizer step: effective batch = batch size x this
    max_grad_norm: float | None = 1.0  # clip the global gradient norm (BERT: 1.0); None = no clipping
    seed: int = 0  # seeds torch/numpy/random at the start of a fresh run (dropout stream)
    eval_every: int = 0  # evaluate every N steps (0: only at the end); needs eval data
    eval_on_start: bool = False  # also evaluate before the first step (a baseline for the curve)
    save_every: int = 0  # checkpoint every N steps (0: only at the end and on stop)
    keep_last: int = 2  # checkpoints kept besides the best one; older ones are deleted
    best_metric: str = "loss"  # eval metric that picks the best checkpoint
    greater_is_better: bool = False  # False for losses, True for accuracy/F1
    log_every: int = 10  # call on_step (and write metrics.jsonl) every N steps
    precision: str = "auto"  # "fp32" | "bf16" (autocast) | "auto": bf16 on CUDA, fp32 on CPU
    device: str = "auto"  # "cpu", "cuda", "cuda:1", or "auto" (CUDA when available)
    max_eval_batches: int | None = None  # cap on eval batches per evaluation (None: all)

    def __post_init__(self) -> None:
        self.adam_betas = tuple(self.adam_betas)
        if self.max_steps is None and self.epochs is None:
            raise ValueError("set max_steps or epochs")
        for name in ("max_steps", "warmup_steps"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < (1 if name == "max_steps" else 0)):
                raise ValueError(f"{name} must be a {'positive' if name == 'max_steps' else 'non-negative'} "
                                 f"integer, got {value!r}")
        for name in ("grad_accum_steps", "log_every"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        for name in ("eval_every", "save_every", "keep_last"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {getattr(self, name)!r}")
        if self.epochs is not None and self.epochs <= 0:
            raise ValueError(f"epochs must be positive, got {self.epochs!r}")
        if not self.lr > 0:
            raise ValueError(f"lr must be positive, got {self.lr!r}")
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise ValueError(f"warmup_ratio must be in [0, 1), got {self.warmup_ratio!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class BatchSource(Protocol):
    """What the trainer needs from data (model.data's ResumableBatches provides it)."""

    def num_batches(self, epoch: int) -> int: ...

    def iter_batches(self, epoch: int, start_batch: int = 0) -> Iterator[dict[str, torch.Tensor]]: ...


class Callback:
    """Hooks the loop calls; override what you need. All run in the training thread."""

    def on_step(self, state: dict[str, Any]) -> None:
        """Every `log_every` steps: step, total_steps, loss, lr, tokens_per_s, eta_s, epoch (+ grad_norm, ...)."""

    def on_eval(self, metrics: dict[str, Any]) -> None:
        """After each evaluation: step plus the metrics of `evaluate`."""

    def on_checkpoint(self, path: Path) -> None:
        """After a checkpoint directory is complete on disk."""

    def should_stop(self) -> bool:
        """Asked after every optimizer step; True stops the run (a checkpoint is saved first)."""
        return False


@dataclass
class TrainResult:
    status: str  # "completed" or "stopped"
    step: int  # optimizer steps done
    total_steps: int
    train_loss: float | None  # mean loss of the last logged window
    eval_metrics: dict[str, Any] | None  # last evaluation
    checkpoint: str | None  # last checkpoint written
    best_checkpoint: str | None  # checkpoint with the best `best_metric`
    model_dir: str | None  # RUN_DIR/model, the final model (None when stopped)

    @property
    def stopped(self) -> bool:
        return self.status == "stopped"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------------------- optimisation

def configure_optimizer(model: torch.nn.Module, lr: float, weight_decay: float,
                        betas: Sequence[float] = (0.9, 0.999), eps: float = 1e-6) -> torch.optim.AdamW:
    """AdamW decaying only matrices (dim >= 2: linear weights, embeddings); biases and LayerNorm are not."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), eps=eps)


def linear_warmup_decay(warmup_steps: int, total_steps: int):
    """LR multiplier at a step: 0 -> 1 over warmup, then 1 -> 0 at total_steps (HF's linear schedule)."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return step / max(1, warmup_steps)
        return max(0.0, (total_steps - step) / max(1, total_steps - warmup_steps))

    return factor


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


# ---------------------------------------------------------------------------- evaluation

@torch.no_grad()
def evaluate(model: torch.nn.Module, data: BatchSource, *, device: str | torch.device | None = None,
             precision: str = "fp32", max_batches: int | None = None) -> dict[str, float]:
    """Metrics of `model` on epoch 0 of `data`, chosen by the model: classification or (masked) LM."""
    device = torch.device(device) if device is not None else next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        is_classifier = isinstance(model, BertForSequenceClassification)
        totals: dict[str, float] = {}
        for i, batch in enumerate(data.iter_batches(0, 0)):
            if max_batches is not None and i >= max_batches:
                break
            batch = {k: v.to(device) for k, v in batch.items()}
            with autocast(device, precision):
                out = model(**batch)
            _accumulate(totals, _classification_counts(model, out, batch) if is_classifier
                        else _lm_counts(out, batch))
        if not totals:
            raise ValueError("evaluation data has no batches")
        return _classification_metrics(totals) if is_classifier else _lm_metrics(totals)
    finally:
        model.train(was_training)


def _accumulate(totals: dict[str, float], counts: dict[str, float]) -> None:
    for key, value in counts.items():
        totals[key] = totals.get(key, 0.0) + float(value)


def _lm_counts(out, batch: dict[str, torch.Tensor]) -> dict[str, float]:
    logits = out.prediction_logits if hasattr(out, "prediction_logits") else out.logits
    labels = batch["labels"]
    target = labels[labels != IGNORE_INDEX]  # logits are (N, V) in this row-major order
    counts = {"mlm_n": target.numel()}
    if target.numel():
        counts["mlm_loss_sum"] = F.cross_entropy(logits.float(), target, reduction="sum").item()
        counts["mlm_correct"] = (logits.argmax(-1) == target).sum().item()
    nsp = batch.get("next_sentence_label")
    if nsp is not None and getattr(out, "seq_relationship_logits", None) is not None:
        nsp_logits = out.seq_relationship_logits.float()
        counts["nsp_n"] = nsp.numel()
        counts["nsp_loss_sum"] = F.cross_entropy(nsp_logits, nsp.reshape(-1), reduction="sum").item()
        counts["nsp_correct"] = (nsp_logits.argmax(-1) == nsp.reshape(-1)).sum().item()
    return counts


def _lm_metrics(t: dict[str, float]) -> dict[str, float]:
    m: dict[str, float] = {"masked_tokens": int(t["mlm_n"])}
    if t["mlm_n"]:
        m["mlm_loss"] = t["mlm_loss_sum"] / t["mlm_n"]
        m["mlm_accuracy"] = t["mlm_correct"] / t["mlm_n"]
        m["perplexity"] = math.exp(min(m["mlm_loss"], 700.0))
    if t.get("nsp_n"):
        m["nsp_loss"] = t["nsp_loss_sum"] / t["nsp_n"]
        m["nsp_accuracy"] = t["nsp_correct"] / t["nsp_n"]
    m["loss"] = m.get("mlm_loss", 0.0) + m.get("nsp_loss", 0.0)  # as in training: sum of the two means
    return m


def _classification_counts(model, out, batch: dict[str, torch.Tensor]) -> dict[str, float]:
    logits, labels = out.logits.float(), batch["labels"]
    if model.num_labels == 1:
        return {"n": labels.numel(), "se": ((logits.squeeze(-1) - labels.float()) ** 2).sum().item()}
    preds, labels = logits.argmax(-1), labels.reshape(-1)
    counts = {"n": labels.numel(), "correct": (preds == labels).sum().item(),
              "loss_sum": F.cross_entropy(logits, labels, reduction="sum").item()}
    for c in range(model.num_labels):
        counts[f"tp{c}"] = ((preds == c) & (labels == c)).sum().item()
        counts[f"fp{c}"] = ((preds == c) & (labels != c)).sum().item()
        counts[f"fn{c}"] = ((preds != c) & (labels == c)).sum().item()
    return counts


def _classification_metrics(t: dict[str, float]) -> dict[str, float]:
    if "se" in t:
        mse = t["se"] / t["n"]
        return {"loss": mse, "mse": mse, "examples": int(t["n"])}
    f1s = []
    for c in range(sum(k.startswith("tp") for k in t)):
        tp, fp, fn = t[f"tp{c}"], t[f"fp{c}"], t[f"fn{c}"]
        if tp + fp + fn:  # a class neither present nor predicted is left out, as scikit-learn does
            f1s.append(2 * tp / (2 * tp + fp + fn))
    return {"loss": t["loss_sum"] / t["n"], "accuracy": t["correct"] / t["n"],
            "macro_f1": sum(f1s) / len(f1s) if f1s else 0.0, "examples": int(t["n"])}


# ---------------------------------------------------------------------------- metrics log

class MetricsLog:
    """RUN_DIR/metrics.jsonl: one JSON object per logged step ("train") and per evaluation ("eval")."""

    def __init__(self, run_dir: Path | None):
        self.path = run_dir / METRICS_FILE if run_dir is not None else None
        self.records: list[dict[str, Any]] = []

    def restart_at(self, step: int) -> None:
        """Keep records up to `step` (a resume re-does what came after the checkpoint)."""
        if self.path is None or not self.path.is_file():
            return
        self.records = [r for r in read_jsonl(self.path) if r.get("step", 0) <= step]
        atomic_write_bytes(self.path, "".join(json.dumps(r) + "\n" for r in self.records).encode())

    def append(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")


# ---------------------------------------------------------------------------- the trainer

class Trainer:
    """Runs `config.max_steps` optimizer steps over `train_data`; see the module docstring."""

    def __init__(self, model: torch.nn.Module, train_data: BatchSource, config: TrainConfig, *,
                 run_dir: str | Path | None = None, eval_data: BatchSource | None = None,
                 tokenizer=None, callbacks: Sequence[Callback] = (), evaluate_fn=evaluate):
        self.config = config
        self.device = resolve_device(config.device)
        self.precision = resolve_precision(config.precision, self.device)
        self.model = model.to(self.device)
        self.train_data, self.eval_data = train_data, eval_data
        self.tokenizer, self.callbacks, self.evaluate_fn = tokenizer, list(callbacks), evaluate_fn
        self.run_dir = Path(run_dir) if run_dir is not None else None
        if self.run_dir is not None:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        self.total_steps = self._total_steps()
        warmup = config.warmup_steps if config.warmup_steps is not None else int(config.warmup_ratio * self.total_steps)
        self.warmup_steps = min(warmup, self.total_steps)
        self.optimizer = configure_optimizer(model, config.lr, config.weight_decay, config.adam_betas, config.adam_eps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, linear_warmup_decay(self.warmup_steps, self.total_steps))
        self.metrics = MetricsLog(self.run_dir)
        # Progress: optimizer steps done, the next micro-batch to read, best checkpoint so far.
        self.step, self.epoch, self.batch = 0, 0, 0
        self.best_value: float | None = None
        self.best_checkpoint: str | None = None
        self.last_checkpoint: str | None = None
        self.last_eval: dict[str, Any] | None = None
        self.tokens_seen = 0

    def _total_steps(self) -> int:
        if self.config.max_steps is not None:
            return self.config.max_steps
        per_epoch = self.train_data.num_batches(0)
        if per_epoch < 1:
            raise ValueError("training data has no batches")
        return max(1, math.ceil(self.config.epochs * per_epoch / self.config.grad_accum_steps))

    # -- public ------------------------------------------------------------------------------------

    def fit(self, resume: bool | str | Path = False) -> TrainResult:
        """Train to `total_steps` (or until a callback asks to stop). `resume`: False = fresh start,
        True = continue from the latest complete checkpoint in run_dir if there is one, a path = that one."""
        self._start(resume)
        if self.config.eval_on_start and self.step == 0:
            self._maybe_evaluate(last=False, force=True)
        stream = self._micro_batches()
        window = _Window()
        status = "completed"
        while self.step < self.total_steps:
            lr = self.scheduler.get_last_lr()[0]
            losses, tokens, grad_norm = self._optimizer_step(stream)
            self.step += 1
            self.tokens_seen += tokens
            window.add(losses, tokens)
            last = self.step == self.total_steps
            if self.step % self.config.log_every == 0 or last:
                self._log_step(window, lr, grad_norm)
            evaluated = self._maybe_evaluate(last)
            stop = not last and any(cb.should_stop() for cb in self.callbacks)
            if last or stop or (self.config.save_every and self.step % self.config.save_every == 0):
                self._save_checkpoint(evaluated)
            if stop:
                status = "stopped"
                break
        return self._finish(status, window)

    def evaluate(self) -> dict[str, Any]:
        if self.eval_data is None:
            raise ValueError("no eval data was given to the trainer")
        return self.evaluate_fn(self.model, self.eval_data, device=self.device, precision=self.precision,
                                max_batches=self.config.max_eval_batches)

    # -- the loop's parts --------------------------------------------------------------------------

    def _start(self, resume: bool | str | Path) -> None:
        path = None
        if resume is True and self.run_dir is not None:
            path = ckpt.latest_checkpoint(self.run_dir)
        elif resume and resume is not True:
            path = Path(resume)
        if self.run_dir is not None:
            ckpt.remove_stale_temp_dirs(self.run_dir)
        if path is None:
            if self.run_dir is not None and ckpt.latest_checkpoint(self.run_dir) is not None:
                # A fresh run among an older run's checkpoints would prune (and "resume") the wrong ones.
                raise ValueError(f"{self.run_dir} already has checkpoints; resume, or use another run directory")
            seed_everything(self.config.seed)
            self.metrics.restart_at(-1)
        else:
            self._restore(path)
        self.model.train()
        self._started = time.perf_counter()
        self._start_step = self.step

    def _restore(self, path: Path) -> None:
        state = ckpt.load_checkpoint(path, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler)
        t, d = state["trainer"], state["data"]
        self.step, self.epoch, self.batch = t["step"], d["epoch"], d["batch"]
        self.best_value, self.best_checkpoint = t["best_value"], t["best_checkpoint"]
        self.tokens_seen, self.last_eval = t["tokens_seen"], t["last_eval"]
        self.last_checkpoint = str(path)
        self.metrics.restart_at(self.step)

    def _micro_batches(self) -> Iterator[dict[str, torch.Tensor]]:
        """Batches forever, epoch after epoch; (self.epoch, self.batch) always names the next one."""
        while True:
            n = self.train_data.num_batches(self.epoch)
            if n < 1:
                raise ValueError(f"training data has no batches in epoch {self.epoch}")
            epoch, index = self.epoch, self.batch
            for batch in self.train_data.iter_batches(epoch, index):
                index += 1
                self.epoch, self.batch = (epoch + 1, 0) if index >= n else (epoch, index)
                yield batch
            self.epoch, self.batch = epoch + 1, 0

    def _optimizer_step(self, stream) -> tuple[dict[str, float], int, float | None]:
        accum, losses, tokens = self.config.grad_accum_steps, {}, 0
        for _ in range(accum):
            batch = {k: v.to(self.device) for k, v in next(stream).items()}
            with autocast(self.device, self.precision):
                out = self.model(**batch)
            (out.loss / accum).backward()
            for name in ("loss", "mlm_loss", "nsp_loss"):
                value = getattr(out, name, None)
                if value is not None:
                    losses[name] = losses.get(name, 0.0) + value.item() / accum
            mask = batch.get("attention_mask")
            tokens += int(mask.sum()) if mask is not None else batch["input_ids"].numel()
        if not math.isfinite(losses["loss"]):
            raise FloatingPointError(f"training loss became {losses['loss']} at step {self.step + 1}; "
                                     f"try a lower learning rate (now {self.config.lr})")
        grad_norm = None
        if self.config.max_grad_norm is not None:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm))
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return losses, tokens, grad_norm

    def _log_step(self, window: "_Window", lr: float, grad_norm: float | None) -> None:
        now = time.perf_counter()
        done = self.step - self._start_step
        per_step = (now - self._started) / max(1, done)
        state = {"type": "train", "step": self.step, "total_steps": self.total_steps,
                 **window.means(), "lr": lr, "tokens_per_s": window.tokens / max(1e-9, now - window.since),
                 "eta_s": per_step * (self.total_steps - self.step), "epoch": self._epoch_progress(),
                 "grad_norm": grad_norm, "tokens_seen": self.tokens_seen}
        window.reset(now)
        self.metrics.append(state)
        for cb in self.callbacks:
            cb.on_step(state)

    def _epoch_progress(self) -> float:
        return self.epoch + self.batch / max(1, self.train_data.num_batches(self.epoch))

    def _maybe_evaluate(self, last: bool, force: bool = False) -> bool:
        every = self.config.eval_every
        if self.eval_data is None or not (force or last or (every and self.step % every == 0)):
            return False
        metrics = {"type": "eval", "step": self.step, **self.evaluate()}
        self.last_eval = metrics
        self.metrics.append(metrics)
        for cb in self.callbacks:
            cb.on_eval(metrics)
        self._write_plot()
        return True

    def _save_checkpoint(self, evaluated: bool) -> None:
        if self.run_dir is None:
            return
        path = ckpt.checkpoint_dir(self.run_dir, self.step)
        value = self.last_eval.get(self.config.best_metric) if evaluated and self.last_eval else None
        if value is not None and self._is_better(value):
            self.best_value, self.best_checkpoint = value, str(path)
        ckpt.save_checkpoint(path, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
                             trainer_state=self._trainer_state(), data_state={"epoch": self.epoch, "batch": self.batch},
                             tokenizer=self.tokenizer)
        self.last_checkpoint = str(path)
        keep = {Path(self.best_checkpoint)} if self.best_checkpoint else set()
        ckpt.prune_checkpoints(self.run_dir, self.config.keep_last, keep)
        for cb in self.callbacks:
            cb.on_checkpoint(path)

    def _is_better(self, value: float) -> bool:
        if self.best_value is None:
            return True
        return value > self.best_value if self.config.greater_is_better else value < self.best_value

    def _trainer_state(self) -> dict[str, Any]:
        return {"step": self.step, "total_steps": self.total_steps, "best_metric": self.config.best_metric,
                "best_value": self.best_value, "best_checkpoint": self.best_checkpoint,
                "tokens_seen": self.tokens_seen, "last_eval": self.last_eval, "config": self.config.to_dict()}

    def _finish(self, status: str, window: "_Window") -> TrainResult:
        model_dir = None
        if self.run_dir is not None and status == "completed":
            model_dir = self.run_dir / FINAL_MODEL
            self.model.save_pretrained(model_dir, tokenizer=self.tokenizer)
        self._write_plot()
        self.model.eval()
        return TrainResult(status, self.step, self.total_steps, window.last_loss, self.last_eval,
                           self.last_checkpoint, self.best_checkpoint, str(model_dir) if model_dir else None)

    def _write_plot(self) -> None:
        if self.run_dir is not None:
            write_training_plot(self.metrics.records, self.run_dir / PLOT_FILE)


@dataclass
class _Window:
    """Losses and tokens since the last log line."""

    since: float = field(default_factory=time.perf_counter)
    sums: dict[str, float] = field(default_factory=dict)
    steps: int = 0
    tokens: int = 0
    last_loss: float | None = None

    def add(self, losses: dict[str, float], tokens: int) -> None:
        for key, value in losses.items():
            self.sums[key] = self.sums.get(key, 0.0) + value
        self.steps += 1
        self.tokens += tokens

    def means(self) -> dict[str, float]:
        means = {k: v / max(1, self.steps) for k, v in self.sums.items()}
        self.last_loss = means.get("loss")
        return means

    def reset(self, now: float) -> None:
        self.sums, self.steps, self.tokens, self.since = {}, 0, 0, now
