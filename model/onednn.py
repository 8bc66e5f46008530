"""Dense layers, y = act(x W^T + b) + add, with a oneDNN fast path on CPU (model/modeling.py calls `dense`).

On CPU in fp32, oneDNN's GEMM ran 2-2.5x faster than the MKL sgemm behind F.linear on an AMD EPYC
(on an Intel Xeon, MKL's home ground, about as fast; bench/model_bench.py --ablate measures both),
fuses the bias, activation and residual add into the GEMM, and is still plain fp32 arithmetic. For
inference the weights are reordered once into oneDNN's layout and kept (bf16 weights too).
Everything else (GPU, autocast, int8 modules, torch.compile, a torch without oneDNN) goes through
torch's own F.linear.

    dense(layer, x, act="gelu")             a module: nn.Linear (or model.precision's Int8Linear)
    linear(owner, x, weight, bias)          a raw weight (the MLM decoder tied to the word embeddings)
    use_onednn(False)                       F.linear everywhere, as transformers runs (benchmarks)

Whether this torch's oneDNN works is probed once, not at import: at the first dense call that could
use it (on CPU, fp32 or bf16, big enough, outside autocast and torch.compile), or at use_onednn.
"""

from __future__ import annotations

import functools
import weakref

import torch
import torch.nn.functional as F
from torch import nn


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


# BertConfig.hidden_act -> function (HF's names; model.config.ACTIVATIONS lists the same keys).
ACT2FN = {
    "gelu": F.gelu,  # exact erf form, as Google's BERT and HF's "gelu"
    "gelu_new": _gelu_tanh,
    "gelu_pytorch_tanh": _gelu_tanh,
    "relu": F.relu,
    "tanh": torch.tanh,
    "silu": F.silu,
}

# ACT2FN name -> oneDNN post-op (attr, algorithm), as torch.ops.mkldnn._linear_pointwise spells them.
_POSTOPS = {"gelu": ("gelu", "none"), "gelu_new": ("gelu", "tanh"), "gelu_pytorch_tanh": ("gelu", "tanh"),
            "relu": ("relu", ""), "tanh": ("tanh", ""), "silu": ("swish", "")}

# Below about a million multiply-adds (tiny test models, one token) oneDNN's fixed ~12 us a call
# costs more than it saves; MKL takes those.
_MIN_MACS = 1 << 20


# ---------------------------------------------------------------------------------------------
# The switch: on wherever oneDNN works, decided at the first call
# ---------------------------------------------------------------------------------------------

@functools.cache
def available() -> bool:
    """Whether this torch has oneDNN's fused linear and it agrees with F.linear (probed once, then cached)."""
    op = getattr(getattr(torch.ops, "mkldnn", None), "_linear_pointwise", None)
    if op is None or not torch.backends.mkldnn.is_available():
        return False
    try:
        g = torch.Generator().manual_seed(0)  # its own: probing mid-run must not shift the dropout stream
        x, w, b = torch.randn(3, 8, generator=g), torch.randn(5, 8, generator=g), torch.randn(5, generator=g)
        return torch.allclose(op(x, w, b, "none", [], ""), F.linear(x, w, b), atol=1e-5)
    except (RuntimeError, NotImplementedError):
        return False


_onednn: dict[str, bool | None] = {"enabled": None}  # None: not decided yet (see _enabled)


def _enabled() -> bool:
    if _onednn["enabled"] is None:
        _onednn["enabled"] = available()
    return _onednn["enabled"]


def use_onednn(enabled: bool) -> bool:
    """Turn the oneDNN fp32 CPU path on or off for every model in the process; returns the old setting.

    On by default wherever it works. Off means F.linear (MKL), as transformers runs: benchmarks use
    it to show what the GEMM library contributes.
    """
    old = _enabled()
    _onednn["enabled"] = bool(enabled) and available()
    return old


def _fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    # is_compiling() before _enabled(): the first probe must not happen inside a graph being traced.
    return (x.device.type == "cpu" and x.dtype == weight.dtype and x.dtype in (torch.float32, torch.bfloat16)
            and x.numel() * weight.shape[0] >= _MIN_MACS and not torch.is_autocast_enabled("cpu")
            and not torch.compiler.is_compiling() and _enabled())


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


def _packed(owner: nn.Module, weight: torch.Tensor) -> torch.Tensor:
    """`weight` in oneDNN's layout for inference: at small batches the per-call reorder is a third."""
    if weight.is_inference():  # no version counter to notice changes by: use it as it is
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

def linear(owner: nn.Module, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           act: str | None = None, add: torch.Tensor | None = None) -> torch.Tensor:
    """ACT2FN[act](x W^T + b) + add (never both act and add); `owner` keeps the packed weight."""
    if _fits(x, weight):
        if not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):  # inference
            packed = _packed(owner, weight)
            if add is not None:
                return torch.ops.mkldnn._linear_pointwise.binary(x, add, packed, bias, "add")
            attr, algorithm = _POSTOPS[act] if act else ("none", "")
            return torch.ops.mkldnn._linear_pointwise(x, packed, bias, attr, [], algorithm)
        y = (_OneDnnLinear.apply if x.dtype == torch.float32 else F.linear)(x, weight, bias)
    else:
        y = F.linear(x, weight, bias)
    if act:
        y = ACT2FN[act](y)
    return y if add is None else y + add


def dense(layer: nn.Module, x: torch.Tensor, act: str | None = None,
          add: torch.Tensor | None = None) -> torch.Tensor:
    """ACT2FN[act](layer(x)) + add for a Linear `layer`, by oneDNN where it fits (see the module docstring).

    A plain nn.Linear is not called as a module (no per-call module overhead), so forward hooks
    on it do not fire; any other module (model.precision's Int8Linear) is called as it is.
    """
    if type(layer) is nn.Linear:
        return linear(layer, x, layer.weight, layer.bias, act, add)
    y = layer(x)
    if act:
        y = ACT2FN[act](y)
    return y if add is None else y + add
