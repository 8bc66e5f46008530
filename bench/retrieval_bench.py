"""Embedding fine-tuning, held out: all-MiniLM-L6-v2 trained on pairs from the bundled Wikipedia leads by this
project's `sentence-embedding` task and by sentence-transformers' own trainer, with the same data, steps, batch,
learning rate and schedule, in one run on one machine.

Pairs: an article's first sentence (the anchor) and the rest of its lead (the positive), for the leads with at
least two sentences. `--eval-articles` (500) articles are held out: their first sentences are the queries, the
rests of their leads the corpus, each query's own rest its one relevant document. MRR@10, NDCG@10 and recall@10
of the base model, of ours after training and of sentence-transformers' after training, computed by
model/training/retrieval_eval.py (checked against sentence-transformers' InformationRetrievalEvaluator by
tests/model/test_retrieval_eval.py), and each trainer's training samples/s (pairs per second of its training
loop, evaluation excluded).

Both sides: in-batch negatives (MultipleNegativesRankingLoss, scale 20), batches without duplicate texts,
AdamW (weight decay 0.01, eps 1e-6), linear warmup over 10% of the steps then linear decay, gradient norm
clipped at 1.0, fp32 on the CPU, seed 0, texts cut at `--max-seq-len` tokens.

    .venv/bin/pip install -e '.[bench]'     # sentence-transformers' trainer needs datasets and accelerate
    .venv/bin/python -m bench.retrieval_bench                     # 200 steps of 32 pairs
    .venv/bin/python -m bench.retrieval_bench --steps 50 --batch-size 16
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from app.launcher.demo_data import ensure_minilm  # noqa: E402
from bench.common import WIKI_JSON, machine_line  # noqa: E402
from model.training.retrieval_eval import evaluate_retrieval  # noqa: E402

SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")
METRICS = ("cosine_mrr@10", "cosine_ndcg@10", "cosine_recall@10")


def wiki_pairs(eval_articles: int, seed: int = 0) -> tuple[list[dict], dict, dict, dict]:
    """(train pairs, queries, corpus, relevant): first sentence -> rest of the lead, articles split by seed."""
    pairs = []
    for key, value in json.loads(WIKI_JSON.read_text()).items():
        sentences = SENTENCE_END.split(value.get("extract", "").strip())
        if len(sentences) >= 2 and len(sentences[0].split()) >= 5:
            pairs.append({"id": key, "anchor": sentences[0], "positive": " ".join(sentences[1:4])})
    random.Random(seed).shuffle(pairs)
    held, train = pairs[:eval_articles], pairs[eval_articles:]
    queries = {f"q{i}": p["anchor"] for i, p in enumerate(held)}
    corpus = {f"d{i}": p["positive"] for i, p in enumerate(held)}
    relevant = {f"q{i}": {f"d{i}"} for i in range(len(held))}
    return [{"anchor": p["anchor"], "positive": p["positive"]} for p in train], queries, corpus, relevant


def ours_encode(model_dir: Path, max_seq_len: int):
    """An `encode(texts)` with this project's model and its sentence-transformers modules."""
    from model.modeling import BertModel
    from model.sentence_modules import read_sentence_modules
    from model.tokenizer import BertTokenizer

    model, tokenizer = BertModel.from_pretrained(model_dir).eval(), BertTokenizer.from_pretrained(model_dir)
    modules = read_sentence_modules(model_dir)

    @torch.no_grad()
    def encode(texts: list[str]) -> torch.Tensor:
        rows = [tokenizer.encode(t, max_length=max_seq_len, truncation=True)["input_ids"] for t in texts]
        width = max(map(len, rows))
        ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
        mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
        return modules.embed(model(ids, mask).last_hidden_state, mask)

    return encode


def scores(encode, queries, corpus, relevant) -> dict[str, float]:
    metrics = evaluate_retrieval(encode, queries, corpus, relevant, batch_size=64)
    return {k: metrics[k] for k in METRICS}


def train_ours(base: Path, train: list[dict], work: Path, args) -> tuple[Path, float]:
    """This project's sentence-embedding task, in process (as the worker runs it): (model directory, samples/s)."""
    # the task holds some pairs out; a few seconds of evaluation at the end, counted
    return run_ours("sentence-embedding", base, train, work, args, eval_fraction=0.01)


