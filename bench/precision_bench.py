"""Reduced precision (model/compute/precision.py): speed against our fp32, and what it costs in accuracy.

Speed: the encoder at the base config (random weights), batch 1 and 8 at seq 128, ours fp32 vs
apply_precision "bf16" and "int8", plus torch.ao's quantize_dynamic (the textbook int8, per-tensor
7-bit activations) for reference; timed in turns (bench/common.py).

Accuracy, each precision against fp32 on the same inputs:
  embeddings      real MiniLM (all-MiniLM-L6-v2): mean-pooled, L2-normalised sentence embeddings
                  of 500 Wikipedia sentences; cosine to fp32's, min and mean;
  classification  a logistic-regression probe trained on fp32 MiniLM embeddings of rotten-tomatoes
                  reviews (fresh/rotten), applied to each precision's embeddings of 500 held-out
                  reviews: agreement of the predicted labels with fp32's (and each one's accuracy);
  fill-mask       MiniLM with an MLM head, trained briefly end to end on Wikipedia:
                  one [MASK] per held-out sentence, top-1 agreement with fp32, overall and where
                  fp32's top-1 is the true token, and top-5 overlap (plus fp32's top-1 accuracy,
                  to show the head predicts something: MiniLM was never trained for MLM).

    .venv/bin/python -m bench.precision_bench            # ~3 minutes on 2 idle cores
    .venv/bin/python -m bench.precision_bench --quick
    .venv/bin/python -m bench.precision_bench --chunks 0 512 1024 2048   # int8's rows at once (CHUNK_ROWS) instead
"""

from __future__ import annotations

import argparse
import bz2
import copy
import csv
import json
import random
import sys
import warnings
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F
from torch import nn

from bench.common import (
    CONFIGS,
    MINILM_DIR,
    ROTTEN_TOMATOES,
    WIKI_JSON,
    interleaved,
    machine_line,
    markdown_table,
    setup,
)
from model.compute import kernels
from model.compute import precision as compute_precision
from model.compute.precision import apply_precision, autocast, bf16_native
from model.config import BertConfig
from model.data.corpus import split_sentences
from model.modeling import BertForMaskedLM, BertModel
from model.tokenizer import BertTokenizer

PRECISIONS = ("bf16", "int8", "int8 torch.ao")


def convert(model: nn.Module, precision: str) -> nn.Module:
    model = copy.deepcopy(model)
    if precision != "int8 torch.ao":
        return apply_precision(model, precision)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        encoder = model.bert.encoder if hasattr(model, "bert") else model.encoder
        torch.ao.quantization.quantize_dynamic(encoder, {nn.Linear}, dtype=torch.qint8, inplace=True)
    return model


# -- data -------------------------------------------------------------------------------------


def wiki_sentences(n: int, skip: int = 0) -> list[str]:
    out = []
    for page in json.loads(WIKI_JSON.read_text()).values():
        out += [s for s in split_sentences(page["extract"]) if len(s.split()) >= 5]
        if len(out) >= n + skip:
            break
    return out[skip : skip + n]


def reviews(n_train: int, n_test: int, seed: int = 0):
    with bz2.open(ROTTEN_TOMATOES, "rt") as f:
        rows = [
            (r["text"], int(r["category"] == "fresh"))
            for r in csv.DictReader(f)
            if r["category"] in ("fresh", "rotten")
        ]
    random.Random(seed).shuffle(rows)
    return rows[:n_train], rows[n_train : n_train + n_test]


# -- embeddings and the classification probe --------------------------------------------------


@torch.no_grad()  # not inference_mode: the probe trains on these
def embed(model, tok, texts, batch=32) -> torch.Tensor:
    out = []
    for i in range(0, len(texts), batch):
        enc = tok(texts[i : i + batch], max_length=128, truncation=True)
        hidden = model(enc["input_ids"], enc["attention_mask"]).last_hidden_state.float()
        keep = enc["attention_mask"][..., None].float()
        out.append(F.normalize((hidden * keep).sum(1) / keep.sum(1), dim=-1))  # mean pooling
    return torch.cat(out)


