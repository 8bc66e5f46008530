"""Which fast kernels this process runs: what the machine has is asked of torch, and each fast path is
confirmed by a tiny forward the first time it could be used.

A *path* is a kernel choice that depends on the processor or on how torch was built:

    onednn-fp32   oneDNN's fp32 GEMMs: weights packed once, bias, activation and residual fused
                  (model/compute/onednn.py). Else F.linear, torch's BLAS (MKL on x86).
    onednn-bf16   the same in bf16, for bf16 models. Else bf16 is emulated: bf16 weights and
                  activations, each GEMM computed in fp32 (correct, slower than fp32).
    int8-vnni     torch._int_mm's int8 GEMM for model.compute.precision's Int8Linear. Else int8 is emulated:
                  the same int8 values multiplied in fp32 (correct, slower than fp32).
    flash-varlen  flash attention's variable-length kernel for packed batches on CUDA
                  (model/modeling.py). Else one SDPA call per sequence.

Each path is decided once per process, at its first use, in two steps:
1. Asked. `_needs_*` read what torch reports: ATen's CPU capability, oneDNN's bf16 support, the
   cpuinfo flags for native bf16 and VNNI, the ONEDNN_MAX_CPU_ISA limit, CUDA's compute capability.
   A path the machine lacks, or where it would not pay, is off, with that reason.
2. Confirmed. `_probe_*` run a tiny forward (and, for onednn-fp32, a backward) through the path and
   compare it with plain torch on the same inputs, per dtype. A path that raises or disagrees is
   off for the process, with one warning naming it and the reason.
A path that raises later, on a shape its probe did not cover, is switched off the same way (`fail`),
and the call that hit it is answered by the plain path: a missing kernel never fails a request.

    enabled(name)                 whether the path runs now (decides it on the first call)
    status(name)                  (on, why)
    fail(name, error)             switch it off for the process: one warning
    override(name, on)            force it on or off (True/False), or back to the machine's choice (None)
    cpu()                         what the CPU has (CpuInfo), as torch reports it
    describe(precision, device)   {"kernels", "why"} for a model at that precision here (GET /models)

References: torch.backends.cpu.get_cpu_capability, torch.cpu.get_capabilities (cpuinfo),
torch.ops.mkldnn._is_mkldnn_bf16_supported; oneDNN's CPU dispatcher control (ONEDNN_MAX_CPU_ISA).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

log = logging.getLogger("bertserve.kernels")

# oneDNN's instruction sets, lowest first, as ONEDNN_MAX_CPU_ISA (or DNNL_MAX_CPU_ISA) names them.
ONEDNN_ISAS = (
    "SSE41",
    "AVX",
    "AVX2",
    "AVX2_VNNI",
    "AVX2_VNNI_2",
    "AVX512_CORE",
    "AVX512_CORE_VNNI",
    "AVX512_CORE_BF16",
    "AVX10_1_512",
    "AVX512_CORE_FP16",
    "AVX10_1_512_AMX",
    "AVX512_CORE_AMX",
    "AVX10_1_512_AMX_FP16",
    "AVX512_CORE_AMX_FP16",
    "AVX10_2_512",
    "AVX10_2_512_AMX_2",
    "ALL",
    "DEFAULT",
)
BF16_FLAGS = ("avx512_bf16", "amx_bf16", "avx_ne_convert")  # bf16 arithmetic in hardware
VNNI_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")  # int8 dot products in hardware


# ---------------------------------------------------------------------------------------------
# What the CPU has, as torch reports it
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CpuInfo:
    name: str  # the processor's name, as cpuinfo reads it
    capability: str  # ATen's vector ISA: "DEFAULT", "AVX2", "AVX512", ... (ATEN_CPU_CAPABILITY lowers it)
    flags: frozenset[str]  # the BF16_FLAGS and VNNI_FLAGS (and avx2) that the processor has
    onednn_limit: str | None  # ONEDNN_MAX_CPU_ISA as set, upper-cased; None when unset
    mkldnn_bf16: bool  # torch.ops.mkldnn._is_mkldnn_bf16_supported(): oneDNN can run bf16 here at all
    cores: int

    def onednn_allows(self, isa: str) -> bool:
        """Whether ONEDNN_MAX_CPU_ISA leaves oneDNN `isa` (an unknown limit is read as no limit)."""
        if self.onednn_limit not in ONEDNN_ISAS:
            return True
        return ONEDNN_ISAS.index(self.onednn_limit) >= ONEDNN_ISAS.index(isa)

    @property
    def bf16_native(self) -> bool:
        """bf16 in hardware, and oneDNN allowed to use it."""
        return (
            self.mkldnn_bf16
            and bool(self.flags & set(BF16_FLAGS))
            and self.onednn_allows("AVX2_VNNI_2" if "avx_ne_convert" in self.flags else "AVX512_CORE_BF16")
        )

    @property
    def vnni(self) -> bool:
        """int8 dot products in hardware, and oneDNN allowed to use them."""
        return bool(self.flags & set(VNNI_FLAGS)) and self.onednn_allows(
            "AVX2_VNNI" if "avx_vnni" in self.flags else "AVX512_CORE_VNNI"
        )

    def summary(self) -> str:
        """e.g. "cpu AVX2, no native bf16, no VNNI" """
        parts = [
            f"cpu {self.capability}",
            "native bf16" if self.bf16_native else "no native bf16",
            "VNNI" if self.vnni else "no VNNI",
        ]
        if self.onednn_limit:
            parts.append(f"ONEDNN_MAX_CPU_ISA={self.onednn_limit}")
        return ", ".join(parts)


_cpu: list[CpuInfo] = []


def cpu() -> CpuInfo:
    """What this CPU has, asked of torch once per process."""
    if not _cpu:
        caps = _cpuinfo_flags()
        limit = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA")
        _cpu.append(
            CpuInfo(
                name=str(caps.get("cpu_name") or "unknown"),
                capability=torch.backends.cpu.get_cpu_capability(),
                flags=frozenset(f for f in (*BF16_FLAGS, *VNNI_FLAGS, "avx2") if caps.get(f)),
                onednn_limit=limit.strip().upper() if limit else None,
                mkldnn_bf16=_mkldnn_bf16(),
                cores=int(caps.get("num_physical_cores") or os.cpu_count() or 1),
            )
        )
    return _cpu[0]


def _cpuinfo_flags() -> dict:
    """torch.cpu.get_capabilities() (cpuinfo: any OS); on a torch without it, Linux's /proc/cpuinfo."""
    get = getattr(torch.cpu, "get_capabilities", None)
    if get is not None:
        try:
            return dict(get())
        except (RuntimeError, AttributeError):
            pass
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    flags = re.search(r"^flags\s*:\s*(.+)$", text, re.M)
    name = re.search(r"^model name\s*:\s*(.+)$", text, re.M)
    present = set(flags.group(1).split()) if flags else set()  # Linux spells them as cpuinfo does
    return {**{f: f in present for f in (*BF16_FLAGS, *VNNI_FLAGS, "avx2")}, "cpu_name": name and name.group(1)}


