"""A model-agnostic training loop that reports through callbacks (after karpathy/minGPT's trainer.py).

The loop knows only that `model(**batch)` returns an object whose `loss` is a scalar to minimise;
it also reports every other scalar field named "*loss" (BERT pretraining's mlm_loss and nsp_loss).
A loss the model does not compute itself (a cross-encoder's ranking loss over each anchor's candidates)
comes in as `loss_fn(forward, batch)`, which calls the model and returns its output with `loss` set.
Everything else enters through arguments: evaluation is the caller's `evaluate_fn` (for BERT,
model.training.evaluation.evaluate), and progress, a tqdm bar, a Celery update, a stop request, go through
`Callback` objects (model/training/callbacks.py), so model/ never learns about the CLI or the worker:

    trainer = Trainer(model, train_data, TrainConfig(lr=1e-4, max_steps=1000), run_dir="runs/x",
                      eval_data=eval_data, evaluate_fn=evaluate, tokenizer=tok, callbacks=[my_callback])
    result = trainer.fit(resume=True)        # continue from runs/x/checkpoints/ if a checkpoint is there

With a run directory the trainer adds its own callbacks around the caller's: RUN_DIR/metrics.jsonl
(MetricsLogger) and RUN_DIR/training.svg (TrainingPlot). It writes checkpoints there
(model/training/checkpoint.py: every `save_every` steps, at the end and on a stop request, keeping the last
`keep_last` plus the best) and, when the run completes, the final model in RUN_DIR/model. Both are
model directories, so with a run directory the model also needs `save_pretrained` and `write_files` (the
same files into a directory that exists: a checkpoint's), as every model of model/modeling.py has.

With `eval_on_start` a fresh run first evaluates the model it starts from: that evaluation (step 0) is the
baseline, kept in every checkpoint, and each later evaluation carries `base_<metric>` beside its `<metric>`,
so the final metrics (the job's, the model card's) say what training changed, whatever task's evaluate_fn
computed them.

Data is anything with `num_batches(epoch) -> int` and `iter_batches(epoch, start_batch) -> iterator of
dict[str, Tensor]` whose batches are a pure function of (seed, epoch, batch index): the checkpoint
stores (epoch, batch), the RNG states and the optimizer, so a resumed run is bit-identical on CPU.

Optimisation is BERT's (Devlin et al. 2018, appendix A.2): AdamW with decoupled weight decay on
matrices only (biases and LayerNorm excluded, nanoGPT's `configure_optimizers` rule: dim >= 2),
linear warmup then linear decay to zero (HF's `get_linear_schedule_with_warmup`), gradient
clipping, gradient accumulation, optional bf16 autocast.

A step never waits for the device: losses stay on it (detached) and are summed there, the gradient norm
is a device tensor, tokens are counted on the host's batch, the attention mask and the MLM rows stay on
the host for a BERT model (which reads them there), and CUDA batches go through pinned memory with
non-blocking copies, built ahead by a thread (`prefetch_batches`); losses and the norm are read once per log line (and before a checkpoint,
which is refused when the loss went non-finite). Data-parallel runs add one all-reduce per step.

Under torchrun (model/training/distributed.py) the same loop is data-parallel: the model is wrapped in DDP, each
rank trains on its rows of every global micro-batch with its losses weighted so the averaged gradient is
the global batch's (equal to one process at the same batch size), accumulation micro-batches skip DDP's
all-reduce (`no_sync`) until the last, losses and token counts are summed over ranks each step, a stop
request on any rank stops all at the same step, and rank 0 alone runs the run directory's callbacks and
writes checkpoints and the final model. Dropout is seeded per (seed, step, rank), so ranks draw different
masks and a resumed run draws the same ones. A checkpoint records the world size; it resumes with any
(the global batch and its data order do not depend on it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import queue
import random
import threading
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, cast, runtime_checkable

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel

from datadir.files import METRICS_FILE
from model.compute.device import resolve_device
from model.compute.precision import autocast, resolve_precision, use_tf32
from model.modeling import IGNORE_INDEX
from model.options import BASE_PREFIX, TRAINER_OPTIONS, check_value, defaults
from model.training import checkpoint as ckpt
from model.training import distributed
from model.training.callbacks import PLOT_FILE, Callback, MetricsLogger, TrainingPlot

log = logging.getLogger(__name__)

FINAL_MODEL = "model"
_DEFAULT = defaults("pretrain", trainer=True)  # model/options.py: a field's default and the reason for it


# loss_fn(forward, batch) -> the model's output with `loss` set, where `forward(**inputs)` runs the model
# (through DDP and torch.compile when the run uses them); None: forward(**batch) computes its own loss.
LossFn = Callable[[Callable[..., Any], dict[str, torch.Tensor]], Any]

# evaluate_fn(model, eval_data, *, device, precision, max_batches, should_stop) -> metrics
# (model.training.evaluation.evaluate); it may raise model.training.evaluation.EvaluationStopped when should_stop() says so.
EvaluateFn = Callable[..., dict[str, Any]]


class EvaluationStopped(Exception):
    """An evaluate_fn was asked to stop (should_stop) between two batches: its metrics would not be whole.
    The trainer then records no evaluation and stops the run as the callbacks asked."""


@dataclass
class TrainConfig:
    """A run's optimisation and bookkeeping. Fields that are options (model/options.py) take their
    defaults from there (pretraining's column); the run specs of model/training/runs.py set fine-tuning's."""

    lr: float = _DEFAULT["lr"]  # peak learning rate, reached at the end of warmup
    weight_decay: float = _DEFAULT["weight_decay"]  # AdamW decoupled decay, on weight matrices only
    adam_betas: tuple[float, float] = (0.9, 0.999)  # BERT's values
    adam_eps: float = 1e-6  # BERT's value (torch's default 1e-8 is for other models)
    max_steps: int | None = _DEFAULT["max_steps"]  # optimizer steps to train; None = `epochs` passes over the data
    epochs: float | None = _DEFAULT["epochs"]  # used only when max_steps is None
    warmup_steps: int | None = _DEFAULT["warmup_steps"]  # linear warmup length; None = warmup_ratio * total steps
    warmup_ratio: float = _DEFAULT["warmup_ratio"]  # fraction of total steps to warm up over when warmup_steps is None
    grad_accum_steps: int = _DEFAULT["grad_accum_steps"]  # micro-batches per optimizer step
    max_grad_norm: float | None = _DEFAULT["max_grad_norm"]  # clip the global gradient norm; None = no clipping
    seed: int = _DEFAULT["seed"]  # seeds torch/numpy/random at the start of a fresh run (dropout stream)
    eval_every: int = _DEFAULT["eval_every"]  # evaluate every N steps (0: only at the end); needs eval data
    eval_on_start: bool = _DEFAULT["eval_on_start"]  # also evaluate before the first step
    save_every: int = _DEFAULT["save_every"]  # checkpoint every N steps (0: only at the end and on stop)
    keep_last: int = _DEFAULT["keep_last"]  # checkpoints kept besides the best one; older ones are deleted
    best_metric: str = "loss"  # eval metric that picks the best checkpoint
    greater_is_better: bool = False  # False for losses, True for accuracy/F1
    log_every: int = _DEFAULT["log_every"]  # call on_step (and write metrics.jsonl) every N steps
    precision: str = _DEFAULT["precision"]  # "fp32" | "bf16" (autocast) | "auto": bf16 on CUDA, fp32 on CPU
    device: str = _DEFAULT["device"]  # "cpu", "cuda", "cuda:1", or "auto" (CUDA when available)
    max_eval_batches: int | None = None  # cap on eval batches per evaluation (None: all)
    # Micro-batches built ahead by a thread while the device computes (pinned on CUDA); the batches are
    # the same either way. None: 2 on CUDA, 0 elsewhere (on a CPU the thread takes cores from the step).
    prefetch_batches: int | None = None
    # torch.compile the training forward (and so its backward): the first steps, and each new batch
    # shape until shapes are marked dynamic, pay for compiling; bench/train_bench.py --compile says
    # whether it pays for a given model and device.
    compile: bool = _DEFAULT["compile"]
    # On CUDA, fp32 matmuls (an fp32 run's, and those autocast leaves in fp32) through TF32 tensor cores;
    # False: full fp32 GEMMs (model.compute.precision.use_tf32, for the process).
    tf32: bool = True

    def __post_init__(self) -> None:
        self.adam_betas = cast(tuple[float, float], tuple(self.adam_betas))  # a JSON round trip gives a list
        if self.max_steps is None and self.epochs is None:
            raise ValueError("set max_steps or epochs")
        for option in TRAINER_OPTIONS:  # their types, bounds and choices, as the API and the docs have them
            check_value(option, getattr(self, option.name))
        if self.prefetch_batches is not None and (
            not isinstance(self.prefetch_batches, int) or self.prefetch_batches < 0
        ):
            raise ValueError(f"prefetch_batches must be an integer >= 0, got {self.prefetch_batches!r}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# A loss as the step reports it: a 0-dim device tensor (one process, read at the log line) or a float (ranks).
Loss = float | torch.Tensor


class _Pretrained(Protocol):
    """What a model needs with a run directory (every model of model/modeling.py has it)."""

    def save_pretrained(self, path: str | Path, tokenizer: Any = None) -> None: ...


class BatchSource(Protocol):
    """What the trainer needs from data (model.data's ResumableBatches provides it)."""

    def num_batches(self, epoch: int) -> int: ...

    def iter_batches(self, epoch: int, start_batch: int = 0) -> Iterator[dict[str, torch.Tensor]]: ...


@runtime_checkable
class EvaluationSet(Protocol):
    """Evaluation data that scores a model itself, whole (a retrieval or similarity set embeds its own texts):
    model.training.evaluation.evaluate hands such data the model."""

    def evaluate_model(
        self,
        model: torch.nn.Module,
        *,
        device: torch.device,
        precision: str,
        max_batches: int | None,
        should_stop: Callable[[], bool] | None,
    ) -> dict[str, Any]: ...


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


def configure_optimizer(
    model: torch.nn.Module, lr: float, weight_decay: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6
) -> torch.optim.AdamW:
    """AdamW decaying only matrices (dim >= 2: linear weights, embeddings); biases and LayerNorm are not.
    On CUDA the fused implementation (one kernel for all parameters instead of a few per tensor); its
    state dict is the same, so a checkpoint resumes on either device."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    fused = bool(params) and all(p.is_cuda for p in params)
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=fused or None)


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


# ---------------------------------------------------------------------------- the trainer


class Trainer:
    """Runs `config.max_steps` optimizer steps over `train_data`; see the module docstring."""

    def __init__(
        self,
        model: torch.nn.Module,
        train_data: BatchSource,
        config: TrainConfig,
        *,
        run_dir: str | Path | None = None,
        eval_data: BatchSource | EvaluationSet | None = None,
        tokenizer=None,
        callbacks: Sequence[Callback] = (),
        evaluate_fn: EvaluateFn | None = None,
        loss_fn: LossFn | None = None,
    ):
        if eval_data is not None and evaluate_fn is None:
            raise ValueError("eval_data needs an evaluate_fn (for BERT models: model.training.evaluation.evaluate)")
        self.config = config
        self.device = resolve_device(config.device)
        self.dist = distributed.init(self.device)
        self.device = distributed.rank_device(self.device, self.dist)
        self.precision = resolve_precision(config.precision, self.device)
        use_tf32(self.device, config.tf32)
        self.model = model.to(self.device)
        self.ddp = self._wrap(self.model)
        self.forward = torch.compile(self.ddp) if config.compile else self.ddp
        self.train_data, self.eval_data = train_data, eval_data
        self.tokenizer, self.evaluate_fn, self.loss_fn = tokenizer, evaluate_fn, loss_fn
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.callbacks = list(callbacks)
        if self.run_dir is not None and self.dist.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            metrics = MetricsLogger(self.run_dir / METRICS_FILE)  # first: the caller's may read its lines
            self.callbacks = [metrics, *self.callbacks, TrainingPlot(self.run_dir / PLOT_FILE, metrics)]
        self.total_steps = self._total_steps()
        warmup = config.warmup_steps if config.warmup_steps is not None else int(config.warmup_ratio * self.total_steps)
        self.warmup_steps = min(warmup, self.total_steps)
        self.optimizer = configure_optimizer(model, config.lr, config.weight_decay, config.adam_betas, config.adam_eps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, linear_warmup_decay(self.warmup_steps, self.total_steps)
        )
        self.rotation = ckpt.CheckpointRotation(config.keep_last, config.best_metric, config.greater_is_better)
        # Progress: optimizer steps done, and the next micro-batch to read.
        self.step, self.epoch, self.batch = 0, 0, 0
        self.last_checkpoint: str | None = None
        self.last_eval: dict[str, Any] | None = None
        self.base_eval: dict[str, Any] | None = None  # the model before its first step (eval_on_start)
        self.tokens_seen = 0

    def _wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """DDP around the model when there are ranks (it broadcasts rank 0's weights now); else the model."""
        if not self.dist.enabled:
            return model
        # device_ids None: the module is already on its GPU, and the inputs stay where _to_device put them (with
        # device_ids, DDP would copy each one to the GPU in forward, blocking on the host mask and masked positions
        # that the model reads on the host; torch's DistributedDataParallel documents None for this case).
        return DistributedDataParallel(model)

    def _total_steps(self) -> int:
        if self.config.max_steps is not None:
            return self.config.max_steps
        assert self.config.epochs is not None  # TrainConfig refuses neither max_steps nor epochs
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
        try:
            return self._loop(stream)
        finally:
            stream.close()

    def _loop(self, stream: Iterator) -> TrainResult:
        window = _Window()
        status = "completed"
        while self.step < self.total_steps:
            lr = float(self.scheduler.get_last_lr()[0])
            losses, tokens, grad_norm = self._optimizer_step(stream)
            self.step += 1
            last = self.step == self.total_steps
            asked = self.dist.enabled and not last and self._should_stop()  # one process: asked after evaluating
            losses, rank_tokens, asked = self._sum_over_ranks(losses, tokens, asked)
            self.tokens_seen += sum(rank_tokens)
            window.add(losses, rank_tokens)
            if self.step % self.config.log_every == 0 or last:
                self._log_step(window, lr, grad_norm)
            evaluated, cut_short = self._maybe_evaluate(last)
            # A stop request cut the evaluation short: stop even at the last step (no unevaluated final model).
            # Rank 0 evaluates alone; at the steps it may, every rank learns whether its evaluation was cut short.
            if self.dist.enabled and self._evaluation_step(last):
                cut_short = distributed.any_rank(cut_short, self.dist)
            stop = asked or cut_short or (not self.dist.enabled and not last and self._should_stop())
            if last or stop or (self.config.save_every and self.step % self.config.save_every == 0):
                self._check_finite(window)  # never a checkpoint of weights a non-finite loss has reached
                self._save_checkpoint(evaluated)
            if stop:
                status = "stopped"
                break
        return self._finish(status, window)

    def evaluate(self) -> dict[str, Any]:
        if self.eval_data is None:
            raise ValueError("no eval data was given to the trainer")
        assert self.evaluate_fn is not None  # __init__ refuses eval_data without one
        return self.evaluate_fn(
            self.model,
            self.eval_data,
            device=self.device,
            precision=self.precision,
            max_batches=self.config.max_eval_batches,
            should_stop=self._should_stop,
        )

    def _should_stop(self) -> bool:
        return any(cb.should_stop() for cb in self.callbacks)

    # -- the loop's parts --------------------------------------------------------------------------

    def _emit(self, hook: str, *args) -> None:
        for cb in self.callbacks:
            getattr(cb, hook)(*args)

    def _start(self, resume: bool | str | Path) -> None:
        path = ckpt.start_point(self.run_dir, resume)
        if path is None:
            seed_everything(self.config.seed)
        else:
            self._restore(path)
        if not distributed.same_on_all_ranks(self.step, self.dist):
            raise ValueError(
                f"the processes start from different steps (this one, rank {self.dist.rank}: step "
                f"{self.step}); every node must see the same run directory {self.run_dir}"
            )
        self._emit("on_fit_start", self.step, path is not None)
        self.model.train()
        self._started = time.perf_counter()
        self._start_step = self.step

    def _restore(self, path: Path) -> None:
        state = ckpt.load_checkpoint(path, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler)
        t, d = state["trainer"], state["data"]
        saved_world = t.get("world_size", 1)
        if saved_world != self.dist.world and self.dist.is_main:
            log.info(
                "resuming a checkpoint of %d process(es) with %d: the global batch and its data order are unchanged",
                saved_world,
                self.dist.world,
            )
        self.step, self.epoch, self.batch = t["step"], d["epoch"], d["batch"]
        self.rotation.best_value, self.rotation.best_checkpoint = t["best_value"], t["best_checkpoint"]
        self.tokens_seen, self.last_eval = t["tokens_seen"], t["last_eval"]
        self.base_eval = t.get("base_eval")  # checkpoints from before baselines have none
        self.last_checkpoint = str(path)

    def _micro_batches(self):
        """Micro-batches with the position after each, from (self.epoch, self.batch); read ahead by a
        thread when prefetching. The loop sets (self.epoch, self.batch) as it takes each batch, so they
        always name the next batch to train on, whatever has been read ahead."""
        depth = self.config.prefetch_batches
        depth = (2 if self.device.type == "cuda" else 0) if depth is None else depth
        pin = self.device.type == "cuda"
        batches = _positioned(self.train_data, self.epoch, self.batch)
        if depth == 0:
            return _Inline(batches)
        return _Prefetcher(batches, depth, (lambda b: {k: v.pin_memory() for k, v in b.items()}) if pin else None)

    def _optimizer_step(self, stream) -> tuple[dict[str, Loss], int, torch.Tensor | None]:
        """One optimizer step over `grad_accum_steps` micro-batches; returns this rank's shares of the global
        batch's mean losses (device tensors: nothing read here), the tokens it trained on, and the gradient norm
        before clipping."""
        accum, tokens = self.config.grad_accum_steps, 0
        losses: dict[str, Loss] = {}
        if self.dist.enabled:
            torch.manual_seed(distributed.rank_seed(self.config.seed, self.step, self.dist.rank))
        for i in range(accum):
            batch, (self.epoch, self.batch) = next(stream)
            local, factor = distributed.rank_rows(batch, self.dist)
            mask = local.get("attention_mask")  # tokens counted on the host copy: no device sync
            tokens += 0 if factor == 0 else int(mask.sum()) if mask is not None else local["input_ids"].numel()
            if "labels" in local and getattr(self.model, "takes_host_masked_positions", False):
                local["masked_positions"] = local["labels"] != IGNORE_INDEX  # found on the host: no sync
            host_local, local = local, self._to_device(local)
            # DDP all-reduces gradients on the last micro-batch only (the others accumulate locally).
            sync = i == accum - 1 or not self.dist.enabled
            # sync is False only with ranks, where _wrap made self.ddp a DistributedDataParallel.
            with contextlib.nullcontext() if sync else cast(DistributedDataParallel, self.ddp).no_sync():
                with autocast(self.device, self.precision):
                    out = self.forward(**local) if self.loss_fn is None else self.loss_fn(self.forward, local)
                loss, reported = self._weighted_losses(out, batch, host_local, factor)  # labels counted on the host
                (loss / accum).backward()
            for name, value in reported.items():
                losses[name] = losses.get(name, 0.0) + value / accum
        grad_norm = None
        if self.config.max_grad_norm is not None:  # a 0-dim tensor, read at the next log line
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return losses, tokens, grad_norm

    def _to_device(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The batch on the training device; on CUDA through pinned memory, so the copies are asynchronous,
        and the attention mask left on the host for a model that takes it there (BERT's), which then
        decides between masking and packing without asking the GPU."""
        if self.device.type != "cuda":
            return {k: v.to(self.device) for k, v in batch.items()}
        host = {"masked_positions"}
        if getattr(self.model, "takes_host_attention_mask", False):
            host.add("attention_mask")
        return {k: v if k in host else v.pin_memory().to(self.device, non_blocking=True) for k, v in batch.items()}

    def _weighted_losses(self, out, batch, local, factor: float) -> tuple[torch.Tensor, dict[str, Any]]:
        """The loss to backpropagate and this rank's share of each reported loss (see model/training/distributed.py).

        One process: `out.loss` and the losses as they are, left on the device (detached) so that a step
        never waits for the GPU; they are read once per log line. Ranks: each part of the loss (mlm_loss
        and nsp_loss, or loss alone) weighted by its share of the global batch's labels."""
        found = _losses(out)
        if not self.dist.enabled:
            return out.loss, {name: value.detach() for name, value in found.items()}
        parts = [name for name in found if name != "loss"] or ["loss"]
        weights = distributed.loss_weights(batch, local, parts, self.dist, factor)
        weighted = [found[name] * weights[name] for name in parts]
        loss = sum(weighted[1:], weighted[0])  # started from the first: a tensor, never the int 0
        reported = {name: found[name].detach() * (weights[name] / self.dist.world) for name in parts}
        if "loss" not in reported:  # the total of the parts, as the model sums them
            shares = list(reported.values())
            reported = {"loss": sum(shares[1:], shares[0]), **reported}
        return loss, {name: reported[name] for name in found}

    def _sum_over_ranks(
        self, losses: dict[str, Loss], tokens: int, asked: bool
    ) -> tuple[dict[str, Loss], list[int], bool]:
        """Each rank's shares summed into the global batch's losses, the tokens of each rank, and whether any rank
        was asked to stop (every rank has the same loss names in the same order). The losses are all-reduced where
        they are (with NCCL, queued on the GPU: nothing waits for them until a log line reads them); the tokens
        and the stop flag in one small host vector: the step's one wait."""
        if not self.dist.enabled:
            return losses, [tokens], asked
        names = list(losses)
        shares = torch.stack([torch.as_tensor(losses[n]).to(torch.float64) for n in names])
        shares = distributed.all_reduce_in_place(shares, self.dist)
        host = torch.zeros(self.dist.world + 1, dtype=torch.float64)
        host[self.dist.rank], host[-1] = tokens, float(asked)
        counts = distributed.all_reduce_sum(host, self.dist).tolist()
        return {n: shares[i] for i, n in enumerate(names)}, [int(t) for t in counts[:-1]], counts[-1] > 0

    def _check_finite(self, window: _Window) -> None:
        """Raise when the loss went non-finite since the last log line (one device read, not one per step)."""
        loss = window.sum_of("loss")
        if loss is not None and not math.isfinite(loss):
            first = self.step - window.steps + 1
            raise FloatingPointError(
                f"training loss became {loss} (steps {first}-{self.step}); "
                f"try a lower learning rate (now {self.config.lr})"
            )

    def _log_step(self, window: _Window, lr: float, grad_norm: torch.Tensor | float | None) -> None:
        self._check_finite(window)
        now = time.perf_counter()
        done = self.step - self._start_step
        per_step = (now - self._started) / max(1, done)
        elapsed = max(1e-9, now - window.since)
        state: dict[str, Any] = {
            "type": "train",
            "step": self.step,
            "total_steps": self.total_steps,
            **window.means(),
            "lr": lr,
            "tokens_per_s": sum(window.rank_tokens) / elapsed,
            "eta_s": per_step * (self.total_steps - self.step),
            "epoch": self._epoch_progress(),
            "grad_norm": None if grad_norm is None else float(grad_norm),
            "tokens_seen": self.tokens_seen,
        }
        if self.dist.enabled:  # tokens/s of each rank, rank 0 first: a slow rank shows here
            state.update(world_size=self.dist.world, rank_tokens_per_s=[t / elapsed for t in window.rank_tokens])
        window.reset(now)
        self._emit("on_step", state)

    def _epoch_progress(self) -> float:
        return self.epoch + self.batch / max(1, self.train_data.num_batches(self.epoch))

    def _evaluation_step(self, last: bool) -> bool:
        """Whether rank 0 may evaluate at this step (the same answer on every rank)."""
        every = self.config.eval_every
        return last or bool(every and self.step % every == 0)

    def _maybe_evaluate(self, last: bool, force: bool = False) -> tuple[bool, bool]:
        """(evaluated, a stop request cut the evaluation short)."""
        every = self.config.eval_every
        if not self.dist.is_main:  # rank 0 evaluates alone; the others wait at the next step's all-reduce
            return False, False
        if self.eval_data is None or not (force or last or (every and self.step % every == 0)):
            return False, False
        try:
            metrics = self.evaluate()
        except EvaluationStopped as e:
            log.info("step %d: %s", self.step, e)
            return False, True
        if self.step == 0:  # before the first step: the base model's scores, the baseline of every later one
            self.base_eval = metrics
        self.last_eval = {"type": "eval", "step": self.step, **metrics, **baseline_fields(self.base_eval, self.step)}
        self._emit("on_eval", self.last_eval)
        return True, False

    def _save_checkpoint(self, evaluated: bool) -> None:
        if self.run_dir is None:
            return
        path = ckpt.checkpoint_dir(self.run_dir, self.step)
        if not self.dist.is_main:  # rank 0 writes it (the weights and optimizer are the same on every rank)
            self.last_checkpoint = str(path)
            return
        self.rotation.consider(path, self.last_eval if evaluated else None)
        ckpt.save_checkpoint(
            path,
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            trainer_state=self._trainer_state(),
            data_state={"epoch": self.epoch, "batch": self.batch},
            tokenizer=self.tokenizer,
        )
        self.last_checkpoint = str(path)
        self.rotation.prune(self.run_dir)
        self._emit("on_checkpoint", path)

    def _trainer_state(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "total_steps": self.total_steps,
            "best_metric": self.config.best_metric,
            "best_value": self.rotation.best_value,
            "best_checkpoint": self.rotation.best_checkpoint,
            "tokens_seen": self.tokens_seen,
            "last_eval": self.last_eval,
            "base_eval": self.base_eval,
            "config": self.config.to_dict(),
            "world_size": self.dist.world,
        }

    def _finish(self, status: str, window: _Window) -> TrainResult:
        model_dir = None
        if self.run_dir is not None and status == "completed":
            model_dir = self.run_dir / FINAL_MODEL
            if self.dist.is_main:
                cast(_Pretrained, self.model).save_pretrained(model_dir, tokenizer=self.tokenizer)
        distributed.barrier(self.dist)  # every rank returns once the checkpoint and model are on disk
        self.model.eval()
        result = TrainResult(
            status,
            self.step,
            self.total_steps,
            window.last_loss,
            self.last_eval,
            self.last_checkpoint,
            self.rotation.best_checkpoint,
            str(model_dir) if model_dir else None,
        )
        self._emit("on_fit_end", result)
        return result


def _positioned(
    data: BatchSource, epoch: int, index: int
) -> Generator[tuple[dict[str, torch.Tensor], tuple[int, int]], None, None]:
    """(batch, (epoch, index) of the batch after it), forever, epoch after epoch, from (epoch, index)."""
    while True:
        n = data.num_batches(epoch)
        if n < 1:
            raise ValueError(f"training data has no batches in epoch {epoch}")
        for batch in data.iter_batches(epoch, index):
            index += 1
            yield batch, ((epoch + 1, 0) if index >= n else (epoch, index))
        epoch, index = epoch + 1, 0


class _Inline:
    """The batches, read when the loop asks."""

    def __init__(self, source: Generator):
        self.source = source

    def __next__(self):
        return next(self.source)

    def close(self) -> None:
        self.source.close()


class _Prefetcher:
    """The batches, read up to `depth` ahead by a daemon thread (then `prepare`d there, e.g. pinned).

    An error in the thread is raised by the `next` that would have got its batch; `close` stops it."""

    def __init__(self, source: Generator, depth: int, prepare: Callable | None = None):
        self.queue: queue.Queue = queue.Queue(maxsize=depth)
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._fill, args=(source, prepare), name="batch-prefetch", daemon=True)
        self.thread.start()

    def _fill(self, source: Generator, prepare: Callable | None) -> None:
        try:
            for batch, position in source:
                item = (prepare(batch) if prepare else batch, position)
                while not self._put(item):
                    if self.stopping.is_set():
                        return
        except BaseException as e:  # noqa: BLE001 - handed to the training thread
            while not self._put(_Failed(e)) and not self.stopping.is_set():
                pass
        finally:
            source.close()

    def _put(self, item) -> bool:
        try:
            self.queue.put(item, timeout=0.1)
            return True
        except queue.Full:
            return False

    def __next__(self):
        item = self.queue.get()
        if isinstance(item, _Failed):
            raise item.error
        return item

    def close(self) -> None:
        self.stopping.set()
        self.thread.join(timeout=5)


@dataclass
class _Failed:
    error: BaseException


def _losses(out) -> dict[str, torch.Tensor]:
    """A model output's scalar losses by field name: `loss` and any other set "*loss" field, in field order."""
    return {
        name: value
        for name, value in vars(out).items()
        if name.endswith("loss") and isinstance(value, torch.Tensor) and value.dim() == 0
    }


def baseline_fields(base: dict[str, Any] | None, step: int) -> dict[str, Any]:
    """`base_<metric>` for each score of the baseline evaluation `base` (a float: an integer is a count of the
    evaluation set, the same before and after), for an evaluation after step 0 (none at step 0, which is the
    baseline itself, nor without one)."""
    if not base or step == 0:
        return {}
    return {BASE_PREFIX + name: value for name, value in base.items() if isinstance(value, float)}


@dataclass
class _Window:
    """Losses and tokens since the last log line."""

    since: float = field(default_factory=time.perf_counter)
    sums: dict[str, Any] = field(default_factory=dict)  # floats, or 0-dim tensors on the device
    steps: int = 0
    rank_tokens: list[int] = field(default_factory=list)  # tokens each rank trained on
    last_loss: float | None = None

    def add(self, losses: dict[str, Any], rank_tokens: list[int]) -> None:
        """Losses as floats, or as 0-dim device tensors (summed on the device; read in `means`)."""
        for key, value in losses.items():
            self.sums[key] = self.sums.get(key, 0.0) + value
        self.steps += 1
        self.rank_tokens = [a + b for a, b in zip(self.rank_tokens, rank_tokens)] or list(rank_tokens)

    def sum_of(self, key: str) -> float | None:
        return float(self.sums[key]) if key in self.sums else None

    def means(self) -> dict[str, float]:
        means = {k: float(v) / max(1, self.steps) for k, v in self.sums.items()}
        self.last_loss = means.get("loss")
        return means

    def reset(self, now: float) -> None:
        self.sums, self.steps, self.rank_tokens, self.since = {}, 0, [], now
