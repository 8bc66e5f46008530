"""A training attempt's spans, reported through the trainer's callbacks (model/ knows nothing of traces):
each preparation phase (loading the model, reading or tokenising the data) from its first report to the
next, and each evaluation and checkpoint, as children of the attempt's span (worker/training.py). The
trainer tells when an evaluation or a checkpoint has ended, not when it began: each starts at the
callback before it (the step it follows), which is when the loop turned to it."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from model.training.callbacks import Callback
from worker.telemetry import tracing


class TraceCallback(Callback):
    def __init__(self) -> None:
        self.phase: str | None = None
        self.phase_span: Any = None
        self.mark = time.time_ns()  # the last callback: where an evaluation or a checkpoint begins

    def on_prepare(self, phase: str, done: int | None = None, total: int | None = None) -> None:
        if phase != self.phase:
            self._end_phase()
            self.phase, self.phase_span = phase, tracing.start("prepare", **{"bertserve.phase": phase})

    def on_fit_start(self, step: int, resumed: bool) -> None:
        self._end_phase()
        tracing.annotate(**{"bertserve.start_step": step, "bertserve.resumed": resumed})
        self.mark = time.time_ns()

    def on_step(self, state: dict[str, Any]) -> None:
        self.mark = time.time_ns()

    def should_stop(self) -> bool:
        self.mark = time.time_ns()
        return False

    def on_eval(self, metrics: dict[str, Any]) -> None:
        scores = {f"bertserve.eval.{k}": v for k, v in metrics.items() if isinstance(v, int | float) and k != "step"}
        tracing.ended_span("evaluate", None, self.mark, **{"bertserve.step": metrics.get("step"), **scores})
        self.mark = time.time_ns()

    def on_checkpoint(self, path: Path) -> None:
        tracing.ended_span("checkpoint", None, self.mark, **{"bertserve.checkpoint": Path(path).name})
        self.mark = time.time_ns()

    def on_fit_end(self, result: Any) -> None:
        self._end_phase()

    def _end_phase(self) -> None:
        if self.phase_span is not None:
            self.phase_span.end()
        self.phase, self.phase_span = None, None