def _mkldnn_bf16() -> bool:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


# ---------------------------------------------------------------------------------------------
# The paths: what each needs, and the probe that confirms it
# ---------------------------------------------------------------------------------------------


def _onednn_op():
    op = getattr(getattr(torch.ops, "mkldnn", None), "_linear_pointwise", None)
    return op if op is not None and torch.backends.mkldnn.is_available() else None


def _needs_onednn_fp32() -> str | None:
    if _onednn_op() is None:
        return f"torch {torch.__version__} has no oneDNN linear op"
    info = cpu()
    # Measured: with oneDNN held below AVX2 (or on a CPU without it) its GEMM ran at half MKL's speed;
    # on other architectures it is unmeasured, and torch's own BLAS is the safe choice.
    if "avx2" not in info.flags:
        return "no AVX2, where oneDNN's GEMM is not faster than torch's"
    if not info.onednn_allows("AVX2"):
        return f"ONEDNN_MAX_CPU_ISA={info.onednn_limit} holds oneDNN below AVX2, where its GEMM is slower"
    return None


def _needs_onednn_bf16() -> str | None:
    reason = _needs_onednn_fp32()
    if reason is not None:
        return reason
    if not cpu().mkldnn_bf16:
        return "oneDNN has no bf16 kernels for this CPU"
    return None


def _needs_int8_vnni() -> str | None:
    if not hasattr(torch, "_int_mm"):
        return f"torch {torch.__version__} has no torch._int_mm"
    if not cpu().vnni:
        return "no VNNI: torch._int_mm would be far slower than fp32"
    return None


def _needs_flash_varlen() -> str | None:
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401  (torch >= 2.9)
    except ImportError:
        return f"torch {torch.__version__} has no varlen_attn"
    if not torch.cuda.is_available():
        return "no CUDA device"
    major, minor = torch.cuda.get_device_capability()
    if major < 8:
        return f"cuda sm_{major}{minor}: flash attention needs sm_80 or newer"
    return None


