"""Everything a GPU must show, in one call: one markdown table (check, result, target, verdict).

Checks (each isolated: an exception is a FAIL row naming it, and the others still run):
  parity      BertModel, BertForPreTraining, BertForMaskedLM against transformers on the same random
              weights and a padded batch: fp32 max |diff| <= 1e-4 (TF32 off); our bf16 path
              (model.compute.precision.apply_precision) against fp32 transformers, cosine >= 0.999 (the mean
              over rows; the worst row is printed beside it);
  inference   BertModel tokens/s, ours against transformers (attn_implementation="sdpa", same weights)
              at B1/L16, B32/L128, B64/L512; bf16 weights on CUDA, fp32 on the CPU; medians of turns;
  training    BertForPreTraining steps (MLM + NSP, AdamW, fused on CUDA; bf16 autocast on CUDA) for the
              small and base configs, tokens/s against transformers, and model-FLOPs utilisation
              (6 x parameters x tokens/s over the GPU's dense bf16 peak: 989 TFLOP/s for H100/H200,
              else n/a); on CUDA also the host syncs in our step (torch.cuda.set_sync_debug_mode);
  service     a live `bert serve` on the device: /embeddings and /fill-mask at 32 clients (128-token
              inputs), plus a model whose tokenizer is larger than its embeddings (refused at load,
              docs/gpu-review item 2) followed by a valid request that must still answer 200;
  pretrain    a MiniLM-warm-started pretraining run (model.training.runs.run_pretraining) on the Wikipedia
              leads, its held-out MLM and NSP accuracy, and the host syncs per step of the trainer;
  review      cheap items of the GPU review: head_dim 25 and 512 models in padded bf16 eval (no crash,
              cosine to fp32), the peak GPU memory of an encode at max_batch_tokens (16384), the
              host syncs of a padded bf16 forward with the mask on the host (none expected) and of a
              fill-mask pass as the service runs it (app/serving/forward.py: its answers' copy only).

It needs nothing from the network: models are built from configs or read from the MiniLM package, the text
from the Wikipedia-leads package, transformers is the reference. Files written to --out (default $OUT, else a
temporary folder), each as soon as there is something to write: gpu_check.md (the table so far), gpu_check.json
(rows and machine), server.log (the service check's server), pretrain_metrics.jsonl, pretrain_eval.json; and
gpu_check.log (all it printed) when bench/gpu_check runs it with $OUT set.

    bench/gpu_check --device cpu --quick    # ~2.5 minutes on 2 CPU cores
    bench/gpu_check                         # on a GPU: everything, sized for about 5 minutes
    bench/gpu_check --dry-run               # the bare-machine call below, on the CPU at --tiny sizes (~130 s)

A bare GPU machine with no network (python3 with torch's CUDA build and transformers, nothing else of ours):
  1. here, with PyPI:  bench/gpu_check --prepare        (fills the git-ignored .gpu-carry/, ~55 MiB; with the
     working tree it must stay within the 64 MiB one call carries, and says so)
  2. there, in the repository root, with .gpu-carry carried:  bench/gpu_check
     (installs .gpu-carry's wheels with no network into a venv that sees the machine's torch, puts MiniLM and
     the leads where the checks read them, runs every check; results under $OUT). With the device tool:
     run(command="bench/gpu_check", carry=[".gpu-carry"], timeout_s=420): the rows written so far come back
     even if it is cut short. Then read $OUT/gpu_check.md; gpu_check.log has the install's and checks' output.
Which rows run from random weights: parity, inference, training and review (random weights by design, as both
sides share them), and the service's models (random weights on MiniLM's vocabulary); pretraining warm-starts
from MiniLM's real weights (carried in bf16, trained in fp32 with bf16 autocast).

Sizing of the full CUDA run on an H100/H200 (estimated, not yet measured): the install ~25 s; parity ~10 s;
inference 3 shapes x 2 contenders ~20-30 s (base config); training small + base ~40 s (batch 64 x 128); service
start (model load, warm-up) ~30 s + 2 endpoints x 6 s; pretraining 1,500 steps of MiniLM at batch 64 x 128
(~30 ms a step) ~60 s plus tokenising the leads ~40 s; review ~10 s; imports and CUDA start-up ~20 s: about
4-5 minutes in all.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F
import transformers

from bench.common import CONFIGS, interleaved, make_inputs, markdown_table, si
from model.compute import kernels
from model.compute.precision import apply_precision, autocast, use_tf32
from model.config import BertConfig
from model.modeling import IGNORE_INDEX, BertForMaskedLM, BertForPreTraining, BertModel

H100_CLASS_BF16_PEAK = 989e12  # dense bf16 FLOP/s of an H100 / H200 SXM (NVIDIA's data sheets)
INFERENCE_SHAPES = [(1, 16), (32, 128), (64, 512)]
MAX_BATCH_TOKENS = 16384
# --tiny (the CPU dry run: bench/gpu_prepare.py): every check at this size, to prove it runs, never to measure.
TINY = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64, vocab_size=30522)
TINY_SHAPES = [(1, 16), (4, 32)]


@dataclass
class Row:
    check: str
    result: str
    target: str
    verdict: str  # "PASS", "FAIL" or "info" (measured, no target), "n/a" (skipped here)


@dataclass
class Context:
    device: torch.device
    quick: bool
    out: Path
    work: Path  # scratch space for models and runs (not --out: that is for the few result files)
    tiny: bool = False  # every check at a toy size (the CPU dry run)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


def config_for(ctx: Context, kind: str) -> dict:
    return TINY if ctx.tiny else CONFIGS[kind]


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- 1. parity --------------------------------------------------------------------------------

PARITY_CLASSES = {
    "BertModel": (transformers.BertModel, BertModel),
    "BertForPreTraining": (transformers.BertForPreTraining, BertForPreTraining),
    "BertForMaskedLM": (transformers.BertForMaskedLM, BertForMaskedLM),
}


def twin(name: str, cfg: dict, device: torch.device, seed: int = 0):
    """transformers' model `name` (random weights, sdpa) and ours holding the very same weights."""
    hf_cls, ours_cls = PARITY_CLASSES[name]
    torch.manual_seed(seed)
    hf = hf_cls(transformers.BertConfig(**cfg, attn_implementation="sdpa")).eval()
    ours = ours_cls(BertConfig(**cfg)).eval()
    ours.load_state_dict(
        {k: v for k, v in hf.state_dict().items() if not k.startswith("cls.predictions.decoder.")}, strict=True
    )
    return hf.to(device), ours.to(device)