def run_ours(task: str, base: Path, train: list[dict], work: Path, args, **options) -> tuple[Path, float]:
    """This project's `task` on the pairs `train`, in process (as the worker runs it), with the settings both
    trainers share (`reference_arguments`) and the task's `options`: (model directory, samples/s)."""
    from model.training.runs import FinetuneSpec, run_finetuning

    data = work / "pairs.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in train))
    spec = FinetuneSpec.from_dict(
        {
            "task": task,
            "train_file": str(data),
            "from_model": str(base),
            "out": str(work / "ours"),
            "batch_size": args.batch_size,
            "max_seq_len": args.max_seq_len,
            **options,
            "train": {
                "max_steps": args.steps,
                "lr": args.lr,
                "warmup_ratio": 0.1,
                "weight_decay": 0.01,
                "max_grad_norm": 1.0,
                "seed": 0,
                "eval_every": 0,
                "eval_on_start": False,
                "save_every": 0,
                "log_every": max(1, args.steps // 10),
                "precision": "fp32",
                "device": "cpu",
            },
        }
    )
    start = time.perf_counter()
    run_finetuning(spec)
    seconds = time.perf_counter() - start
    return work / "ours" / "model", args.steps * args.batch_size / seconds


def reference_arguments(arguments_class, out: Path, args):
    """sentence-transformers' training arguments (`arguments_class`: its dense or sparse trainer's) with the
    settings `run_ours` gives this project's task."""
    from sentence_transformers.training_args import BatchSamplers

    return arguments_class(
        output_dir=str(out / "run"),
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        learning_rate=args.lr,
        warmup_ratio=0.1,
        weight_decay=0.01,
        adam_epsilon=1e-6,
        max_grad_norm=1.0,
        lr_scheduler_type="linear",
        seed=0,
        batch_sampler=BatchSamplers.NO_DUPLICATES,
        save_strategy="no",
        logging_steps=max(1, args.steps // 10),
        report_to="none",
        use_cpu=True,
        dataloader_drop_last=True,
    )


def run_reference(trainer, model, out: Path, args) -> tuple[Path, float]:
    """Train with sentence-transformers' `trainer` and save `model` under `out`: (model directory, samples/s)."""
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    model.save(str(out / "model"))
    return out / "model", args.steps * args.batch_size / seconds


def train_theirs(base: Path, train: list[dict], work: Path, args) -> tuple[Path, float]:
    """sentence-transformers' SentenceTransformerTrainer with the same settings: (model directory, samples/s)."""
    from datasets import Dataset
    from sentence_transformers import (
        SentenceTransformer,
        SentenceTransformerTrainer,
        SentenceTransformerTrainingArguments,
    )
    from sentence_transformers.losses import MultipleNegativesRankingLoss

    model = SentenceTransformer(str(base), device="cpu")
    model.max_seq_length = args.max_seq_len
    out = work / "theirs"
    trainer = SentenceTransformerTrainer(
        model=model,
        args=reference_arguments(SentenceTransformerTrainingArguments, out, args),
        train_dataset=Dataset.from_list(train),
        loss=MultipleNegativesRankingLoss(model, scale=20.0),
    )
    return run_reference(trainer, model, out, args)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps each (default 200)")
    parser.add_argument("--batch-size", type=int, default=32, help="pairs a step (default 32)")
    parser.add_argument("--lr", type=float, default=2e-5, help="peak learning rate (default 2e-5)")
    parser.add_argument("--max-seq-len", type=int, default=128, help="tokens a text is cut at (default 128)")
    parser.add_argument("--eval-articles", type=int, default=500, help="held-out articles (default 500)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    train, queries, corpus, relevant = wiki_pairs(args.eval_articles)
    with tempfile.TemporaryDirectory(prefix="retrieval-bench-") as tmp:
        work = Path(tmp)
        base = ensure_minilm(work / "minilm")
        rows = [
            ("all-MiniLM-L6-v2 (base)", scores(ours_encode(base, args.max_seq_len), queries, corpus, relevant), None)
        ]
        ours_dir, ours_rate = train_ours(base, train, work, args)
        theirs_dir, theirs_rate = train_theirs(base, train, work, args)
        rows.append(
            ("fine-tuned here", scores(ours_encode(ours_dir, args.max_seq_len), queries, corpus, relevant), ours_rate)
        )
        rows.append(
            (
                "fine-tuned by sentence-transformers",
                scores(ours_encode(theirs_dir, args.max_seq_len), queries, corpus, relevant),
                theirs_rate,
            )
        )
    print(
        f"# Embedding fine-tuning on Wikipedia leads: {len(train):,} training pairs, {len(queries)} held-out queries "
        f"over {len(corpus)} documents\n\n{machine_line()}\n\n{args.steps} steps of {args.batch_size} pairs, "
        f"lr {args.lr:g}, texts cut at {args.max_seq_len} tokens\n"
    )
    print("| model | MRR@10 | NDCG@10 | recall@10 | training samples/s |")
    print("|---|---:|---:|---:|---:|")
    for label, metrics, rate in rows:
        shown = " | ".join(f"{metrics[k]:.4f}" for k in METRICS)
        print(f"| {label} | {shown} | {'' if rate is None else f'{rate:.1f}'} |")
    print(f"\nsamples/s here / sentence-transformers': {ours_rate / theirs_rate:.2f}x")


if __name__ == "__main__":
    main()