def _inputs(*shapes, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(0)  # its own: a probe mid-run must not shift the dropout stream
    return [torch.randn(*s, generator=g).to(device=device, dtype=dtype) for s in shapes]


def _agree(name: str, got: torch.Tensor, want: torch.Tensor, atol: float, rtol: float) -> None:
    if got.shape != want.shape or not torch.allclose(got.float(), want.float(), atol=atol, rtol=rtol):
        diff = (got.float() - want.float()).abs().max().item() if got.shape == want.shape else "shape"
        raise AssertionError(f"{name} disagrees with plain torch (max |diff| {diff})")


# The fused post-ops model.compute.onednn uses (its _POSTOPS), with what each computes.
_POSTOPS = (
    ("gelu", "none", F.gelu),
    ("gelu", "tanh", lambda y: F.gelu(y, approximate="tanh")),
    ("relu", "", F.relu),
    ("tanh", "", torch.tanh),
    ("swish", "", F.silu),
)


def _probe_onednn(dtype: torch.dtype) -> None:
    """Packed and unpacked weights, every fused post-op we use, the fused residual add; fp32 also the
    two GEMMs of model.compute.onednn's backward (as a training step runs them)."""
    op, tol = torch.ops.mkldnn._linear_pointwise, (1e-5 if dtype == torch.float32 else 2e-2)
    x, w, b, add = _inputs((6, 32), (24, 32), (24,), (6, 24), dtype=dtype)
    ref = F.linear(x.float(), w.float(), b.float())
    packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
    _agree("linear", op(x, w, b, "none", [], ""), ref, tol, tol)
    _agree("packed linear", op(x, packed, b, "none", [], ""), ref, tol, tol)
    for attr, algorithm, act in _POSTOPS:
        _agree(f"fused {attr} {algorithm}".strip(), op(x, packed, b, attr, [], algorithm), act(ref), tol, tol)
    _agree("fused add", op.binary(x, add, packed, b, "add"), ref + add.float(), tol, tol)
    if dtype == torch.float32:  # the GEMMs of model.compute.onednn's backward, on transposed (strided) operands
        grad = _inputs((6, 24))[0]
        _agree("gradient of x", op(grad, w.t(), None, "none", [], ""), grad @ w, 1e-4, 1e-4)
        _agree("gradient of W", op(grad.t(), x.t(), None, "none", [], ""), grad.t() @ x, 1e-4, 1e-4)


def _probe_int8_vnni() -> None:
    g = torch.Generator().manual_seed(0)
    a = torch.randint(-127, 128, (32, 64), generator=g, dtype=torch.int8)  # _int_mm wants M > 16
    b = torch.randint(-127, 128, (64, 16), generator=g, dtype=torch.int8)
    if not torch.equal(torch._int_mm(a, b), a.int() @ b.int()):
        raise AssertionError("torch._int_mm is not exact")


def _probe_flash_varlen() -> None:
    from torch.nn.attention.varlen import varlen_attn

    here = torch.device("cuda", torch.cuda.current_device())  # enabled()'s device, set around the probe
    q, k, v = _inputs((8, 2, 16), (8, 2, 16), (8, 2, 16), dtype=torch.bfloat16, device=here)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32, device=here)
    got = varlen_attn(q, k, v, cu, cu, 5, 5)
    want = torch.cat(
        [
            F.scaled_dot_product_attention(*(t[a:b].transpose(0, 1) for t in (q, k, v))).transpose(0, 1)
            for a, b in ((0, 3), (3, 8))
        ]
    )
    _agree("varlen attention", got, want, 2e-2, 2e-2)  # type: ignore[arg-type]  # (a pair only with return_aux)


@dataclass
class _Path:
    needs: Callable[[], str | None]  # None when the machine has what the path needs, else why not
    probe: Callable[[], None]  # raises when the path fails or disagrees with plain torch
    decided: bool | None = None  # the machine's answer, asked and probed; None: not asked yet
    why: str = ""  # why `decided`
    machine: bool = True  # False: off because the machine lacks what it needs (`why` says what)
    forced: bool | None = None  # override(): wins over `decided` while set
    lock: threading.Lock = field(default_factory=threading.Lock)


PATHS: dict[str, _Path] = {
    "onednn-fp32": _Path(_needs_onednn_fp32, lambda: _probe_onednn(torch.float32)),
    "onednn-bf16": _Path(_needs_onednn_bf16, lambda: _probe_onednn(torch.bfloat16)),
    "int8-vnni": _Path(_needs_int8_vnni, _probe_int8_vnni),
    "flash-varlen": _Path(_needs_flash_varlen, _probe_flash_varlen),
}


# ---------------------------------------------------------------------------------------------
# Deciding, failing, forcing
# ---------------------------------------------------------------------------------------------


def enabled(name: str, device: torch.device | None = None) -> bool:
    """Whether path `name` runs now; its first call asks the machine and runs the probe, on `device` when it is
    a GPU (the model's own: `cuda:1` is probed there, not on the current device, GPU 0)."""
    path = PATHS[name]
    if path.forced is not None:
        return path.forced
    if path.decided is None:
        with torch.cuda.device(device) if device is not None and device.type == "cuda" else contextlib.nullcontext():
            _decide(name, path)
    return bool(path.decided)


