"""Training speed: our BertForPreTraining against transformers' on the same config, weights and batch.

One step = zero_grad, forward (MLM + NSP loss), backward, AdamW step; small config, batch 32,
seq 128, 15% of positions masked. Contenders, timed in turns (bench/common.py):
  hf          transformers BertForPreTraining (attn_implementation="sdpa"), fp32;
  ours        our BertForPreTraining, fp32 (the MLM head runs on the masked positions only);
  ours bf16   the same under bf16 autocast (model.compute.precision.autocast), fp32 weights and optimizer.
Checks, printed with the table:
  * the loss on the same batch matches transformers' (dropout off), before and after 2 AdamW
    steps (so the gradients agree too), within 1e-4;
  * a short run on Wikipedia text (MiniLM vocabulary), ours fp32 against ours bf16 from the same
    initial weights and batches: the loss curves stay within a few percent.
Data parallel (--ddp-steps, 0 to skip): `bert pretrain` on the Wikipedia leads, one process against
`--nproc-per-node 2` (gloo, one thread per process) at the same global batch, in turns; the trainer's
metrics.jsonl gives tokens/s per process (the first logged window, warm-up, is left out); scaling
efficiency = a DDP process's tokens/s / the single process's. Two processes need two idle cores to
show it: on a shared machine the table says what the cores gave.

    .venv/bin/python -m bench.train_bench            # ~1-2 minutes on 2 idle cores
    .venv/bin/python -m bench.train_bench --quick
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import transformers

from app.launcher.demo_data import prepare_wiki
from bench.common import CONFIGS, MINILM_DIR, WIKI_JSON, interleaved, machine_line, markdown_table, setup
from model.compute.precision import autocast
from model.config import BertConfig
from model.modeling import BertForPreTraining
from model.tokenizer import BertTokenizer

IGNORE = -100


def models(kind: str, dropout: float | None = None):
    """transformers' and our BertForPreTraining with identical initial weights."""
    cfg = dict(CONFIGS[kind])
    if dropout is not None:
        cfg.update(hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    hf = transformers.BertForPreTraining(transformers.BertConfig(**cfg, attn_implementation="sdpa")).train()
    ours = BertForPreTraining(BertConfig(**cfg)).train()
    ours.load_state_dict(
        {k: v for k, v in hf.state_dict().items() if not k.startswith("cls.predictions.decoder.")}, strict=True
    )
    return hf, ours


def random_batch(batch: int, seq: int, vocab: int, seed: int = 0, mask_id: int = 103) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1000, vocab, (batch, seq), generator=g)
    return masked(ids, torch.randint(0, 2, (batch,), generator=g), g, mask_id, half=seq // 2)


def masked(ids: torch.Tensor, nsp: torch.Tensor, g: torch.Generator, mask_id: int, half: int) -> dict:
    """[CLS] A [SEP] B [SEP] framing, 15% of the other positions masked (all to [MASK])."""
    ids = ids.clone()
    ids[:, 0], ids[:, half - 1], ids[:, -1] = 101, 102, 102
    types = torch.zeros_like(ids)
    types[:, half:] = 1
    pick = torch.rand(ids.shape, generator=g) < 0.15
    pick[:, [0, half - 1, ids.shape[1] - 1]] = False
    labels = torch.where(pick, ids, torch.full_like(ids, IGNORE))
    ids[pick] = mask_id
    return dict(
        input_ids=ids, token_type_ids=types, attention_mask=torch.ones_like(ids), labels=labels, next_sentence_label=nsp
    )


def step_fn(model, opt, batch, bf16: bool = False):
    def step():
        opt.zero_grad(set_to_none=True)
        with autocast("cpu", "bf16" if bf16 else "fp32"):
            loss = model(**batch).loss
        loss.backward()
        opt.step()
        return loss.detach()

    return step


def adamw(model, lr=1e-4):
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)


