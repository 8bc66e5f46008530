"""The trainer's callbacks: the `Callback` interface and the callbacks model/ itself offers.

The training loop (model/training/trainer.py) reports only through callbacks. With a run directory it installs
two of its own: MetricsLogger first (RUN_DIR/metrics.jsonl, so later callbacks can read the line just
written) and TrainingPlot last (RUN_DIR/training.svg). LogProgress reports through `logging`, for
scripts and services that have no terminal to draw a bar on; the `bert` command's tqdm bar and the
worker's job-record updates live with their callers.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from datadir.files import rewrite_jsonl
from model.training.plot import write_training_plot

log = logging.getLogger("model.train")

PLOT_FILE = "training.svg"


class Callback:
    """Hooks the loop calls (on_prepare: the run functions of model/training/runs.py, before it); override what
    you need. All run in the training thread, in list order."""

    def on_prepare(self, phase: str, done: int | None = None, total: int | None = None) -> None:
        """Before `fit`, while the run gets ready: what it does, in words ("loading the model", "tokenising the
        corpus"), and how far where it can tell (`done` of `total` bytes read). Again as it goes on."""

    def on_fit_start(self, step: int, resumed: bool) -> None:
        """Once `fit` has restored its state, before the first step: the step it starts from, and
        whether it continues from a checkpoint (False: a fresh run from step 0)."""

    def on_step(self, state: dict[str, Any]) -> None:
        """Every `log_every` steps: step, total_steps, loss, lr, tokens_per_s, eta_s, epoch (+ grad_norm, ...)."""

    def on_eval(self, metrics: dict[str, Any]) -> None:
        """After each evaluation: step plus the metrics of the trainer's `evaluate_fn`."""

    def on_checkpoint(self, path: Path) -> None:
        """After a checkpoint directory is complete on disk."""

    def should_stop(self) -> bool:
        """Asked after every optimizer step; True stops the run (a checkpoint is saved first)."""
        return False

    def on_fit_end(self, result: Any) -> None:
        """Once the loop has ended, completed or stopped, and the final model is saved (not after an
        exception): `result` is the model.training.trainer.TrainResult that `fit` returns."""


class MetricsLogger(Callback):
    """RUN_DIR/metrics.jsonl: one JSON object per logged step ("train") and per evaluation ("eval").

    A fresh run starts the file empty; a resumed one keeps the records up to its checkpoint's step
    (the steps after it are done again) and anything else with such a step (the worker's "resume"
    marks). `records` holds what the file holds, for TrainingPlot.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.records: list[dict[str, Any]] = []

    def on_fit_start(self, step: int, resumed: bool) -> None:
        last = step if resumed else -1
        self.records = rewrite_jsonl(self.path, lambda r: r.get("step", 0) <= last)

    def on_step(self, state: dict[str, Any]) -> None:
        self._append(state)

    def on_eval(self, metrics: dict[str, Any]) -> None:
        self._append(metrics)

    def _append(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")


class TrainingPlot(Callback):
    """RUN_DIR/training.svg (model/training/plot.py) of a MetricsLogger's records, after each evaluation and at the end."""

    def __init__(self, path: str | Path, metrics: MetricsLogger):
        self.path, self.metrics = Path(path), metrics

    def on_eval(self, metrics: dict[str, Any]) -> None:
        self._write()

    def on_fit_end(self, result: Any) -> None:
        self._write()

    def _write(self) -> None:
        write_training_plot(self.metrics.records, self.path)


class LogProgress(Callback):
    """One INFO line per logged step (step, loss, lr, tokens/s, ETA) and per evaluation."""

    def on_step(self, state: dict[str, Any]) -> None:
        log.info(
            "step %d/%d  loss %.4f  lr %.2e  %.0f tok/s  eta %.0f s",
            state["step"],
            state["total_steps"],
            state["loss"],
            state["lr"],
            state["tokens_per_s"],
            state["eta_s"],
        )

    def on_eval(self, metrics: dict[str, Any]) -> None:
        log.info("step %d  eval %s", metrics["step"], format_metrics(metrics))


def format_metrics(metrics: dict[str, Any]) -> str:
    """An evaluation's metrics on one line: `loss=0.6440 accuracy=0.7500 examples=8`."""
    skip = {"type", "step", "model", "data"}
    return " ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items() if k not in skip)