def padded_batch(batch: int, seq: int, vocab: int, device: torch.device, seed: int = 0):
    """Random ids and a ragged attention mask (the first row full length, the others shorter)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1000 % vocab, vocab, (batch, seq), generator=g)
    lengths = torch.randint(max(2, seq // 4), seq + 1, (batch,), generator=g)
    lengths[0] = seq
    mask = (torch.arange(seq)[None] < lengths[:, None]).long()
    types = torch.zeros_like(ids)
    types[:, seq // 2 :] = 1
    return ids.to(device), mask.to(device), (types * mask).to(device)


def outputs(model, ids, mask, types) -> list[torch.Tensor]:
    """The outputs that matter, at real tokens only (padding rows are undefined on both sides)."""
    with torch.inference_mode():
        out = model(input_ids=ids, attention_mask=mask, token_type_ids=types)
    real = mask.bool()
    if hasattr(out, "last_hidden_state"):
        return [out.last_hidden_state[real].float(), out.pooler_output.float()]
    if hasattr(out, "prediction_logits"):
        return [out.prediction_logits[real].float(), out.seq_relationship_logits.float()]
    return [out.logits[real].float()]


def row_cosines(a: list[torch.Tensor], b: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([F.cosine_similarity(x, y, dim=-1) for x, y in zip(a, b)])


def check_parity(ctx: Context, cfg: dict | None = None, batch: int = 4, seq: int = 64) -> list[Row]:
    """fp32 max |diff| and bf16 cosine of our three pretraining-family classes against transformers."""
    cfg = cfg or config_for(ctx, "small")
    use_tf32(ctx.device, False)  # fp32 parity means true fp32 GEMMs
    try:
        return parity_rows(ctx, cfg, *padded_batch(batch, seq, cfg["vocab_size"], ctx.device))
    finally:
        use_tf32(ctx.device, True)  # as the service and the trainer run fp32 on a GPU


def parity_rows(ctx: Context, cfg: dict, ids, mask, types) -> list[Row]:
    rows = []
    for name in PARITY_CLASSES:
        hf, ours = twin(name, cfg, ctx.device)
        ref = outputs(hf, ids, mask, types)
        diff = max((x - y).abs().max().item() for x, y in zip(ref, outputs(ours, ids, mask, types)))
        rows.append(Row(f"parity fp32 {name}", f"max diff {diff:.1e}", "<= 1e-4", verdict(diff <= 1e-4)))
        cos = row_cosines(ref, outputs(apply_precision(ours, "bf16"), ids, mask, types))
        rows.append(
            Row(
                f"parity bf16 {name}",
                f"cosine mean {cos.mean().item():.5f}, min {cos.min().item():.5f}",
                ">= 0.999 (mean)",
                verdict(cos.mean().item() >= 0.999),
            )
        )
    return rows


# -- 2. inference -----------------------------------------------------------------------------


def timed(contenders: dict, device: torch.device, quick: bool) -> dict:
    """Seconds per call (median of turns, bench/common.py), each call ending in a device sync."""
    fns = {name: (lambda f=f: (f(), sync(device))) for name, f in contenders.items()}
    return interleaved(fns, rounds=3 if quick else 7, block_s=0.1 if quick else 0.3, budget_s=4.0 if quick else 8.0)


def check_inference(ctx: Context) -> list[Row]:
    """Encoder tokens/s, ours vs transformers, same weights; bf16 on CUDA (as the service runs), fp32 on CPU."""
    kind = "tiny" if ctx.tiny else "base" if ctx.cuda else "small"
    hf, ours = twin("BertModel", config_for(ctx, kind), ctx.device)
    if ctx.cuda:
        hf, ours = hf.to(torch.bfloat16), apply_precision(ours, "bf16")
    rows = []
    for batch, seq in TINY_SHAPES if ctx.tiny else INFERENCE_SHAPES:
        ids = torch.randint(1000, 30000, (batch, seq), device=ctx.device)
        with torch.inference_mode():  # full rows: no mask, as the service's engine passes none for them
            t = timed(
                {
                    "hf": lambda ids=ids: hf(input_ids=ids),
                    "ours": lambda ids=ids: ours(ids),
                },
                ctx.device,
                ctx.quick,
            )
        tokens = batch * seq
        ratio = t["hf"].median / t["ours"].median
        rows.append(
            Row(
                f"inference {kind} B{batch}/L{seq} ({'bf16' if ctx.cuda else 'fp32'})",
                f"ours {si(tokens / t['ours'].median, 'tok/s')}, hf {si(tokens / t['hf'].median, 'tok/s')}, "
                f"{ratio:.2f}x",
                ">= 0.9x hf",
                verdict(ratio >= 0.9),
            )
        )
    return rows


# -- 3. training ------------------------------------------------------------------------------


def pretraining_batch(batch: int, seq: int, vocab: int, device: torch.device, seed: int = 0) -> tuple[dict, dict]:
    """(transformers' batch, ours) of the same random MLM + NSP batch. transformers' all on the device; ours as
    Trainer._to_device leaves it: the attention mask and the MLM head's masked positions on the host (the model
    reads there whether to mask and which rows the head takes, with no device sync), the rest copied
    asynchronously from pinned memory."""
    from bench.train_bench import random_batch

    host = random_batch(batch, seq, vocab, seed)
    hf = {k: v.to(device) for k, v in host.items()}
    host["masked_positions"] = host["labels"] != IGNORE_INDEX
    if device.type != "cuda":
        return hf, host
    kept = ("attention_mask", "masked_positions")
    return hf, {k: v if k in kept else v.pin_memory().to(device, non_blocking=True) for k, v in host.items()}


def train_step(model, batch: dict, device: torch.device):
    """One optimizer step as the trainer takes it: autocast (bf16 on CUDA), backward, clip, AdamW."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=device.type == "cuda")
    precision = "bf16" if device.type == "cuda" else "fp32"

    def step():
        opt.zero_grad(set_to_none=True)
        with autocast(device.type, precision):
            loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss.detach()

    return step


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return H100_CLASS_BF16_PEAK if ("H100" in name or "H200" in name) else None


