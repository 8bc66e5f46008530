"""Dense layers, y = act(x W^T + b) + add, with a oneDNN fast path on CPU (model/modeling.py calls `dense`).

On x86 CPUs with AVX2 or better, oneDNN's fp32 GEMM runs faster than the BLAS behind F.linear (the
docs/gpus.md has the numbers per CPU kind), fuses the bias, activation and residual
add into the GEMM, and is still plain fp32 arithmetic. For inference the weights are reordered once
into oneDNN's layout and kept (bf16 weights too). Everything else (GPU, autocast, int8 modules,
torch.compile, a torch without oneDNN) goes through torch's own F.linear.

    dense(layer, x, act="gelu")             a module: nn.Linear (or model.compute.precision's Int8Linear)
    linear(owner, x, weight, bias)          a raw weight (the MLM decoder tied to the word embeddings)
    use_onednn(False)                       F.linear everywhere, as transformers runs (benchmarks)

Whether oneDNN runs, per dtype, is model.compute.kernels' decision ("onednn-fp32", "onednn-bf16"): asked of
the machine and confirmed by a probe at the first dense call that could use it (on CPU, big enough,
outside autocast and torch.compile), never at import. Where bf16 has no oneDNN GEMM (CPUs without
bf16 support), bf16 layers compute each GEMM in fp32 instead: the same numbers, slower than fp32.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from model.compute import kernels


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


# BertConfig.hidden_act -> function (HF's names; model.config.ACTIVATIONS lists the same keys).
ACT2FN: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,  # exact erf form, as Google's BERT and HF's "gelu"
    "gelu_new": _gelu_tanh,
    "gelu_pytorch_tanh": _gelu_tanh,
    "relu": F.relu,
    "tanh": torch.tanh,
    "silu": F.silu,
}

# ACT2FN name -> oneDNN post-op (attr, algorithm), as torch.ops.mkldnn._linear_pointwise spells them.
_POSTOPS = {
    "gelu": ("gelu", "none"),
    "gelu_new": ("gelu", "tanh"),
    "gelu_pytorch_tanh": ("gelu", "tanh"),
    "relu": ("relu", ""),
    "tanh": ("tanh", ""),
    "silu": ("swish", ""),
}

# Below about a million multiply-adds (tiny test models, one token) oneDNN's fixed ~12 us a call
# costs more than it saves; MKL takes those.
_MIN_MACS = 1 << 20


# ---------------------------------------------------------------------------------------------
# The switch: model.compute.kernels decides, per dtype, whether oneDNN runs here
# ---------------------------------------------------------------------------------------------

_PATHS = {torch.float32: "onednn-fp32", torch.bfloat16: "onednn-bf16"}  # model.compute.kernels' path names


def available() -> bool:
    """Whether the oneDNN fp32 path runs in this process (model.compute.kernels: the machine has it, its probe
    agreed, nothing switched it off)."""
    return kernels.enabled("onednn-fp32")


def use_onednn(enabled: bool) -> bool:
    """Turn the oneDNN paths (fp32 and bf16) off for every model in the process, or back to the
    machine's choice; returns whether the fp32 path was on.

    On by default wherever it works and pays (model.compute.kernels). Off means F.linear (MKL), as
    transformers runs: benchmarks use it to show what the GEMM library contributes.
    """
    old = kernels.override("onednn-fp32", None if enabled else False)
    kernels.override("onednn-bf16", None if enabled else False)
    return old


def _path(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    """The oneDNN path this call takes, or None for torch's own F.linear."""
    # is_compiling() before kernels.enabled(): the first probe must not happen inside a graph being traced.
    if not (
        x.device.type == "cpu"
        and x.dtype == weight.dtype
        and x.dtype in _PATHS
        and x.numel() * weight.shape[0] >= _MIN_MACS
        and not torch.is_autocast_enabled("cpu")
        and not torch.compiler.is_compiling()
    ):
        return None
    name = _PATHS[x.dtype]
    return name if kernels.enabled(name) else None


def _emulate_bf16(x: torch.Tensor) -> bool:
    """bf16 on a CPU whose oneDNN has no bf16 GEMM, where ATen's own bf16 GEMM ran 7x slower than
    fp32 (AVX2): each GEMM in fp32 instead (see `linear`)."""
    return (
        x.dtype == torch.bfloat16
        and x.device.type == "cpu"
        and not torch.is_autocast_enabled("cpu")
        and not torch.compiler.is_compiling()
        and not kernels.enabled("onednn-bf16")
    )


# ---------------------------------------------------------------------------------------------
# Packed weights (inference) and the three GEMMs of a training step
# ---------------------------------------------------------------------------------------------


