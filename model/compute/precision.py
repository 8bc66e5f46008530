"""Reduced precision for inference, chosen per model: "fp32", "bf16" or "int8";
`recommended_precision(device)` picks one for a GPU (what a serving "auto" setting means there; `recommendation`
adds why). On a CPU "auto" is chosen per model, by the accuracy measured on its card for that kind of CPU
(model/precision_choice.py).

    from model.compute.precision import apply_precision
    model = apply_precision(BertModel.from_pretrained(path), "bf16")

fp32  Full precision. On CPU the dense layers already run through oneDNN (model/compute/onednn.py).
bf16  Every weight and activation in bfloat16 (model.to(torch.bfloat16)); LayerNorm, softmax and
      the losses still accumulate in fp32 inside their kernels. Outputs are cast back to fp32, so
      callers see the same dtypes as ever. Fast where the hardware does bf16 natively: CPUs with
      avx512_bf16, AMX or avx_ne_convert (see `bf16_native`), and CUDA GPUs from Ampere on.
      Elsewhere it still runs, emulated: the GEMMs are computed in fp32 on the bf16 numbers
      (model.compute.onednn), correct but slower than fp32; the service warns once.
int8  Dynamic W8A8 quantisation of the encoder's Linear layers (Int8Linear below): int8 weights
      with one scale per output channel, activations quantised on the fly with one scale per
      token, an exact int8 x int8 -> int32 GEMM (torch._int_mm where the CPU has VNNI or AMX;
      elsewhere the same values multiplied in fp32, emulated and slower than fp32), then
      rescaled to fp32. CPU only, inference only. The heads (pooler, classifier, MLM transform and
      the decoder, which is the word-embedding matrix itself) stay fp32: a small share of the time
      and most of the accuracy risk. Why not torch.ao's quantize_dynamic: its activations are
      quantised per tensor to 7 bits, which cost MiniLM's embeddings a mean cosine of 0.947 (0.98
      with per-channel weights) and 88% classification agreement, where per-token scales keep
      the cosine above 0.995; and torch.ao.quantization is deprecated in favour of torchao. It is
      faster, though (fused kernels): bench/precision_bench.py times both.

Which kernels run at each precision on this machine is model.compute.kernels' choice (`describe`).

Measured costs against fp32 (bench/precision_bench.py prints them for this machine): the sentence
embedding cosine, fill-mask top-1 agreement and classification agreement on the same inputs.

`autocast(device, precision)` is the training-side counterpart: mixed precision with fp32 weights
(the trainer's choice), a no-op for fp32.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import TypeVar

import torch
from torch import nn

from model.compute import kernels
from model.compute.onednn import linear
from model.options import PRECISIONS

log = logging.getLogger(__name__)


# Rows (tokens) an Int8Linear quantises and multiplies at a time. Its steps beside the GEMM (the per-token scales,
# the int8 copy, the int32 result and its rescaling) each pass over a whole (M, K) or (M, N) block; once those
# blocks outgrow the caches every step runs at memory speed. MiniLM on AVX-512 with VNNI, int8 against fp32, all
# rows at once / 512 at a time: 0.85x / 1.21x at 1,024 tokens, 1.43x / 1.67x at 4,096, 0.88x / 1.34x at 8,192
# (`python -m bench.precision_bench --chunks 0 256 512`; 256 and 1024 were no better than 512).
CHUNK_ROWS = 512


class Int8Linear(nn.Module):
    """y = x W^T + b with W int8 (a scale per output row) and x quantised per token at each call.

    The int8 x int8 product is exact (int32 accumulation: |sum| <= K * 127^2 < 2^31 for K < 133k);
    the only error is the two roundings to int8. The state dict shows a plain Linear's `weight`
    (dequantised) and `bias`, so save_pretrained of an int8 model writes an ordinary fp32 checkpoint.
    """

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight_int8", torch.empty(0, dtype=torch.int8), persistent=False)
        self.register_buffer("weight_scale", torch.empty(0), persistent=False)
        self.register_buffer("bias", None, persistent=False)
        self._set(linear.weight.detach(), None if linear.bias is None else linear.bias.detach())

    def _set(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        weight = weight.float()
        scale = weight.abs().amax(1).clamp_min(1e-12) / 127  # (N, K) -> (N,)
        # (N, K) as a view of W^T stored contiguous: torch._int_mm takes its (K, N) operand without a copy
        self.weight_int8 = torch.round(weight / scale[:, None]).to(torch.int8).t().contiguous().t()
        self.weight_scale = scale
        self.bias = None if bias is None else bias.float().clone()

    def _gemm(self, q: torch.Tensor) -> torch.Tensor:
        """(M, K) int8 @ W^T -> (M, N) fp32: torch._int_mm where the CPU has int8 dot products (model.compute.kernels'
        "int8-vnni"), on W^T as stored ((K, N) contiguous: a transposed copy cost _int_mm 10-25% more);
        else the same values multiplied in fp32 (exact while a sum stays under 2^24, within fp32's
        rounding past it), which ran 20x faster than _int_mm without VNNI."""
        if kernels.enabled("int8-vnni"):
            try:
                return torch._int_mm(q, self.weight_int8.t()).to(torch.float32)
            except RuntimeError as e:
                kernels.fail("int8-vnni", e)
        return linear(None, q.float(), self.weight_int8.to(torch.float32, memory_format=torch.contiguous_format), None)

    def dequantized_weight(self) -> torch.Tensor:
        return (self.weight_int8.float() * self.weight_scale[:, None]).contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features).float()  # (..., K) -> (M, K)
        out = x2.new_empty(x2.shape[0], self.out_features)
        for start in range(0, x2.shape[0], CHUNK_ROWS):  # each row is quantised alone: chunks change no value
            self._rows(x2[start : start + CHUNK_ROWS], out[start : start + CHUNK_ROWS])
        return out.view(*x.shape[:-1], self.out_features)

    def _rows(self, x2: torch.Tensor, out: torch.Tensor) -> None:
        """out = x2 W^T + b for (m, K) fp32 rows, into (m, N) `out`."""
        # max |x| per token from amax and amin: the same numbers as vector_norm(inf), 4-10x faster on CPU
        scale = torch.maximum(x2.amax(1, keepdim=True), x2.amin(1, keepdim=True).neg_()).clamp_min_(1e-12).div_(127)
        q = torch.div(x2, scale).round_().to(torch.int8)
        y = self._gemm(q).mul_(scale)  # (m, K) @ (K, N)
        if self.bias is None:
            torch.mul(y, self.weight_scale, out=out)
        else:
            torch.addcmul(self.bias, y, self.weight_scale, out=out)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        destination[prefix + "weight"] = self.dequantized_weight()
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        if prefix + "weight" not in state_dict:
            missing_keys.append(prefix + "weight")
            return
        self._set(state_dict[prefix + "weight"], state_dict.get(prefix + "bias"))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def check_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; expected one of {', '.join(PRECISIONS)}")
    return precision


M = TypeVar("M", bound=nn.Module)  # the model converted, as it was given


def apply_precision(model: M, precision: str) -> M:
    """Convert `model` in place to "fp32", "bf16" or "int8" (see the module docstring); returns it.

    Works on any of our model classes. Inputs and outputs keep their dtypes at every precision
    (token ids in, fp32 tensors out), so callers need no change. "fp32" undoes "bf16" (the weights
    keep their bf16 rounding: load the model again for the exact fp32 weights); an int8 model
    cannot be converted back at all. int8 needs a CPU model in eval mode and is for serving, not
    training; save_pretrained of an int8 model writes its dequantised weights as a normal fp32
    checkpoint. Raises ValueError, quoting the value, for an unknown precision or an impossible
    conversion (int8 on GPU, in training mode, or from int8 to anything else).

    Which is faster depends on the CPU (docs/gpus.md, "CPUs"): bf16 where `bf16_native`,
    int8 at small batches where the CPU has VNNI; without either, fp32 is the fastest.
    """
    check_precision(precision)
    current = precision_of(model)
    if current == precision:
        return model
    if current == "int8":
        raise ValueError(f"model is int8-quantised; it cannot become {precision!r}: load it again")
    if precision == "fp32":
        _cast_outputs(model, None)
        return model.float()
    if precision == "bf16":
        model.to(torch.bfloat16)
        _cast_outputs(model, torch.float32)
        return model
    return _quantize_int8(model)


def precision_of(model: nn.Module) -> str:
    """The precision a model runs at now: "int8", "bf16" or "fp32"."""
    if any(isinstance(m, Int8Linear) for m in model.modules()):
        return "int8"
    params = [p for p in model.parameters() if p.is_floating_point()]
    if params and all(p.dtype == torch.bfloat16 for p in params):
        return "bf16"
    return "fp32"


def autocast(device_type: str | torch.device, precision: str = "bf16"):
    """Mixed precision for a forward (and its backward): torch.autocast in bf16, or a no-op for fp32.

    The weights stay fp32 and autocast runs the matmuls in bf16; use it for training, where the
    optimizer must keep fp32 weights. int8 has no autocast form: ValueError.
    """
    check_precision(precision)
    device_type = torch.device(device_type).type
    if precision == "fp32":
        return contextlib.nullcontext()
    if precision == "bf16":
        return torch.autocast(device_type, dtype=torch.bfloat16)
    raise ValueError("int8 is a conversion of the model (apply_precision), not an autocast mode")


def resolve_precision(precision: str, device: str | torch.device) -> str:
    """A training precision setting for `device`: "auto" is bf16 autocast on CUDA, fp32 elsewhere."""
    if precision == "auto":  # bf16 only where the GPU computes it in hardware: emulated bf16 is slower than fp32
        return "bf16" if torch.device(device).type == "cuda" and bf16_native(device) else "fp32"
    if check_precision(precision) == "bf16" and torch.device(device).type == "cpu" and not bf16_native("cpu"):
        log.warning(
            "bf16 autocast on this CPU (%s) runs bf16 GEMMs without hardware support, slower than "
            "fp32: use precision fp32 here",
            kernels.cpu().summary(),
        )
    return precision


def use_tf32(device: str | torch.device, on: bool = True) -> bool:
    """On a CUDA device, fp32 matmuls through TF32 tensor cores (Ampere and later: fp32's range, 10 bits of
    mantissa, several times the speed of full fp32 GEMMs) when `on`, else full fp32; torch's own setting, so for
    the whole process. Whether TF32 is on now; a no-op (False) off CUDA."""
    if torch.device(device).type != "cuda":
        return False
    matmul = torch.backends.cuda.matmul
    if hasattr(matmul, "fp32_precision"):  # torch >= 2.9; its legacy allow_tf32 mixed with it raises
        matmul.fp32_precision = "tf32" if on else "ieee"
    else:
        matmul.allow_tf32 = on
    return on


def bf16_native(device: str | torch.device = "cpu") -> bool:
    """Whether `device` computes bf16 in hardware (else bf16 is emulated and slower than fp32). For a GPU, its
    own compute capability (`cuda:1`'s, not the current device's): sm_80 (Ampere) or newer. Not
    torch.cuda.is_bf16_supported(), which counts emulation (a T4 or V100 says True)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.get_device_capability(device) >= (8, 0)
    return device.type == "cpu" and kernels.cpu().bf16_native


