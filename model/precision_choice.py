"""What `auto` serves on a CPU, chosen by measurement: each precision this CPU runs natively is measured against fp32
on a few held-out texts, for every output the model's heads give, and timed; the fastest one whose every
output keeps within the bounds is served.

    kind = cpu_kind()                                   # "x86 avx512 bf16 vnni amx": the card's key
    row = measure(load, inputs, native_precisions())    # one row of the card's "precision" table
    precision, why = choose(row, Bounds())              # ("bf16", "embeddings min cosine 0.99991 ≥ ...")
    precision, why = auto_choice(card["precision"])     # the same for this CPU from a card's table (None: no row)

The outputs, each against fp32's on the same inputs (model.model_card builds the inputs from the held-out set):

    embeddings      every model: mean-pooled last hidden states of single sentences; min and mean cosine
    classification  a sequence classifier with 2+ labels: argmax agreement per sentence
    reranking       a cross-encoder (one label): per query, the fp32 order of its candidates (ten) against this
                    precision's: the share of candidate pairs ordered alike (1.0: the same order)
    token_labels    a token classifier: argmax agreement per real token
    qa              question answering: start and end argmax agreement
    fill_mask       a masked-LM head: top-5 overlap at the masked positions (|top5 ∩ fp32 top5| / 5, mean)
    nsp             a next-sentence head: argmax agreement

Bounds (Bounds, the service's settings): min cosine ≥ 0.999, agreement ≥ 99.5% (classification, reranking,
token labels, qa, nsp), top-5 overlap ≥ 99%.

Speed is timed on two batches, since a precision's gain depends on the pass: TIMING_ROWS short texts (the held-out
sentences) and LONG_ROWS long ones (LONG_TOKENS tokens of held-out text each). fp32's time over this precision's on
each is "speed_short" and "speed_long"; "speed", the one that orders the candidates, is the lower of the two. On an
AVX-512 CPU with VNNI, MiniLM's int8 measured up to 1.85x fp32 on the short texts against bf16's 1.5x, yet ran
1.3-1.7x on passes of 4,096 to 8,192 tokens where bf16 ran 1.7-1.9x: a precision is credited with its worse case.

The cost is bounded: each precision loads the model once (in memory: the fp32 copy and one other at a time,
beside fp32's outputs: at most MAX_TEXTS x MAX_TOKENS hidden states and top-5 ids) and runs one forward pass per
output over at most MAX_TEXTS rows of MAX_TOKENS tokens, then, taking turns with fp32's (the best of each counts),
a warm-up and TIMING_REPEATS timed passes of the short texts and a warm-up and LONG_REPEATS of the long ones. The
speeds are this CPU's, as loaded as it was then: shown, and used to order the candidates, never asserted. With
fp32, bf16 and int8 on two cores the whole measurement took 3.7 s for MiniLM and 34 s for bert-base with its MLM
and NSP heads, 11 s of it the long texts.
"""

from __future__ import annotations

import gc
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from model.compute import kernels
from model.compute.precision import apply_precision
from model.modeling import (
    BertForMaskedLM,
    BertForPreTraining,
    BertForQuestionAnswering,
    BertForSequenceClassification,
    BertForTokenClassification,
)

MAX_TEXTS = 32  # held-out sentences (and masked pairs) per output
MAX_TOKENS = 64  # tokens per row, [CLS] and [SEP] included
RERANK_QUERIES = 4  # queries of a cross-encoder, each with RERANK_CANDIDATES candidates
RERANK_CANDIDATES = 10
TIMING_ROWS = 16
LONG_ROWS = 8  # long texts timed, each LONG_TOKENS tokens (or the model's max_position_embeddings if fewer)
LONG_TOKENS = 128
LONG_REPEATS = 2
TIMING_REPEATS = 5

# What each output is called in words (the reasons GET /models shows), and which bound it is held to.
OUTPUTS = {
    "embeddings": ("embeddings min cosine", "cosine"),
    "classification": ("classification agreement", "agreement"),
    "reranking": ("reranking order agreement", "agreement"),
    "token_labels": ("token-label agreement", "agreement"),
    "qa": ("answer-span agreement", "agreement"),
    "fill_mask": ("fill-mask top-5 overlap", "top5"),
    "nsp": ("next-sentence agreement", "agreement"),
}
METRIC = {"cosine": "min_cosine", "agreement": "agreement", "top5": "top5_overlap"}  # the value a bound reads


@dataclass(frozen=True)
class Bounds:
    """The least accuracy against fp32 a precision must keep on every output to be chosen."""

    cosine: float = 0.999  # embeddings: the lowest cosine over the texts
    agreement: float = 0.995  # labels, reranking order, answer spans, next sentence
    top5: float = 0.99  # fill-mask: top-5 overlap


# ---------------------------------------------------------------------------- the CPU


