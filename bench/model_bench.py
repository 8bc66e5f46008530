"""Inference speed: our BERT against transformers (attn_implementation="sdpa") on identical random weights.

Cases per shape:
  encoder    BertModel forward, last_hidden_state (the embeddings route);
  fill-mask  one [MASK] per sequence: ours BertForMaskedLM(masked_positions=...) -> (B, V) logits,
             transformers' BertForMaskedLM full (B, T, V) logits, then indexed at the masks;
  padded     (opt-in) the encoder on a ragged batch: lengths drawn from [seq/4, seq], about 37%
             padding, where ours runs packed (real tokens only) and transformers masks.
Both sides get the same ids and attention_mask (all ones but for `padded`), under
torch.inference_mode, timed in turns (bench/common.py). Every shape also checks the outputs agree:
max |diff| of the hidden states, identical top-5 tokens for fill-mask.

"% peak" = useful FLOPs (the encoder; for fill-mask plus the MLM head at the masked positions only)
per second, over the best GEMM of the run's precision this machine ran in the same process (the larger of
a 2048^3 torch.mm and the same GEMM through oneDNN; both are printed).

--precision bf16 runs both in bf16: ours as the service loads it (model.compute.precision.apply_precision),
transformers' cast with .to(torch.bfloat16); "% peak" is then over the bf16 GEMM peak (on AMX its tiles,
elsewhere AVX-512's bf16 dot products; emulated where the CPU has neither, which the machine line says).

    .venv/bin/python -m bench.model_bench --quick       # ~1 minute
    .venv/bin/python -m bench.model_bench               # everything, ~7 minutes on 2 cores (base dominates)
    .venv/bin/python -m bench.model_bench --configs small --cases encoder padded --ablate
    .venv/bin/python -m bench.model_bench --configs base --cases encoder --precision bf16 --batches 1 8 32
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import transformers

from bench.common import CONFIGS, gemm_flops, interleaved, machine_line, markdown_table, setup, si
from model.compute.onednn import use_onednn
from model.compute.precision import apply_precision
from model.config import BertConfig
from model.modeling import BertForMaskedLM, BertModel, compile_model

MASK_ID = 103  # [MASK] in BERT's uncased vocabulary; any id works for random weights
DEFAULT_SHAPES = {
    "small": [(b, t) for b in (1, 8, 32) for t in (16, 128)],
    "base": [(b, t) for b in (1, 8, 32) for t in (16, 128)] + [(1, 512), (8, 512)],
}


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def build(kind: str, precision: str = "fp32"):
    """transformers' BertModel and BertForMaskedLM, and ours with the very same weights, in `precision`."""
    cfg = CONFIGS[kind]
    hf_config = transformers.BertConfig(**cfg, attn_implementation="sdpa")
    hf_enc = transformers.BertModel(hf_config).eval()
    hf_mlm = transformers.BertForMaskedLM(hf_config).eval()
    ours_enc, ours_mlm = BertModel(BertConfig(**cfg)).eval(), BertForMaskedLM(BertConfig(**cfg)).eval()
    ours_enc.load_state_dict(hf_enc.state_dict(), strict=True)
    ours_mlm.load_state_dict(
        {k: v for k, v in hf_mlm.state_dict().items() if not k.startswith("cls.predictions.decoder.")}, strict=True
    )
    if precision != "fp32":
        hf_enc, hf_mlm = hf_enc.to(DTYPES[precision]), hf_mlm.to(DTYPES[precision])
        ours_enc, ours_mlm = apply_precision(ours_enc, precision), apply_precision(ours_mlm, precision)
    return hf_enc, hf_mlm, ours_enc, ours_mlm


def useful_flops(cfg: dict, batch: int, seq: int, masked: int = 0) -> float:
    h, i, layers, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    tokens = batch * seq
    per_layer = 2 * tokens * (4 * h * h + 2 * h * i) + 4 * batch * seq * seq * h  # projections + attention
    return layers * per_layer + 2 * masked * (h * h + h * v)


def inputs(batch: int, seq: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1000, 30000, (batch, seq), generator=g)
    ids[:, 0] = 101  # [CLS]
    where = torch.randint(1, seq, (batch,), generator=g) if seq > 1 else torch.zeros(batch, dtype=torch.long)
    masked_ids = ids.clone()
    masked_ids[torch.arange(batch), where] = MASK_ID
    return ids, masked_ids, torch.ones_like(ids)


