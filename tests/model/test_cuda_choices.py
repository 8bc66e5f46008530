"""What the CUDA paths decide, without a GPU: torch.cuda's questions are answered by fakes, so each choice is
checked against the device it must ask about (the model's own, `cuda:1`, not the current one)."""

from __future__ import annotations

import pytest
import torch

from model import modeling
from model.compute import device as device_module
from model.compute import kernels
from model.compute.precision import bf16_native, recommendation, resolve_precision, use_tf32

CAPABILITY = {0: (7, 5), 1: (9, 0)}  # GPU 0 a T4 (emulated bf16), GPU 1 an H100


@pytest.fixture
def two_gpus(monkeypatch):
    """torch.cuda as a machine with GPU 0 a T4 and GPU 1 an H100 would answer; records what was asked."""
    asked: list = []

    def capability(device=None):
        index = torch.device(device).index if device is not None else 0
        index = 0 if index is None else index
        asked.append(index)
        return CAPABILITY[index]

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", capability)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)  # counts emulation: never asked
    return asked


def test_bf16_is_native_only_from_sm80_of_the_device_asked_about(two_gpus):
    assert (bf16_native("cuda:0"), bf16_native("cuda:1")) == (False, True)
    assert two_gpus == [0, 1]


def test_auto_is_bf16_only_on_a_gpu_with_native_bf16_for_serving_and_training(two_gpus):
    assert recommendation("cuda:1")[0] == "bf16" and recommendation("cuda:0")[0] == "fp32"
    assert resolve_precision("auto", "cuda:1") == "bf16"
    assert resolve_precision("auto", "cuda:0") == "fp32"
    assert resolve_precision("auto", "cpu") == "fp32"
    assert resolve_precision("bf16", "cuda:0") == "bf16"  # asked for: given


def test_tf32_is_set_for_cuda_runs_only_and_can_be_turned_off():
    matmul = torch.backends.cuda.matmul
    before = matmul.fp32_precision
    try:
        matmul.fp32_precision = "ieee"
        assert use_tf32("cpu") is False and matmul.fp32_precision == "ieee"
        assert use_tf32("cuda:0") is True and matmul.fp32_precision == "tf32"
        assert use_tf32("cuda:0", on=False) is False and matmul.fp32_precision == "ieee"
    finally:
        matmul.fp32_precision = before


def test_the_varlen_probe_runs_on_the_models_gpu(monkeypatch):
    """kernels.enabled("flash-varlen", cuda:1) decides under torch.cuda.device(cuda:1): the probe's capability
    question and tensors are GPU 1's, and no context is made on GPU 0."""
    current = [0]

    class Device:
        def __init__(self, device):
            self.index = torch.device(device).index

        def __enter__(self):
            self.before, current[0] = current[0], self.index

        def __exit__(self, *exc):
            current[0] = self.before

    seen = []
    monkeypatch.setattr(torch.cuda, "device", Device)
    path = kernels._Path(lambda: seen.append(("needs", current[0])), lambda: seen.append(("probe", current[0])))
    monkeypatch.setitem(kernels.PATHS, "flash-varlen", path)
    assert kernels.enabled("flash-varlen", torch.device("cuda", 1)) is True
    assert seen == [("needs", 1), ("probe", 1)] and current == [0]


def test_the_gpu_memory_budget_is_what_is_free(monkeypatch):
    """Another process (a worker's job) holding part of the GPU leaves the service the rest."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (30 * 2**30, 80 * 2**30))
    assert device_module.memory_bytes(torch.device("cuda:1")) == 30 * 2**30


def test_a_host_tensor_bound_for_a_gpu_is_pinned_before_its_asynchronous_copy(monkeypatch):
    """model.modeling.upload: CUDA stages a non_blocking copy from pageable memory synchronously."""
    calls = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: calls.append("pin") or self)
    monkeypatch.setattr(torch.Tensor, "to", lambda self, device, non_blocking: calls.append((device, non_blocking)))
    modeling.upload(torch.arange(3), torch.device("cuda", 1))
    modeling.upload(torch.arange(3), torch.device("cpu"))
    assert calls == ["pin", (torch.device("cuda", 1), True), (torch.device("cpu"), True)]