def count_syncs(fn, times: int) -> int:
    """Host-device synchronisations torch reports (set_sync_debug_mode "warn") over `times` calls."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(times):
                fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return sum("synchroniz" in str(w.message) for w in caught)


def check_training(ctx: Context) -> list[Row]:
    """Training tokens/s ours vs transformers for the small and base configs, MFU on CUDA."""
    sizes = (
        {"tiny": (4, 32)}
        if ctx.tiny
        else {"small": (64, 128), "base": (64, 128)}
        if ctx.cuda
        else {"small": (8, 128) if ctx.quick else (32, 128), "base": (2, 128) if ctx.quick else (8, 128)}
    )
    rows, peak = [], peak_flops(ctx.device)
    for kind, (b, s) in sizes.items():
        cfg = config_for(ctx, kind)
        hf, ours = (m.train() for m in twin("BertForPreTraining", cfg, ctx.device))
        hf_batch, batch = pretraining_batch(b, s, cfg["vocab_size"], ctx.device)
        steps = {"hf": train_step(hf, hf_batch, ctx.device), "ours": train_step(ours, batch, ctx.device)}
        t = timed(steps, ctx.device, ctx.quick)
        tokens, params = b * s, sum(p.numel() for p in ours.parameters())
        ours_tps, hf_tps = tokens / t["ours"].median, tokens / t["hf"].median
        mfu = f"MFU ours {6 * params * ours_tps / peak:.1%}, hf {6 * params * hf_tps / peak:.1%}" if peak else "MFU n/a"
        rows.append(
            Row(
                f"training {kind} B{b}/L{s} ({'bf16 autocast' if ctx.cuda else 'fp32'})",
                f"ours {si(ours_tps, 'tok/s')}, hf {si(hf_tps, 'tok/s')}, {ours_tps / hf_tps:.2f}x; {mfu}",
                ">= 0.9x hf",
                verdict(ours_tps >= 0.9 * hf_tps),
            )
        )
        if ctx.cuda and kind in ("small", "tiny"):
            n = count_syncs(steps["ours"], 3)
            rows.append(
                Row(
                    "host syncs in our training step",
                    f"{n / 3:.1f} per step (3 steps)",
                    "0 (clip_grad_norm and AdamW without .item())",
                    verdict(n == 0),
                )
            )
    return rows


# -- 4. the service ---------------------------------------------------------------------------


def save_bad_vocab_model(data_dir: Path) -> None:
    """A model whose tokenizer (MiniLM, 30,522 tokens) is larger than its 1,000-row embeddings."""
    from bench.live import MINILM_DIR
    from model.tokenizer import BertTokenizer

    tokenizer = BertTokenizer.from_pretrained(MINILM_DIR)
    config = BertConfig(
        vocab_size=1000, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64
    )
    BertModel(config).save_pretrained(data_dir / "models" / "bad-vocab", tokenizer=tokenizer)


def check_service(ctx: Context) -> list[Row]:
    """/embeddings and /fill-mask at 32 clients on a live server on the device; item 2 of the review."""
    from bench import live, serve_bench

    data_dir = ctx.work / "serve"
    tokenizer = live.save_models(data_dir)
    save_bad_vocab_model(data_dir)
    proc, port = live.start_server(data_dir, log=ctx.out / "server.log", DEVICE=str(ctx.device), MAX_QUEUE="1024")
    rows, seconds = [], 1.0 if ctx.tiny else 2.0 if ctx.quick else 5.0
    try:
        status, body = asyncio.run(
            live.one_request(
                port, "POST", "/embeddings", json.dumps({"inputs": "hello", "model": "bad-vocab"}).encode()
            )
        )
        ok_status, _ = asyncio.run(live.one_request(port, "POST", "/embeddings", b'{"inputs": "hello world"}'))
        rows.append(
            Row(
                "out-of-range vocabulary, then a valid request",
                f"bad model {status} ({json.loads(body).get('error', '')[:70]}...), valid request {ok_status}",
                "503 then 200",
                verdict(status == 503 and ok_status == 200),
            )
        )
        for endpoint in serve_bench.ENDPOINTS:
            texts = make_inputs(tokenizer, 64, 128, masked=endpoint == "fill-mask")
            r = asyncio.run(serve_bench.load(port, endpoint, texts, 128, 32, seconds))
            rows.append(
                Row(
                    f"service /{endpoint}, 32 clients, 128 tokens",
                    f"{r.rps:.1f} req/s, {si(r.tps, 'tok/s')}, p50 {r.pct(0.5):.0f} ms, "
                    f"p99 {r.pct(0.99):.0f} ms, {r.errors} errors",
                    "0 errors",
                    verdict(r.errors == 0),
                )
            )
    finally:
        live.stop_server(proc)
    return rows


# -- 5. pretraining from MiniLM ---------------------------------------------------------------

# (steps, batch, sequence length) by (on CUDA, --quick): the full GPU run ~1 minute of steps on an H100;
# on the CPU a MiniLM step of 64 x 128 takes seconds, so it trains less there.
PRETRAIN_SIZES = {
    (True, False): (1500, 64, 128),
    (True, True): (200, 32, 128),
    (False, False): (300, 16, 128),
    (False, True): (120, 16, 64),
}


def check_pretrain(ctx: Context) -> list[Row]:
    """A short warm-started pretraining run on the Wikipedia leads; held-out MLM and NSP accuracy."""
    from app.launcher.demo_data import find_asset, prepare_wiki
    from model.training.runs import PretrainSpec, run_pretraining
    from model.training.trainer import TrainConfig

    corpus = ctx.work / "wiki.txt"
    prepare_wiki(corpus, limit=300 if ctx.tiny else 1500 if ctx.quick else None)
    steps, batch, seq = (6, 8, 32) if ctx.tiny else PRETRAIN_SIZES[ctx.cuda, ctx.quick]
    spec = PretrainSpec(
        corpus=str(corpus),
        out=str(ctx.work / "pretrain"),
        from_model=str(find_asset("minilm")),
        batch_size=batch,
        max_seq_len=seq,
        eval_max_documents=50 if ctx.tiny else 100 if ctx.quick else 500,
        train=TrainConfig(
            max_steps=steps,
            lr=1e-4,
            warmup_ratio=0.05,
            log_every=10,
            device=str(ctx.device),
            max_eval_batches=5 if ctx.tiny else 10 if ctx.quick else 50,
        ),
    )
    start = time.perf_counter()
    if ctx.cuda:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                result = run_pretraining(spec)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        syncs = sum("synchroniz" in str(w.message) for w in caught)
    else:
        result = run_pretraining(spec)
    seconds = time.perf_counter() - start
    m = result.eval_metrics or {}
    shutil.copy(ctx.work / "pretrain" / "metrics.jsonl", ctx.out / "pretrain_metrics.jsonl")
    (ctx.out / "pretrain_eval.json").write_text(json.dumps(result.to_dict(), indent=1))
    target = "> 0.2 MLM, > 0.67 NSP (the 200-step CPU placeholder)"
    ok = m.get("mlm_accuracy", 0) > 0.2 and m.get("nsp_accuracy", 0) > 0.67
    rows = [
        Row(
            f"pretraining MiniLM warm start, {steps} steps of {batch}x{seq}",
            f"held-out MLM accuracy {m.get('mlm_accuracy', float('nan')):.3f}, NSP accuracy "
            f"{m.get('nsp_accuracy', float('nan')):.3f}, {seconds:.0f} s",
            target if not (ctx.quick or ctx.tiny) else "(too short to judge)",
            verdict(ok) if not (ctx.quick or ctx.tiny) else "info",
        )
    ]
    if ctx.cuda:
        rows.append(
            Row(
                "host syncs in the trainer",
                f"{syncs / steps:.2f} per step ({syncs} in {steps} steps, logging and evaluation included)",
                "small (a log interval's .item())",
                "info",
            )
        )
    return rows


# -- 6. the GPU review's cheap items ----------------------------------------------------------


def odd_head_rows(ctx: Context) -> list[Row]:
    rows = []
    for head_dim, heads in ((25, 4), (512, 2)):
        cfg = {
            "vocab_size": 1000,
            "hidden_size": head_dim * heads,
            "num_hidden_layers": 2,
            "num_attention_heads": heads,
            "intermediate_size": 4 * head_dim * heads,
        }
        torch.manual_seed(0)
        fp32 = BertModel(BertConfig(**cfg)).eval().to(ctx.device)
        ids, mask, types = padded_batch(8, 64, 1000, ctx.device)
        ref = outputs(fp32, ids, mask, types)
        cos = row_cosines(ref, outputs(apply_precision(copy.deepcopy(fp32), "bf16"), ids, mask, types))
        rows.append(
            Row(
                f"head_dim {head_dim}, padded batch, bf16 eval",
                f"ran; cosine to fp32 mean {cos.mean().item():.5f}, min {cos.min().item():.5f}",
                "runs, cosine >= 0.999 (mean)",
                verdict(cos.mean().item() >= 0.999),
            )
        )
    return rows


def memory_row(ctx: Context) -> Row:
    if not ctx.cuda:
        return Row(f"peak GPU memory, encode at {MAX_BATCH_TOKENS} tokens", "no GPU here", "measured", "n/a")
    model = apply_precision(BertModel(BertConfig(**CONFIGS["base"])).eval().to(ctx.device), "bf16")
    ids = torch.randint(1000, 30000, (MAX_BATCH_TOKENS // 512, 512), device=ctx.device)
    sync(ctx.device)
    torch.cuda.reset_peak_memory_stats(ctx.device)
    before = torch.cuda.memory_allocated(ctx.device)
    with torch.inference_mode():
        model(ids, torch.ones_like(ids))
    sync(ctx.device)
    peak = torch.cuda.max_memory_allocated(ctx.device) - before
    return Row(
        f"peak GPU memory, base bf16 encode at {MAX_BATCH_TOKENS} tokens (32x512)",
        f"{peak / 2**20:.0f} MiB above the weights",
        "measured",
        "info",
    )


def packed_sync_row(ctx: Context) -> Row:
    """The service's padded forward (bf16, mask kept on the host as app/serving/engine.py does): host syncs."""
    if not ctx.cuda:
        return Row("host syncs in a padded bf16 forward, mask on the host", "no GPU here", "0 per forward", "n/a")
    model = apply_precision(BertModel(BertConfig(**CONFIGS["base"])).eval().to(ctx.device), "bf16")
    ids, mask, types = padded_batch(16, 128, 30000, torch.device("cpu"))
    ids, types = (
        ids.pin_memory().to(ctx.device, non_blocking=True),
        types.pin_memory().to(ctx.device, non_blocking=True),
    )

    def forward():
        with torch.inference_mode():
            model(ids, mask, types)

    forward()  # kernels loaded outside the count
    n = count_syncs(forward, 3)
    return Row(
        "host syncs in a padded bf16 forward, mask on the host",
        f"{n / 3:.1f} per forward (3 forwards)",
        "0 per forward",
        verdict(n == 0),
    )