class _PackedWeight:
    """A weight reordered once into oneDNN's blocked layout, kept beside the module that uses it.

    Only a cache: it is rebuilt when the weight changes (another tensor, new storage, or an
    in-place update that bumps `_version`), it is not a buffer (never saved), and copies of the
    module drop it (an opaque oneDNN tensor cannot be deep-copied or pickled). Costs one more copy
    of each weight's memory while the model serves.
    """

    __slots__ = ("key", "source", "tensor")

    def __init__(self, weight: torch.Tensor, tensor: torch.Tensor):
        self.source = weakref.ref(weight)  # not a strong ref: a replaced weight must not live on
        self.key, self.tensor = _weight_key(weight), tensor

    def fits(self, weight: torch.Tensor) -> bool:
        return self.source() is weight and self.key == _weight_key(weight)

    def __deepcopy__(self, memo):
        return None

    def __reduce__(self):
        return type(None), ()


def _weight_key(weight: torch.Tensor) -> tuple[int, int]:
    return weight.data_ptr(), weight._version


def _packed(owner: nn.Module | None, weight: torch.Tensor) -> torch.Tensor:
    """`weight` in oneDNN's layout for inference: at small batches the per-call reorder is a third.
    No owner (a weight made for this call only): as it is."""
    if owner is None or weight.is_inference():  # no version counter to notice changes by: as it is
        return weight
    cached = owner.__dict__.get("_onednn_packed")
    if cached is None or not cached.fits(weight):
        with torch.no_grad():
            cached = _PackedWeight(weight, torch.ops.mkldnn._reorder_linear_weight(weight, None))
        owner.__dict__["_onednn_packed"] = cached
    return cached.tensor


class _OneDnnLinear(torch.autograd.Function):
    """y = x W^T + b with all three GEMMs (forward, grad x, grad W) in oneDNN."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        linear = torch.ops.mkldnn._linear_pointwise
        g2 = grad.reshape(-1, grad.shape[-1])  # (..., out) -> (M, out)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = linear(grad, weight.t(), None, "none", [], "")  # (M, out) @ (out, in)
        if ctx.needs_input_grad[1]:
            x2 = x.reshape(-1, x.shape[-1])  # (..., in) -> (M, in)
            grad_w = linear(g2.t(), x2.t(), None, "none", [], "")  # (out, M) @ (M, in)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g2.sum(0)
        return grad_x, grad_w, grad_b


# ---------------------------------------------------------------------------------------------
# The entry points
# ---------------------------------------------------------------------------------------------


def linear(
    owner: nn.Module | None,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    act: str | None = None,
    add: torch.Tensor | None = None,
) -> torch.Tensor:
    """ACT2FN[act](x W^T + b) + add (never both act and add); `owner` keeps the packed weight.

    bf16 where oneDNN has no bf16 GEMM is computed in fp32 on the same bf16 numbers and rounded back:
    products of bf16 values are exact in fp32, so this is a bf16 GEMM with fp32 accumulation, as a
    native one. A oneDNN call that raises switches its path off (model.compute.kernels.fail) and is answered
    by F.linear.
    """
    if _emulate_bf16(x):
        up_bias, up_add = (None if t is None else t.float() for t in (bias, add))
        return linear(None, x.float(), weight.float(), up_bias, act, up_add).to(torch.bfloat16)
    path = _path(x, weight)
    if path is None:
        return _epilogue(F.linear(x, weight, bias), act, add)
    try:
        return _onednn_linear(owner, x, weight, bias, act, add)
    except RuntimeError as e:
        y = _epilogue(F.linear(x, weight, bias), act, add)  # raises too where the inputs, not the kernel, are wrong
        kernels.fail(path, e)
        return y


def _onednn_linear(
    owner: nn.Module | None,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    act: str | None,
    add: torch.Tensor | None,
) -> torch.Tensor:
    if not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):  # inference
        packed = _packed(owner, weight)
        if add is not None:
            return torch.ops.mkldnn._linear_pointwise.binary(x, add, packed, bias, "add")
        attr, algorithm = _POSTOPS[act] if act else ("none", "")
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, attr, [], algorithm)
    y = (_OneDnnLinear.apply if x.dtype == torch.float32 else F.linear)(x, weight, bias)
    return _epilogue(y, act, add)


def _epilogue(y: torch.Tensor, act: str | None, add: torch.Tensor | None) -> torch.Tensor:
    if act:
        y = ACT2FN[act](y)
    return y if add is None else y + add


def dense(layer: nn.Module, x: torch.Tensor, act: str | None = None, add: torch.Tensor | None = None) -> torch.Tensor:
    """ACT2FN[act](layer(x)) + add for a Linear `layer`, by oneDNN where it fits (see the module docstring).

    A plain nn.Linear is not called as a module (no per-call module overhead), so forward hooks
    on it do not fire; any other module (model.compute.precision's Int8Linear) is called as it is.
    """
    if type(layer) is nn.Linear:
        return linear(layer, x, layer.weight, layer.bias, act, add)
    return _epilogue(layer(x), act, add)
