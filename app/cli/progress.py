"""What the training commands show and how they stop: a tqdm progress bar and Ctrl-C/SIGTERM handling,
both trainer callbacks (model.training.callbacks.Callback), so model/ never learns about terminals or signals."""

from __future__ import annotations

import signal
import sys
from typing import Any

from model.training.callbacks import Callback, format_metrics


class ProgressBar(Callback):
    """A tqdm bar: step, loss, lr, tokens/s; tqdm shows the ETA. Evaluations print above it."""

    def __init__(self, stream=None):
        self.stream, self.bar = stream or sys.stderr, None

    def on_step(self, state: dict[str, Any]) -> None:
        from tqdm import tqdm

        if self.bar is None:
            self.bar = tqdm(total=state["total_steps"], initial=0, unit="step", file=self.stream, dynamic_ncols=True)
        self.bar.update(state["step"] - self.bar.n)
        self.bar.set_postfix_str(
            f"loss={state['loss']:.4f} lr={state['lr']:.2e} tok/s={state['tokens_per_s']:,.0f} "
            f"epoch={state['epoch']:.2f}"
        )

    def on_eval(self, metrics: dict[str, Any]) -> None:
        self._write(f"step {metrics['step']}: eval " + format_metrics(metrics))

    def _write(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line, file=self.stream)
        else:
            print(line, file=self.stream)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class SignalStop(Callback):
    """First Ctrl-C (or SIGTERM) asks the loop to stop after this step, saving a checkpoint; a second Ctrl-C
    aborts (unless `abort_on_second` is False: under torchrun, which passes the terminal's signal on)."""

    def __init__(self, abort_on_second: bool = True):
        self.requested, self.abort_on_second = False, abort_on_second
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> SignalStop:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame) -> None:
        if self.requested and signum == signal.SIGINT and self.abort_on_second:
            raise KeyboardInterrupt
        if self.requested:
            return
        self.requested = True
        again = "; Ctrl-C again to abort" if self.abort_on_second else ""
        print(f"\nstopping after this step (a checkpoint is saved{again})", file=sys.stderr)

    def should_stop(self) -> bool:
        return self.requested


class BuildProgressBar:
    """`bert corpus build`'s bar: input bytes read (tqdm shows MB/s and the ETA) and tokens/s; a TTY only."""

    def __init__(self, stream=None):
        self.stream, self.bar = stream or sys.stderr, None

    def __call__(self, state: dict[str, Any]) -> None:
        if not self.stream.isatty():
            return
        from tqdm import tqdm

        if self.bar is None:
            self.bar = tqdm(
                total=state["bytes_total"],
                initial=state["bytes_done"],
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                file=self.stream,
                dynamic_ncols=True,
                desc="corpus",
            )
        self.bar.update(state["bytes_done"] - self.bar.n)
        rate = state["tokens"] / max(state["elapsed_s"], 1e-9)
        self.bar.set_postfix_str(f"tok/s={rate:,.0f} tokens={state['tokens']:,} shards={state['shards']}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
