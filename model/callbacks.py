"""Trainer callbacks that model/ itself offers (model.trainer.Callback is the interface).

LogProgress reports through `logging`, for scripts and services that have no terminal to draw a bar
on; the `bert` command's tqdm bar and the worker's job-record updates live with their callers.
"""

from __future__ import annotations

import logging
from typing import Any

from .trainer import Callback

log = logging.getLogger("model.train")


class LogProgress(Callback):
    """One INFO line per logged step (step, loss, lr, tokens/s, ETA) and per evaluation."""

    def on_step(self, state: dict[str, Any]) -> None:
        log.info("step %d/%d  loss %.4f  lr %.2e  %.0f tok/s  eta %.0f s", state["step"], state["total_steps"],
                 state["loss"], state["lr"], state["tokens_per_s"], state["eta_s"])

    def on_eval(self, metrics: dict[str, Any]) -> None:
        shown = {k: v for k, v in metrics.items() if k not in ("type", "step")}
        log.info("step %d  eval %s", metrics["step"],
                 "  ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in shown.items()))