def timing_table(args, batch) -> tuple[str, dict]:
    hf, ours = models(args.config)
    _, ours_bf16 = models(args.config)
    ours_bf16.load_state_dict(ours.state_dict())
    steps = {
        "hf": step_fn(hf, adamw(hf), batch),
        "ours": step_fn(ours, adamw(ours), batch),
        "ours bf16": step_fn(ours_bf16, adamw(ours_bf16), batch, bf16=True),
    }
    if args.compile:  # TrainConfig(compile=True): compiled before the timing, its cost printed apart
        _, plain = models(args.config)
        plain.load_state_dict(ours.state_dict())
        compiled = torch.compile(plain)
        step = step_fn(compiled, adamw(plain), batch)
        start = time.perf_counter()
        step(), step()
        print(f"torch.compile: first two steps (compiling) {time.perf_counter() - start:.1f} s\n", flush=True)
        steps["ours compiled"] = step
    t = interleaved(steps, rounds=args.rounds, block_s=0.0, budget_s=args.budget)
    base = t["hf"].median
    rows = [[name, t[name].fmt(), f"{1 / t[name].median:.2f}", f"{base / t[name].median:.2f}x"] for name in steps]
    return markdown_table(["", "ms per step", "steps/s", "vs hf fp32"], rows), t


def loss_check(args, batch) -> str:
    """Loss on the same batch, dropout off, at step 0 and after 2 AdamW steps (gradients agree)."""
    hf, ours = models(args.config, dropout=0.0)
    fns = {"hf": step_fn(hf, adamw(hf, 1e-3), batch), "ours": step_fn(ours, adamw(ours, 1e-3), batch)}
    lines = []
    for step in range(3):
        a, b = fns["hf"](), fns["ours"]()
        diff = abs(a.item() - b.item())
        lines.append(
            f"step {step}: hf {a.item():.6f} ours {b.item():.6f} |diff| {diff:.1e} "
            f"{'ok' if diff <= 1e-4 else 'OVER 1e-4'}"
        )
    return "\n".join(lines)


def wiki_batches(n: int, batch: int, seq: int, seed: int = 0) -> list[dict]:
    """Real text: the Wikipedia leads as one token stream, A and B halves of `seq`, half of the B random."""
    tok = BertTokenizer.from_pretrained(MINILM_DIR)
    texts = [v["extract"] for v in json.loads(WIKI_JSON.read_text()).values()][:3000]
    stream = torch.tensor(
        [
            i
            for enc in tok(texts, max_length=512, truncation=True, padding=False, return_tensors=None)["input_ids"]
            for i in enc[1:-1]
        ]
    )
    g = torch.Generator().manual_seed(seed)
    half, out = seq // 2, []
    for _ in range(n):
        start = torch.randint(0, len(stream) - seq, (batch,), generator=g)
        nsp = torch.randint(0, 2, (batch,), generator=g)
        other = torch.randint(0, len(stream) - seq, (batch,), generator=g)
        b_start = torch.where(nsp == 1, other, start + half)
        a = stream[start[:, None] + torch.arange(half)]
        b = stream[b_start[:, None] + torch.arange(seq - half)]
        out.append(masked(torch.cat([a, b], 1), nsp, g, tok.mask_token_id, half))
    return out