def recommended_precision(device: str | torch.device = "cpu") -> str:
    """The default a service should use ("auto"): recommendation's choice."""
    return recommendation(device)[0]


def recommendation(device: str | torch.device = "cpu") -> tuple[str, str]:
    """What "auto" serves on `device` before anything is measured, and why in words: bf16 on a CUDA GPU with
    native bf16, fp32 anywhere else. On a CPU the service and `bert info` choose per model instead, from the
    accuracy its card measured on this kind of CPU (model/precision_choice.py); fp32 is what it serves until
    then. Never initialises CUDA when torch sees none."""
    device = torch.device(device)
    if device.type != "cuda":
        return "fp32", "on a CPU, until the model's precisions are measured on this kind of CPU"
    if bf16_native(device):
        return "bf16", "this GPU has native bf16"
    return "fp32", "this GPU has no native bf16"


# -- internals --------------------------------------------------------------------------------


def _encoder(model: nn.Module) -> nn.Module:
    bert = getattr(model, "bert", model)
    encoder = getattr(bert, "encoder", None)
    if encoder is None:
        raise ValueError(f"{type(model).__name__} has no BERT encoder to quantise")
    return encoder


def _quantize_int8(model: M) -> M:
    if model.training:
        raise ValueError("int8 is for inference: call model.eval() before apply_precision(model, 'int8')")
    devices = {p.device.type for p in model.parameters()}
    if devices != {"cpu"}:
        raise ValueError(f"int8 runs on CPU only; the model is on {', '.join(sorted(devices))}")
    model.float()
    for parent in list(_encoder(model).modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, Int8Linear(child))
    return model


def _cast_outputs(model: nn.Module, dtype: torch.dtype | None) -> None:
    """Make the model's floating outputs `dtype` (a forward hook), or drop that hook (None)."""
    handle = model.__dict__.pop("_precision_output_hook", None)
    if handle is not None:
        handle.remove()
    if dtype is not None:
        model.__dict__["_precision_output_hook"] = model.register_forward_hook(
            lambda module, args, output: _cast_floats(output, dtype)
        )


def _cast_floats(output, dtype: torch.dtype):
    if isinstance(output, torch.Tensor):
        return output.to(dtype) if output.is_floating_point() else output
    if dataclasses.is_dataclass(output):
        for field in dataclasses.fields(output):
            setattr(output, field.name, _cast_floats(getattr(output, field.name), dtype))
        return output
    if isinstance(output, tuple):
        return type(output)(_cast_floats(x, dtype) for x in output)
    return output