def kernel_rows(ctx: Context) -> list[Row]:
    """model.compute.kernels' choices here: each path asked and probed (flash-varlen on a GPU; on the host the
    CPU paths, which int8 and a CPU-only run take), and what a bf16 model runs through."""
    rows = []
    for name in ("flash-varlen",) if ctx.cuda else ("onednn-fp32", "onednn-bf16", "int8-vnni"):
        on, why = kernels.status(name)
        rows.append(
            Row(
                f"kernel path {name}",
                f"{'on' if on else 'off'}: {why}".replace("|", "/"),
                "decided, never raises",
                "info",
            )
        )
    plan = kernels.describe("bf16", ctx.device)
    rows.append(Row("bf16 model's kernels", f"{plan['kernels']} ({plan['why']})".replace("|", "/"), "named", "info"))
    return rows


def fill_mask_sync_row(ctx: Context) -> Row:
    """A fill-mask pass as the service runs it (engine's batch layout, app/serving/forward.py's run_mlm, with
    targets): host syncs per pass. The answers' copy back is the one expected; two .cpu() calls may count."""
    if not ctx.cuda:
        return Row("host syncs in a fill-mask pass (the service's)", "no GPU here", "<= 2 per pass", "n/a")
    from types import SimpleNamespace

    from app.serving.engine import Batch
    from app.serving.forward import run_mlm

    cfg = config_for(ctx, "small")
    model = apply_precision(BertForMaskedLM(BertConfig(**cfg)).eval().to(ctx.device), "bf16")
    ids, mask, types = padded_batch(16, 128, cfg["vocab_size"], torch.device("cpu"))
    ids[:, 5] = 103  # one [MASK] a row
    lm = SimpleNamespace(model=model, mask_token_id=103, config=model.config)
    params = [{"top_k": 5, **({"target_ids": [2000, 2001, 2002]} if r % 2 else {})} for r in range(16)]
    pinned = [t.pin_memory() for t in (ids, types, mask)]

    def one_pass():
        batch = Batch(
            *(t.to(ctx.device, non_blocking=True) for t in pinned),
            [(SimpleNamespace(params=p), 0) for p in params],
            int(mask.sum()),
        )
        batch.host_ids, batch.host_mask = pinned[0], pinned[2]
        with torch.inference_mode():
            run_mlm(lm, batch)

    one_pass()  # kernels loaded outside the count
    n = count_syncs(one_pass, 3)
    return Row(
        "host syncs in a fill-mask pass (the service's)",
        f"{n / 3:.1f} per pass (3 passes)",
        "<= 2 per pass",
        verdict(n <= 6),
    )