def loss_curve(args) -> str:
    _, fp32 = models(args.config)
    _, bf16 = models(args.config)
    bf16.load_state_dict(fp32.state_dict())
    batches = wiki_batches(args.curve_steps, args.batch, args.seq)
    curves = {}
    for name, model in (("fp32", fp32), ("bf16", bf16)):
        torch.manual_seed(1)  # the same dropout draws are not guaranteed across dtypes, the seed is
        opt = adamw(model, 5e-4)
        curves[name] = [step_fn(model, opt, b, bf16=name == "bf16")().item() for b in batches]
    k = max(1, len(batches) // 5)
    rows = []
    for i in range(0, len(batches), k):
        a, b = (sum(curves[n][i : i + k]) / len(curves[n][i : i + k]) for n in ("fp32", "bf16"))
        rows.append([f"{i}-{min(i + k, len(batches)) - 1}", f"{a:.4f}", f"{b:.4f}", f"{(b - a) / a:+.3%}"])
    return markdown_table(["steps", "fp32 loss (mean)", "bf16 loss (mean)", "bf16 vs fp32"], rows)


def ddp_run(work: Path, name: str, args, nproc: int) -> list[float]:
    """One `bert pretrain` run; each logged window's tokens/s per process (warm-up window left out)."""
    out = work / name
    cfg = {**CONFIGS[args.config], "max_position_embeddings": 512, "type_vocab_size": 2}
    (work / "config.json").write_text(json.dumps(cfg))
    cmd = [
        sys.executable,
        "-m",
        "app.cli",
        "pretrain",
        "--config",
        str(work / "config.json"),
        "--vocab",
        str(MINILM_DIR),
        "--corpus",
        str(work / "wiki.txt"),
        "--batch-size",
        str(args.batch),
        "--max-seq-len",
        str(args.seq),
        "--eval-fraction",
        "0",
        "--max-steps",
        str(args.ddp_steps),
        "--log-every",
        str(max(1, args.ddp_steps // 6)),
        "--threads",
        "1",
        "--no-resume",
        "--out",
        str(out),
        "--nproc-per-node",
        str(nproc),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rates = [r.get("rank_tokens_per_s") or [r["tokens_per_s"]] for r in records if r["type"] == "train"][1:]
    return [statistics.fmean(r) for r in rates]


def ddp_table(args) -> str:
    """Tokens/s per process: one process against two DDP ranks at the same global batch, in turns."""
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        prepare_wiki(work / "wiki.txt", limit=3000)
        rates: dict[int, list[float]] = {1: [], 2: []}
        for turn in range(args.ddp_rounds):
            for nproc in (1, 2):
                rates[nproc] += ddp_run(work, f"run-{nproc}-{turn}", args, nproc)
    single, ddp = statistics.median(rates[1]), statistics.median(rates[2])
    rows = [
        ["1 process", f"{single:,.0f} ({min(rates[1]):,.0f}-{max(rates[1]):,.0f})", f"{single:,.0f}", "1.00"],
        [
            "2 DDP processes (gloo)",
            f"{ddp:,.0f} ({min(rates[2]):,.0f}-{max(rates[2]):,.0f})",
            f"{2 * ddp:,.0f}",
            f"{ddp / single:.2f}",
        ],
    ]
    return markdown_table(["", "tokens/s per process, median (min-max)", "tokens/s in all", "scaling efficiency"], rows)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", choices=sorted(CONFIGS), default="small")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--budget", type=float, default=60.0, help="seconds for the timing; cuts rounds (min 3)")
    p.add_argument("--curve-steps", type=int, default=40)
    p.add_argument("--ddp-steps", type=int, default=30, help="steps per data-parallel run (0: skip DDP)")
    p.add_argument("--ddp-rounds", type=int, default=2, help="turns of (1 process, 2 DDP processes)")
    p.add_argument("--ddp-only", action="store_true", help="only the data-parallel table")
    p.add_argument("--compile", action="store_true", help="also ours under torch.compile (TrainConfig.compile)")
    p.add_argument("--quick", action="store_true", help="3 rounds, a 15-step curve, 12 DDP steps")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.curve_steps, args.budget, args.ddp_steps = 3, 15, 20.0, 12
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    setup(args.threads)
    batch = random_batch(args.batch, args.seq, CONFIGS[args.config]["vocab_size"])
    print(f"## Training benchmark\n\n{machine_line()}\n")
    if args.ddp_only:
        return print_ddp(args)
    print(
        f"{args.config} config, batch {args.batch}, seq {args.seq}, MLM (15%) + NSP, AdamW. "
        "Times: median (min-max) ms per step.\n"
    )
    table, _ = timing_table(args, batch)
    print(table + "\n", flush=True)
    print("Loss on the same batch, dropout off (AdamW lr 1e-3 between steps):\n")
    print("```\n" + loss_check(args, batch) + "\n```\n", flush=True)
    print(f"Loss curve, {args.curve_steps} steps on Wikipedia text, ours fp32 vs ours bf16 autocast:\n")
    print(loss_curve(args) + "\n")
    print_ddp(args)


def print_ddp(args) -> None:
    if args.ddp_steps < 1:
        return
    print(
        f"Data parallel: `bert pretrain`, {args.config} config from scratch on Wikipedia leads, global batch "
        f"{args.batch}, seq {args.seq}, {args.ddp_steps} steps x {args.ddp_rounds} turns, 1 thread per process:\n"
    )
    print(ddp_table(args) + "\n")


if __name__ == "__main__":
    main()