def ragged_mask(batch: int, seq: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(max(1, seq // 4), seq + 1, (batch,), generator=g)
    lengths[0] = seq  # the longest sets the padded width, as a batcher pads
    return (torch.arange(seq)[None] < lengths[:, None]).long()


def contenders(case, models, batch, seq, ablate, compiled=None):
    hf_enc, hf_mlm, ours_enc, ours_mlm = models
    ids, masked_ids, mask = inputs(batch, seq)
    positions = masked_ids == MASK_ID
    if case in ("encoder", "padded"):
        if case == "padded":
            mask = ragged_mask(batch, seq)
        real = mask.bool()
        hf = lambda: hf_enc(input_ids=ids, attention_mask=mask).last_hidden_state  # noqa: E731
        ours = lambda: ours_enc(ids, mask).last_hidden_state  # noqa: E731
        check = lambda a, b: f"max diff {(a[real] - b[real]).abs().max().item():.1e}"  # noqa: E731
    else:
        hf = lambda: hf_mlm(input_ids=masked_ids, attention_mask=mask).logits[positions]  # noqa: E731
        ours = lambda: ours_mlm(masked_ids, mask, masked_positions=positions).logits  # noqa: E731

        def check(a, b):
            return "top-5 same" if torch.equal(a.topk(5).indices, b.topk(5).indices) else "TOP-5 DIFFER"

    fns = {"hf": hf, "ours": ours}
    if ablate:
        fns["ours, torch GEMM"] = lambda: _without_onednn(ours)
    if compiled is not None and case != "fill-mask":
        fns["ours, compiled"] = lambda: compiled(ids, mask).last_hidden_state
    return fns, check, int(positions.sum())


def _without_onednn(fn):
    old = use_onednn(False)
    try:
        return fn()
    finally:
        use_onednn(old)


def run_case(kind, case, models, shapes, args, peak, compiled=None):
    cfg = CONFIGS[kind]
    rows = []
    for batch, seq in shapes:
        fns, check, masked = contenders(case, models, batch, seq, args.ablate, compiled)
        if "ours, compiled" in fns:
            with torch.inference_mode():
                start = time.perf_counter()
                fns["ours, compiled"]()
                warmup = time.perf_counter() - start
        with torch.inference_mode():
            verdict = check(fns["hf"](), fns["ours"]())
            t = interleaved(fns, rounds=args.rounds, block_s=args.block, budget_s=args.budget)
        if case == "padded":  # useful work is on the real tokens only
            flops = sum(useful_flops(cfg, 1, int(n)) for n in ragged_mask(batch, seq).sum(1))
        else:
            flops = useful_flops(cfg, batch, seq, masked if case == "fill-mask" else 0)
        tokens = batch * seq  # padding included, so tok/s compares like with like
        row = [batch, seq, t["hf"].fmt(), t["ours"].fmt(), f"{t['hf'].median / t['ours'].median:.2f}x"]
        for name in ("ours, torch GEMM", "ours, compiled"):
            if name in t:
                row += [t[name].fmt(), f"{t['hf'].median / t[name].median:.2f}x"]
        if "ours, compiled" in t:
            row += [f"{warmup:.1f} s"]
        row += [
            si(tokens / t["hf"].median),
            si(tokens / t["ours"].median),
            f"{flops / t['hf'].median / peak:.0%}",
            f"{flops / t['ours'].median / peak:.0%}",
            verdict,
        ]
        rows.append(row)
        print(f"  {kind} {case} b{batch} s{seq}: {row[4]}", file=sys.stderr, flush=True)
    headers = ["batch", "seq", "hf ms", "ours ms", "speed-up"]
    if args.ablate:
        headers += ["ours torch-GEMM ms", "speed-up"]
    if compiled is not None and case != "fill-mask":
        headers += ["ours compiled ms", "speed-up", "first call"]
    headers += ["hf tok/s", "ours tok/s", "hf % peak", "ours % peak", "outputs"]
    return markdown_table(headers, rows)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--configs", nargs="+", choices=sorted(CONFIGS), default=["small", "base"])
    p.add_argument("--cases", nargs="+", choices=["encoder", "fill-mask", "padded"], default=["encoder", "fill-mask"])
    p.add_argument("--batches", nargs="+", type=int, help="only these batch sizes")
    p.add_argument("--seqs", nargs="+", type=int, help="only these sequence lengths")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=7, help="turns per contender (median over them)")
    p.add_argument("--block", type=float, default=0.2, help="seconds of calls per turn")
    p.add_argument("--budget", type=float, default=20.0, help="seconds per shape; cuts rounds (min 3)")
    p.add_argument("--ablate", action="store_true", help="also time ours with torch's GEMM (MKL) instead of oneDNN")
    p.add_argument(
        "--compile",
        action="store_true",
        help="also time ours under torch.compile (compile_model; encoder cases; slow first calls)",
    )
    p.add_argument("--precision", choices=sorted(DTYPES), default="fp32", help="both models' precision (default fp32)")
    p.add_argument("--quick", action="store_true", help="small config, 2 shapes, 3 rounds")
    args = p.parse_args(argv)
    if args.quick:
        args.configs, args.rounds, args.budget = ["small"], 3, 5.0
        args.batches, args.seqs = args.batches or [1, 8], args.seqs or [16, 128]
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    setup(args.threads)
    dtype = DTYPES[args.precision]
    mm, dnn = gemm_flops(dtype), gemm_flops(dtype, library="onednn")
    peak = max(mm, dnn)
    print(f"## Model benchmark\n\n{machine_line()}\n")
    print(
        f"{args.precision} GEMM 2048^3: torch.mm {si(mm, 'FLOP/s')}, oneDNN {si(dnn, 'FLOP/s')}; "
        f"% peak is over {si(peak, 'FLOP/s')}. Times: median (min-max) ms per call.\n"
    )
    for kind in args.configs:
        shapes = [
            (b, t)
            for b, t in DEFAULT_SHAPES[kind]
            if (args.batches is None or b in args.batches) and (args.seqs is None or t in args.seqs)
        ]
        if not shapes:
            continue
        models = build(kind, args.precision)
        compiled = compile_model(copy.deepcopy(models[2])) if args.compile else None
        for case in args.cases:
            print(f"### {kind}, {case}\n")
            print(run_case(kind, case, models, shapes, args, peak, compiled) + "\n", flush=True)


if __name__ == "__main__":
    main()