def expected(name: str) -> bool:
    """Whether path `name` runs, without running its probe: as forced or decided, else what the machine has
    (a memory estimate asks this before the first model is loaded)."""
    path = PATHS[name]
    if path.forced is not None:
        return path.forced
    if path.decided is not None:
        return bool(path.decided)
    return path.needs() is None


def status(name: str, device: torch.device | None = None) -> tuple[bool, str]:
    """(on, why) for path `name`, deciding it first (on `device`, as enabled) if it is not yet decided."""
    on, path = enabled(name, device), PATHS[name]
    return on, (f"forced {'on' if on else 'off'}" if path.forced is not None else path.why)


def _decide(name: str, path: _Path) -> None:
    with path.lock:
        if path.decided is not None:
            return
        reason = path.needs()
        path.machine = reason is None
        if reason is None:
            try:
                with torch.inference_mode(False), torch.enable_grad(), torch.autocast("cpu", enabled=False):
                    path.probe()
            except Exception as e:  # whatever the kernel raises: the plain path answers instead
                reason = f"its probe failed: {_describe_error(e)}"
                log.warning("kernel path %s is off for this process: %s", name, reason)
        path.decided, path.why = reason is None, reason or "confirmed by its probe"


def fail(name: str, error: BaseException) -> None:
    """Path `name` raised on a real call: off for the process, with one warning (the caller answers
    that call through the plain path)."""
    path = PATHS[name]
    with path.lock:
        if path.decided is False and path.forced is None:
            return
        path.decided, path.forced, path.machine = False, None, True
        path.why = f"raised {_describe_error(error)}"
    log.warning("kernel path %s is off for this process: it %s; the plain path answers instead", name, path.why)


def override(name: str, on: bool | None) -> bool:
    """Force path `name` on or off for the process (tests, benchmarks), or None: back to what the
    machine decided. Returns whether it was on before."""
    old = enabled(name)
    PATHS[name].forced = on
    return old


def _describe_error(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:200]}"


# ---------------------------------------------------------------------------------------------
# What a model at a precision runs here, and why
# ---------------------------------------------------------------------------------------------


def describe(precision: str, device: str | torch.device = "cpu") -> dict[str, str]:
    """{"kernels": ..., "why": ...} for a model served at `precision` ("fp32", "bf16", "int8") on
    `device`, from the paths' current state (deciding them if need be)."""
    device = torch.device(device)
    if device.type == "cuda":
        return _describe_cuda(precision, device)
    info = cpu()
    fp32_on, fp32_why = status("onednn-fp32")
    gemm = "onednn-fp32" if fp32_on else "torch-fp32"
    if precision == "fp32":
        return {"kernels": gemm, "why": info.summary() + ("" if fp32_on else f"; oneDNN off: {fp32_why}")}
    if precision not in ("bf16", "int8"):
        raise ValueError(f"unknown precision {precision!r}")
    name = "onednn-bf16" if precision == "bf16" else "int8-vnni"
    on, why = status(name)
    if on and (precision == "int8" or info.bf16_native):
        return {"kernels": name, "why": info.summary()}
    if on:  # oneDNN runs bf16 on a CPU without it in hardware (AVX-512 without avx512_bf16)
        return {"kernels": name, "why": f"{info.summary()}: oneDNN emulates bf16, slower than fp32"}
    off = f"; {name} off: {why}" if PATHS[name].machine or PATHS[name].forced is not None else ""
    return {
        "kernels": f"{precision}-emulated ({gemm})",
        "why": f"{info.summary()}: {precision} weights, GEMMs in fp32, emulated and slower than fp32{off}",
    }


def _describe_cuda(precision: str, device: torch.device) -> dict[str, str]:
    major, minor = torch.cuda.get_device_capability(device)
    where = f"cuda sm_{major}{minor} ({torch.cuda.get_device_name(device)})"
    if precision != "bf16":
        return {"kernels": f"cuda-{precision}", "why": where}
    on, why = status("flash-varlen", device)
    kernels = "cuda-bf16, flash-varlen" if on else "cuda-bf16, padded SDPA"
    return {"kernels": kernels, "why": where if on else f"{where}; flash varlen off: {why}"}


_warned: set[str] = set()


def warn_if_emulated(precision: str, device: str | torch.device = "cpu") -> dict[str, str]:
    """describe(), plus one warning per process and precision when that precision is emulated here."""
    plan = describe(precision, device)
    if "emulat" in plan["why"] and precision not in _warned:
        _warned.add(precision)
        log.warning("%s is emulated on this machine, and slower than fp32: %s", precision, plan["why"])
    return plan
