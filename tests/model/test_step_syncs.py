"""The host reads a training step decides, counted on the CPU: what Trainer._to_device puts on the device is a
tensor that counts every read of it (.item(), .tolist(), .cpu(), float(), int(), bool()), and what is computed from
it inherits that. On a GPU each such read is a host-device sync; bench/gpu_check counts the real ones with
torch.cuda.set_sync_debug_mode. One process and data parallel (two ranks, faked: the all-reduces are identities
here) read nothing per step: losses are summed where they are and read at log lines only; with ranks, the step's
one wait is its small host vector (tokens and the stop flag)."""

from __future__ import annotations

import pytest
import torch
from torch import distributed as dist

from model.training import distributed
from model.training.trainer import TrainConfig, Trainer
from tests.model.conftest import FixedBatches, tiny_model
from tests.model.test_trainer import fixed_pretraining_batch

READS = {"item", "tolist", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__"}


class OnDevice(torch.Tensor):
    """A tensor as if it were on a GPU: reading it on the host is counted."""

    reads: list[str] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in READS:
            cls.reads.append(func.__name__)
        return super().__torch_function__(func, types, args, kwargs or {})


@pytest.fixture
def on_device(monkeypatch):
    """Trainer._to_device as on CUDA: the attention mask and masked positions stay on the host, the rest 'moves'."""
    OnDevice.reads = []

    def to_device(self, batch):
        host = ("attention_mask", "masked_positions")
        return {k: v if k in host else v.as_subclass(OnDevice) for k, v in batch.items()}

    monkeypatch.setattr(Trainer, "_to_device", to_device)
    return OnDevice


def trainer(tiny_tokenizer, steps: int, accum: int = 1) -> Trainer:
    data = FixedBatches([fixed_pretraining_batch(tiny_tokenizer)])
    config = TrainConfig(lr=1e-3, max_steps=steps, warmup_steps=0, log_every=steps, grad_accum_steps=accum)
    return Trainer(tiny_model(), data, config)


def reads_per_step(t: Trainer, on_device) -> list[list[str]]:
    """The reads of each step of t.fit() before its last (whose log line reads the losses, as it should)."""
    per_step: list[list[str]] = []
    real = t._optimizer_step

    def step(stream):
        per_step.append(list(on_device.reads))
        return real(stream)

    t._optimizer_step = step  # type: ignore[method-assign]
    t.fit()
    per_step.append(list(on_device.reads))
    return [b[len(a) :] for a, b in zip(per_step, per_step[1:])][:-1]


def test_a_step_of_one_process_reads_nothing_on_the_host(tiny_tokenizer, on_device):
    assert reads_per_step(trainer(tiny_tokenizer, steps=4), on_device) == [[], [], []]


def test_a_data_parallel_step_reads_nothing_of_the_device_and_waits_once(tiny_tokenizer, on_device, monkeypatch):
    """Rank 0 of two: label counts from the host batch, losses reduced where they are (no .item() per loss), and
    one host vector reduced per step (tokens and the stop flag), which is the step's one wait."""
    host_reductions = []
    monkeypatch.setattr(dist, "all_reduce", lambda values, *a, **k: values)  # the other rank: silent
    monkeypatch.setattr(dist, "get_backend", lambda *a: "gloo")
    monkeypatch.setattr(dist, "barrier", lambda *a, **k: None)
    real_sum = distributed.all_reduce_sum
    monkeypatch.setattr(distributed, "all_reduce_sum", lambda v, d: host_reductions.append(type(v)) or real_sum(v, d))
    t = trainer(tiny_tokenizer, steps=4)
    t.dist = distributed.Dist(rank=0, world=2)
    assert reads_per_step(t, on_device) == [[], [], []]
    # One per step (4), of a plain host tensor; besides them, the start's check that every rank is at the same
    # step, and at the last step (where rank 0 evaluates) whether an evaluation was cut short.
    assert host_reductions == [torch.Tensor] * (1 + 4 + 1)
