"""Other kinds of CPU on this one: what torch reports and what oneDNN's kernels do, made to look like a
CPU without native bf16 or VNNI (an AVX2 EPYC, a laptop), so every fallback runs on any machine.

    pretend_avx2(monkeypatch.setattr)   in a test: undone when the test ends
    pretend_avx2()                      in a child process, e.g. from a sitecustomize.py (SITECUSTOMIZE)
    run_as(script, ATEN_CPU_CAPABILITY="avx2", ONEDNN_MAX_CPU_ISA="AVX2")   the JSON a script prints, run under
                                        the variables that hold torch and oneDNN to a lesser CPU's instructions
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

# What oneDNN raises for a bf16 weight on a CPU without avx512bw/vl/dq or avx_ne_convert (torch 2.13).
AVX2_BF16_ERROR = (
    "mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx_ne_convert or avx512bw, avx512vl and avx512dq"
)

# Put on PYTHONPATH (with the repository) as sitecustomize.py: a `bert serve` that believes it is on AVX2,
# and runs oneDNN for every matmul, however small (tiny test models normally fall under its threshold).
SITECUSTOMIZE = (
    "import model.compute.onednn, tests.cpu_kinds\nmodel.compute.onednn._MIN_MACS = 0\ntests.cpu_kinds.pretend_avx2()\n"
)


class RaisingOnBf16:
    """A torch.ops.mkldnn op that raises as on an AVX2 CPU when given bf16 tensors, and runs otherwise."""

    def __init__(self, op):
        self.op = op
        if hasattr(op, "binary"):
            self.binary = RaisingOnBf16(op.binary)

    def __call__(self, *args):
        if any(isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16 for a in args):
            raise RuntimeError(AVX2_BF16_ERROR)
        return self.op(*args)


def pretend_avx2(setattr=setattr) -> None:
    """torch reports AVX2 without bf16 or VNNI, oneDNN's bf16 ops raise, and model.compute.kernels decides
    every path afresh."""
    from model.compute import kernels

    for name in ("_linear_pointwise", "_reorder_linear_weight"):
        setattr(torch.ops.mkldnn, name, RaisingOnBf16(getattr(torch.ops.mkldnn, name)))
    setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    info = kernels.cpu()
    avx2 = dataclasses.replace(info, capability="AVX2", mkldnn_bf16=False, flags=frozenset({"avx2"}))
    setattr(kernels, "_cpu", [avx2])
    for path in kernels.PATHS.values():
        setattr(path, "decided", None)
        setattr(path, "forced", None)


def run_as(script: str, **env: str) -> dict:
    """The JSON `script` prints, run by a fresh Python in the repository with one OpenMP thread and `env` (torch and
    oneDNN read ATEN_CPU_CAPABILITY and ONEDNN_MAX_CPU_ISA when they load: a process of its own for each)."""
    proc = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **env},
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)