def cpu_kind(info: kernels.CpuInfo | None = None) -> str:
    """The card's key for this kind of CPU: architecture, ATen's vector ISA, then what it has natively (as far as
    ONEDNN_MAX_CPU_ISA lets oneDNN use it): "x86 avx512 bf16 vnni amx", "x86 avx2", "arm default"."""
    info = info or kernels.cpu()
    machine = platform.machine().lower()
    arch = (
        "x86"
        if machine in ("x86_64", "amd64", "i386", "i686")
        else "arm"
        if machine.startswith(("arm", "aarch"))
        else machine
    )
    parts = [arch or "unknown", info.capability.lower()]
    if info.bf16_native:
        parts.append("bf16")
    if info.vnni:
        parts.append("vnni")
    if {"amx_bf16", "amx_int8"} & info.flags and info.onednn_allows("AVX512_CORE_AMX"):
        parts.append("amx")
    return " ".join(parts)


def native_precisions(info: kernels.CpuInfo | None = None) -> list[str]:
    """The precisions this CPU runs natively, fp32 first: bf16 where bf16_native, int8 where it has VNNI (or AMX).
    The others run emulated, slower than fp32, and are never chosen."""
    info = info or kernels.cpu()
    return ["fp32", *(["bf16"] if info.bf16_native else []), *(["int8"] if info.vnni else [])]


# ---------------------------------------------------------------------------- measuring


def outputs_of(model: nn.Module) -> list[str]:
    """The outputs a model's heads give (OUTPUTS' names), embeddings first."""
    outputs = ["embeddings"]
    if isinstance(model, BertForSequenceClassification):
        outputs.append("reranking" if model.config.num_labels == 1 else "classification")
    if isinstance(model, BertForTokenClassification):
        outputs.append("token_labels")
    if isinstance(model, BertForQuestionAnswering):
        outputs.append("qa")
    if isinstance(model, (BertForMaskedLM, BertForPreTraining)):
        outputs.append("fill_mask")
    if isinstance(model, BertForPreTraining):
        outputs.append("nsp")
    return outputs


@torch.no_grad()
def measure(
    load: Callable[[], nn.Module],
    inputs: dict[str, dict[str, torch.Tensor]],
    precisions: list[str] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, Any]:
    """One row of the card's table: {"measured", "outputs", "precisions": {p: {"speed", <output>: {...}}}}.

    `load` gives a fresh fp32 model on the CPU, in eval mode (called once, then once per other precision); `inputs`
    holds the batches: "texts" (single sentences), "pairs" (a cross-encoder's RERANK_QUERIES x RERANK_CANDIDATES
    rows, query-major), "masked" (masked pairs with "masked_positions"), "long" (LONG_ROWS long texts, timed only),
    each input_ids, token_type_ids, attention_mask. The fp32 model stays loaded beside one other precision's at a
    time: their timed passes take turns, so a machine that gets busier or quieter meanwhile slows both alike."""
    precisions = precisions or native_precisions()
    fp32 = load().eval()
    reference = _outputs(fp32, inputs)
    row: dict[str, Any] = {
        "measured": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "outputs": list(reference),
        "precisions": {"fp32": {"speed": 1.0}},
    }
    for precision in (p for p in precisions if p != "fp32"):
        model = apply_precision(load().eval(), precision)
        outputs = _outputs(model, inputs)
        speeds = {"speed_short": _speed(fp32, model, inputs["texts"], TIMING_ROWS, TIMING_REPEATS, clock)}
        if "long" in inputs:
            speeds["speed_long"] = _speed(fp32, model, inputs["long"], LONG_ROWS, LONG_REPEATS, clock)
        del model
        gc.collect()
        scores = {name: _compare(name, reference[name], outputs[name]) for name in reference}
        row["precisions"][precision] = {"speed": min(speeds.values()), **speeds, **scores}
    return row


def _outputs(model: nn.Module, inputs: dict[str, dict[str, torch.Tensor]]) -> dict[str, Any]:
    texts = inputs["texts"]
    encoder = getattr(model, "bert", model)
    hidden = encoder(**texts).last_hidden_state.float()  # (B, T, H)
    mask = texts["attention_mask"].unsqueeze(-1).float()  # (B, T) -> (B, T, 1)
    out: dict[str, Any] = {"embeddings": (hidden * mask).sum(1) / mask.sum(1).clamp_min(1)}
    for name in outputs_of(model)[1:]:
        if name == "classification":
            out[name] = model(**texts).logits.argmax(-1)
        elif name == "reranking":
            out[name] = model(**inputs["pairs"]).logits.float().view(RERANK_QUERIES, -1)  # (Q*C, 1) -> (Q, C)
        elif name == "token_labels":
            out[name] = model(**texts).logits.argmax(-1)[texts["attention_mask"].bool()]
        elif name == "qa":
            o = model(**inputs["pairs"])
            out[name] = torch.stack([o.start_logits.argmax(-1), o.end_logits.argmax(-1)])
        elif name == "fill_mask":
            o = model(**inputs["masked"])
            logits = o.prediction_logits if hasattr(o, "prediction_logits") else o.logits  # (N, V)
            out[name] = logits.float().topk(min(5, logits.shape[-1]), dim=-1).indices
            if isinstance(model, BertForPreTraining):
                out["nsp"] = o.seq_relationship_logits.argmax(-1)
    return out