def check_review(ctx: Context) -> list[Row]:
    rows = [memory_row(ctx), packed_sync_row(ctx), fill_mask_sync_row(ctx)]
    return odd_head_rows(ctx) + rows + kernel_rows(ctx)


# -- the run ----------------------------------------------------------------------------------

CHECKS = {
    "parity": check_parity,
    "inference": check_inference,
    "training": check_training,
    "service": check_service,
    "pretrain": check_pretrain,
    "review": check_review,
}


def run_check(name: str, ctx: Context) -> list[Row]:
    start = time.perf_counter()
    try:
        rows = CHECKS[name](ctx)
    except Exception as e:  # noqa: BLE001 - one check's failure is a row; the rest still run
        traceback.print_exc(file=sys.stderr)
        rows = [
            Row(name, f"error: {type(e).__name__}: {str(e)[:200]}".replace("|", "/").replace("\n", " "), "runs", "FAIL")
        ]
    print(f"[gpu_check] {name}: {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    return rows


def machine(device: torch.device) -> str:
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "no GPU (CPU run)"
    return (
        f"{gpu}; torch {torch.__version__}, CUDA {torch.version.cuda}, transformers {transformers.__version__}, "
        f"{os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads"
    )


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cuda, cuda:N or cpu")
    p.add_argument("--quick", action="store_true", help="smaller sizes and fewer iterations")
    p.add_argument("--tiny", action="store_true", help="toy sizes: proves every check runs (the CPU dry run)")
    p.add_argument("--out", default=os.environ.get("OUT") or None, help="result folder (default $OUT, else a temp dir)")
    p.add_argument("--checks", nargs="+", choices=list(CHECKS), default=list(CHECKS))
    return p.parse_args(argv)


def write_results(out: Path, args, device: torch.device, rows: list[Row], wall: float, done: bool) -> str:
    """gpu_check.md and gpu_check.json as they stand: written after each check, so a run cut short (a call's time
    limit) still leaves the rows of the checks it finished. The markdown, for printing."""
    table = markdown_table(
        ["check", "result", "target", "verdict"], [[r.check, r.result, r.target, r.verdict] for r in rows]
    )
    size = "tiny" if args.tiny else "quick" if args.quick else "full"
    header = (
        f"## GPU check ({size}, --device {device})\n\n{machine(device)}; wall time {wall:.0f} s"
        f"{'' if done else ' so far (still running, or cut short)'}\n"
    )
    (out / "gpu_check.md").write_text(header + "\n" + table + "\n")
    record = {"machine": machine(device), "quick": args.quick, "tiny": args.tiny, "wall_s": round(wall, 1)}
    (out / "gpu_check.json").write_text(
        json.dumps({**record, "done": done, "rows": [asdict(r) for r in rows]}, indent=1)
    )
    return header + "\n" + table


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out or tempfile.mkdtemp(prefix="gpu-check-"))
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    start, rows = time.perf_counter(), []
    print(f"[gpu_check] {machine(device)}; results in {out}", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="gpu-check-work-") as work:
        ctx = Context(device, args.quick or args.tiny, out, Path(work), tiny=args.tiny)
        for name in args.checks:
            rows += run_check(name, ctx)
            write_results(out, args, device, rows, time.perf_counter() - start, done=False)
    print(write_results(out, args, device, rows, time.perf_counter() - start, done=True))
    print(f"\nresults in {out}", file=sys.stderr)
    return 1 if any(r.verdict == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