def train_probe(x: torch.Tensor, y: torch.Tensor, steps: int = 300) -> nn.Linear:
    probe = nn.Linear(x.shape[1], 2)
    opt = torch.optim.LBFGS(probe.parameters(), max_iter=steps, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = F.cross_entropy(probe(x), y) + 1e-4 * probe.weight.square().sum()
        loss.backward()
        return loss

    opt.step(closure)
    return probe


# -- fill-mask: MiniLM's encoder with a briefly trained MLM head -----------------------------


def mask_one(tok, texts, seed=0):
    """Each text tokenised (<= 64 tokens), one random non-special position replaced by [MASK]."""
    enc = tok(texts, max_length=64, truncation=True)
    ids, attn = enc["input_ids"], enc["attention_mask"]
    g = torch.Generator().manual_seed(seed)
    lengths = attn.sum(1)
    where = (torch.rand(len(texts), generator=g) * (lengths - 2)).long() + 1  # skip [CLS] and [SEP]
    rows = torch.arange(len(texts))
    truth = ids[rows, where].clone()
    ids = ids.clone()
    ids[rows, where] = tok.mask_token_id
    positions = torch.zeros_like(ids, dtype=torch.bool)
    positions[rows, where] = True
    return ids, attn, positions, truth


def train_mlm(minilm_dir: Path, tok, steps: int, batch: int = 32) -> BertForMaskedLM:
    """MiniLM with a fresh MLM head, trained briefly end to end on Wikipedia (15% masked; bf16 autocast
    where the CPU has bf16, else fp32: emulated bf16 GEMMs in training run several times slower).

    MiniLM was distilled and tuned for sentence embeddings, never for MLM: a head fitted to its
    frozen states predicts poorly and flips on any noise, which would overstate what precision
    costs. A few hundred steps of the whole model give a small but real fill-mask model.
    """
    model = BertForMaskedLM.from_pretrained(minilm_dir, init_missing_heads=True).train()
    head = [p for n, p in model.named_parameters() if n.startswith("cls.")]
    rest = [p for n, p in model.named_parameters() if not n.startswith("cls.")]
    opt = torch.optim.AdamW([{"params": head, "lr": 1e-3}, {"params": rest, "lr": 1e-4}], weight_decay=0.01)
    texts = wiki_sentences(steps * batch, skip=2000)
    g = torch.Generator().manual_seed(0)
    for step in range(steps):
        enc = tok(texts[step * batch : (step + 1) * batch], max_length=64, truncation=True)
        ids, attn = enc["input_ids"], enc["attention_mask"]
        pick = (torch.rand(ids.shape, generator=g) < 0.15) & attn.bool()
        pick &= (ids != tok.cls_token_id) & (ids != tok.sep_token_id)
        labels = torch.where(pick, ids, torch.full_like(ids, -100))
        with autocast("cpu", "bf16" if bf16_native("cpu") else "fp32"):
            loss = model(ids.masked_fill(pick, tok.mask_token_id), attn, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


@torch.inference_mode()
def fill_mask_top(model, ids, attn, positions, batch=64, k=5) -> torch.Tensor:
    """The top-k token ids at each [MASK], best first: (N, k)."""
    out = []
    for i in range(0, len(ids), batch):
        out.append(
            model(ids[i : i + batch], attn[i : i + batch], masked_positions=positions[i : i + batch])
            .logits.topk(k)
            .indices
        )
    return torch.cat(out)


def top5_overlap(a: torch.Tensor, b: torch.Tensor) -> float:
    return sum(len(set(x.tolist()) & set(y.tolist())) for x, y in zip(a, b)) / a.numel()


# -- the report -------------------------------------------------------------------------------


def speed_table(args) -> str:
    fp32 = BertModel(BertConfig(**CONFIGS["base"])).eval()
    models = {"fp32": fp32, **{p: convert(fp32, p) for p in PRECISIONS}}
    rows = []
    for batch in args.batches:
        ids = torch.randint(1000, 30000, (batch, 128))
        mask = torch.ones_like(ids)
        with torch.inference_mode():
            t = interleaved(
                {name: (lambda m=m, ids=ids, mask=mask: m(ids, mask)) for name, m in models.items()},
                rounds=args.rounds,
                block_s=0.3,
                budget_s=args.budget,
            )
        rows.append(
            [f"base, batch {batch}, seq 128"]
            + [f"{t[n].fmt()} = {t['fp32'].median / t[n].median:.2f}x" for n in models]
        )
    return markdown_table(["ms per forward (speed-up vs fp32)"] + list(models), rows)


def chunk_table(args) -> str:
    """int8 with Int8Linear's rows taken CHUNK_ROWS at a time, for each of --chunks (0: all at once), against fp32
    and bf16: MiniLM's encoder (the model served by default), on passes of --chunk-tokens tokens in rows of 128."""
    fp32 = BertModel.from_pretrained(args.minilm).eval()
    bf16, int8 = convert(fp32, "bf16"), convert(fp32, "int8")
    default = compute_precision.CHUNK_ROWS
    headers, rows = [], []
    for tokens in args.chunk_tokens:
        ids = torch.randint(1000, 30000, (max(1, tokens // 128), 128))
        mask = torch.ones_like(ids)

        def int8_in_chunks(rows_at_once: int, ids=ids, mask=mask):
            def run():
                compute_precision.CHUNK_ROWS = rows_at_once or ids.numel()
                int8(ids, mask)

            return run

        contenders = {
            "fp32": lambda ids=ids, mask=mask: fp32(ids, mask),
            "bf16": lambda ids=ids, mask=mask: bf16(ids, mask),
            **{f"int8, {n} rows at once" if n else "int8, all rows at once": int8_in_chunks(n) for n in args.chunks},
        }
        with torch.inference_mode():
            t = interleaved(contenders, rounds=args.rounds, block_s=0.3, budget_s=args.budget)
        compute_precision.CHUNK_ROWS = default
        headers = list(contenders)
        rows.append(
            [f"MiniLM, {ids.shape[0]} x 128 tokens"]
            + [f"{t[n].fmt()} = {t['fp32'].median / t[n].median:.2f}x" for n in t]
        )
    return markdown_table(["ms per forward (speed-up vs fp32)", *headers], rows)


def accuracy_table(args) -> str:
    tok = BertTokenizer.from_pretrained(args.minilm)
    encoder = BertModel.from_pretrained(args.minilm)
    sentences = wiki_sentences(args.sentences)
    train, test = reviews(args.reviews, args.reviews)
    ref_emb = embed(encoder, tok, sentences)
    x_train = embed(encoder, tok, [t for t, _ in train])
    y_train, y_test = torch.tensor([y for _, y in train]), torch.tensor([y for _, y in test])
    probe = train_probe(x_train, y_train)
    with torch.no_grad():
        ref_pred = probe(embed(encoder, tok, [t for t, _ in test])).argmax(-1)
    mlm = train_mlm(args.minilm, tok, args.mlm_steps)
    ids, attn, positions, truth = mask_one(tok, wiki_sentences(args.sentences, skip=1000))
    ref_top = fill_mask_top(mlm, ids, attn, positions)
    right = ref_top[:, 0] == truth
    rows = [
        [
            "fp32",
            "1.0000 / 1.0000",
            "100.0%",
            f"{(ref_pred == y_test).float().mean():.1%}",
            "100.0%",
            "100.0%",
            "100.0%",
            f"{right.float().mean():.1%}",
        ]
    ]
    for p in PRECISIONS:
        model = convert(encoder, p)
        cos = (embed(model, tok, sentences) * ref_emb).sum(-1)
        with torch.no_grad():
            pred = probe(embed(model, tok, [t for t, _ in test])).argmax(-1)
        top = fill_mask_top(convert(mlm, p), ids, attn, positions)
        rows.append(
            [
                p,
                f"{cos.min():.4f} / {cos.mean():.4f}",
                f"{(pred == ref_pred).float().mean():.1%}",
                f"{(pred == y_test).float().mean():.1%}",
                f"{(top[:, 0] == ref_top[:, 0]).float().mean():.1%}",
                f"{(top[right, 0] == ref_top[right, 0]).float().mean():.1%}",
                f"{top5_overlap(top, ref_top):.1%}",
                f"{(top[:, 0] == truth).float().mean():.1%}",
            ]
        )
    return markdown_table(
        [
            "precision",
            "embedding cosine min / mean",
            "classification agreement",
            "classification accuracy",
            "fill-mask top-1 agreement",
            "top-1 agreement where fp32 is right",
            "fill-mask top-5 overlap",
            "fill-mask top-1 accuracy",
        ],
        rows,
    )


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--minilm", type=Path, default=MINILM_DIR, help="MiniLM directory (HF layout, or the output of `bert import`)"
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--budget", type=float, default=40.0)
    p.add_argument("--sentences", type=int, default=500)
    p.add_argument("--reviews", type=int, default=500, help="reviews to train the probe on, and to test")
    p.add_argument("--mlm-steps", type=int, default=120)
    p.add_argument(
        "--chunks",
        nargs="+",
        type=int,
        help="instead of the other tables: int8 with Int8Linear taking this many rows at once (0: all), e.g. 0 512 1024 "
        "2048, against fp32 and bf16 on MiniLM",
    )
    p.add_argument(
        "--chunk-tokens", nargs="+", type=int, default=[1024, 4096, 8192], help="tokens per pass for --chunks"
    )
    p.add_argument("--skip-speed", action="store_true")
    p.add_argument("--skip-accuracy", action="store_true")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.batches, args.rounds, args.budget = [8], 3, 15.0
        args.sentences, args.reviews, args.mlm_steps = 200, 200, 40
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    setup(args.threads)
    plan = "; ".join(f"{p} {kernels.describe(p)['kernels']}" for p in ("fp32", "bf16", "int8"))
    print(f"## Precision benchmark\n\n{machine_line()}\n\nKernels here: {plan}\n")
    if args.chunks:
        print("int8's rows at once (model.compute.precision.CHUNK_ROWS), median (min-max) ms:\n\n" + chunk_table(args))
        return
    if not args.skip_speed:
        print("Encoder forward, median (min-max) ms:\n\n" + speed_table(args) + "\n", flush=True)
    if not args.skip_accuracy:
        print(
            f"Accuracy against fp32 ({args.sentences} sentences, {args.reviews} test reviews, "
            f"MLM head trained {args.mlm_steps} steps):\n\n" + accuracy_table(args) + "\n"
        )


if __name__ == "__main__":
    main()