def _compare(name: str, ref: torch.Tensor, got: torch.Tensor) -> dict[str, float]:
    if name == "embeddings":
        cos = F.cosine_similarity(ref, got, dim=-1)
        return {"min_cosine": round(float(cos.min()), 6), "mean_cosine": round(float(cos.mean()), 6)}
    if name == "fill_mask":
        overlap = (ref[:, :, None] == got[:, None, :]).any(-1).float().sum(-1) / ref.shape[-1]  # (N, 5) -> (N,)
        return {"top5_overlap": round(float(overlap.mean()), 6) if overlap.numel() else 1.0}
    if name == "reranking":
        order_ref = torch.sign(ref[:, :, None] - ref[:, None, :])  # (Q, C, C): which of each pair ranks higher
        order_got = torch.sign(got[:, :, None] - got[:, None, :])
        pairs = torch.triu(torch.ones_like(order_ref[0], dtype=torch.bool), diagonal=1)
        return {"agreement": round(float((order_ref == order_got)[:, pairs].float().mean()), 6)}
    return {"agreement": round(float((ref == got).float().mean()), 6) if ref.numel() else 1.0}


def _speed(
    fp32: nn.Module, model: nn.Module, texts: dict[str, torch.Tensor], rows: int, repeats: int, clock: Callable
) -> float:
    """fp32's time over `model`'s on the first `rows` of `texts` (_time_in_turns), to two decimals."""
    fp32_time, seconds = _time_in_turns(fp32, model, {k: v[:rows] for k, v in texts.items()}, repeats, clock)
    return round(fp32_time / max(seconds, 1e-9), 2)


def _time_in_turns(
    fp32: nn.Module, model: nn.Module, batch: dict[str, torch.Tensor], repeats: int, clock: Callable[[], float]
) -> tuple[float, float]:
    """The best of `repeats` passes of each model on `batch`, fp32's and the other's in turns, after a warm-up
    pass of each (oneDNN packs its weights, kernels are decided)."""
    best = [float("inf"), float("inf")]
    for repeat in range(repeats + 1):
        for i, m in enumerate((fp32, model)):
            start = clock()
            m(**batch)
            if repeat:
                best[i] = min(best[i], clock() - start)
    return best[0], best[1]


# ---------------------------------------------------------------------------- choosing


def choose(row: dict[str, Any] | None, bounds: Bounds = Bounds()) -> tuple[str, str]:
    """The fastest precision of a measured row whose every output keeps within `bounds`, and why in words (GET
    /models shows them as "<precision>: <why>"): ("bf16", "embeddings min cosine 0.99994 ≥ 0.999, 3.24× fp32 on
    this CPU") or ("fp32", "fill-mask top-5 overlap 97.8% < 99% in bf16"). fp32 for a missing or failed row."""
    if not row or not row.get("precisions"):
        return "fp32", f"the measurement failed: {row['error']}" if row and row.get("error") else "not measured"
    passing: list[tuple[float, str, list[str]]] = []
    reasons: list[str] = []
    for precision, scores in row["precisions"].items():
        if precision == "fp32":
            continue
        fails, keeps = [], []
        for output in row.get("outputs", []):
            label, bound_name = OUTPUTS[output]
            value, bound = scores.get(output, {}).get(METRIC[bound_name]), getattr(bounds, bound_name)
            if value is None:
                fails.append(f"{label} not measured")
            elif value < bound:
                fails.append(f"{label} {_fmt(value, bound_name)} < {_fmt(bound, bound_name)}")
            else:
                keeps.append(f"{label} {_fmt(value, bound_name)} ≥ {_fmt(bound, bound_name)}")
        speed = float(scores.get("speed", 0.0))
        if fails:
            reasons.append(f"{', '.join(fails)} in {precision}")
        elif speed <= 1.0:
            reasons.append(f"{precision} keeps every bound but ran {speed:g}× fp32")
        else:
            passing.append((speed, precision, keeps))
    if passing:
        speed, precision, keeps = max(passing)
        return precision, f"{', '.join(keeps)}, {speed:g}× fp32 on this CPU"
    return "fp32", "; ".join(reasons) if reasons else "no faster precision is native on this CPU"


def auto_choice(
    table: dict[str, Any] | None, bounds: Bounds = Bounds(), info: kernels.CpuInfo | None = None
) -> tuple[str, str] | None:
    """What auto serves on this CPU from a card's "precision" table, and why: fp32 where only fp32 is native (no
    measurement needed), else `choose` on this kind of CPU's row; None when the table has no row for it."""
    kind = cpu_kind(info)
    if native_precisions(info) == ["fp32"]:
        return "fp32", f"only fp32 is native on this kind of CPU ({kind})"
    row = (table or {}).get(kind)
    if row is None:
        return None
    precision, why = choose(row, bounds)
    return precision, f"measured on {kind}: {why}"


def _fmt(value: float, bound_name: str) -> str:
    if bound_name == "cosine":
        return f"{value:.6g}"
    return f"{100 * value:.4g}%"
