"""Pretraining from a token store at scale: open + plan + first batch, streaming speed, and the planner
against the sequential one it replaced.

1. Writes (once; reused while its manifest is there) a synthetic store in the pinned format
   (model/data/store.py) of --tokens random uint16 ids, MiniLM's vocabulary, in shards of --shard-tokens:
   sentence lengths lognormal (median ~22 tokens, 1-256), document lengths lognormal in sentences
   (median ~12, 1-2000), roughly Wikipedia's shape. About 2 bytes a token plus 8 a sentence on disk.
2. Times, in this process: open_store (validation) + PretrainingData + planning epoch 0 + its first
   batch; then --batches more batches (examples/s of the stream: slicing, truncation, masking, collate).
3. On a --small-tokens single-shard corpus, times the vectorised planner (model/data/pretraining.py)
   against `sequential_plan`, the Python loop over sentences that planned until issue 13 (kept here as
   the reference), and prints both plans' statistics: same packing rules, so the same distributions.

    .venv/bin/python -m bench.plan_bench                    # 200 M tokens in /tmp/plan_bench (~0.5 GB)
    .venv/bin/python -m bench.plan_bench --tokens 1e9       # a billion (~2.3 GB of /tmp)

The store's pages are in the page cache after writing: the open + plan numbers are warm-cache ones.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from bench.common import MINILM_DIR, machine_line, markdown_table, setup
from model.data.corpus import TokenizedCorpus, tokenizer_fingerprint
from model.data.pretraining import PretrainingData, plan_instances
from model.data.store import MANIFEST, open_store
from model.tokenizer import SPECIAL_TOKENS_IN_A_PAIR, BertTokenizer

# ---------------------------------------------------------------------------- a synthetic store


def synthetic_shard(rng: np.random.Generator, tokens: int, vocab_size: int):
    """(tokens, sentences, documents) arrays of about `tokens` ids in whole documents."""
    n_sent = int(tokens / 22 * 1.5) + 16  # more than enough sentences: the budget cuts them
    lengths = np.clip(rng.lognormal(np.log(22), 0.6, n_sent).astype(np.int64), 1, 256)
    sentences = np.r_[0, np.cumsum(lengths)]
    doc_lengths = np.clip(rng.lognormal(np.log(12), 1.0, n_sent).astype(np.int64), 1, 2000)
    documents = np.r_[0, np.cumsum(doc_lengths)]
    # Whole documents up to the token budget (at least one document).
    last_sentence = max(1, int(np.searchsorted(sentences, tokens, side="right")) - 1)
    n_docs = max(1, int(np.searchsorted(documents, last_sentence, side="right")) - 1)
    documents = documents[: n_docs + 1]
    if documents[-1] > len(lengths):  # the last document ran past the drawn sentences: cut it there
        documents[-1] = len(lengths)
    sentences = sentences[: documents[-1] + 1]
    ids = rng.integers(1000, vocab_size, int(sentences[-1]), dtype=np.uint16)  # ordinary WordPieces
    return ids, sentences, documents


def write_synthetic_store(path: Path, tokenizer, total: int, shard_tokens: int, seed: int = 0) -> None:
    path.mkdir(parents=True, exist_ok=True)
    rng, entries, done = np.random.default_rng(seed), [], 0
    while done < total:
        name = f"shard-{len(entries):05d}"
        ids, sentences, documents = synthetic_shard(rng, min(shard_tokens, total - done), tokenizer.vocab_size)
        for part, array in (("tokens", ids), ("sentences", sentences), ("documents", documents)):
            np.save(path / f"{name}.{part}.npy", array)
        entries.append(
            {
                "name": name,
                "documents": len(documents) - 1,
                "sentences": len(sentences) - 1,
                "tokens": len(ids),
                "sha256": {},
            }
        )
        done += len(ids)
        print(
            f"  wrote {name}: {len(ids):,} tokens, {len(sentences) - 1:,} sentences, {len(documents) - 1:,} documents",
            flush=True,
        )
    manifest = {
        "format": "bertserve-token-store",
        "version": 1,
        "tokenizer": {
            "fingerprint": tokenizer_fingerprint(tokenizer),
            "vocab_size": tokenizer.vocab_size,
            "lowercase": bool(tokenizer.lowercase),
        },
        "dtype": "uint16",
        "shards": entries,
        "totals": {k: sum(e[k] for e in entries) for k in ("documents", "sentences", "tokens")},
        "sources": [{"path": "synthetic", "bytes": 0, "format": "text"}],
        "stats": {},
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    (path / MANIFEST).write_text(json.dumps(manifest, indent=1))


# ---------------------------------------------------------------------------- the planner before issue 13


def sequential_plan(corpus, max_num_tokens: int, short_seq_prob: float, rng: random.Random):
    """The per-sentence Python loop that planned an epoch until issue 13 (NSP on), as a reference."""
    cols = [[] for _ in range(5)]
    for d in range(corpus.num_documents):
        s0, s1 = int(corpus.document_offsets[d]), int(corpus.document_offsets[d + 1])
        starts, n = corpus.sentence_offsets[s0 : s1 + 1].tolist(), s1 - s0

        def target():
            return rng.randint(2, max_num_tokens) if rng.random() < short_seq_prob else max_num_tokens

        chunk_start, length, goal, i = 0, 0, target(), 0
        while i < n:
            length += starts[i + 1] - starts[i]
            if i == n - 1 or length >= goal:
                k = i - chunk_start + 1
                a_end = chunk_start + (rng.randint(1, k - 1) if k >= 2 else 1)
                a_lo, a_hi = starts[chunk_start], starts[a_end]
                is_random = rng.random() < 0.5
                row = None
                if not is_random and k >= 2:
                    row = (a_lo, a_hi, a_hi, starts[i + 1], 0)
                elif not is_random and i + 1 < n:
                    i += 1
                    row = (a_lo, a_hi, starts[i], starts[i + 1], 0)
                elif not is_random and chunk_start > 0:
                    row = (starts[chunk_start - 1], a_lo, a_lo, a_hi, 0)
                if is_random:
                    b_lo, b_hi = _sequential_random_segment(corpus, d, goal - (a_hi - a_lo), rng)
                    row = (a_lo, a_hi, b_lo, b_hi, 1)
                    i = a_end - 1
                if row is not None:
                    for c, v in zip(cols, row):
                        c.append(v)
                chunk_start, length, goal = i + 1, 0, target()
            i += 1
    return [np.array(c, dtype=np.int64) for c in cols]


def _sequential_random_segment(corpus, d, target_length, rng):
    other = rng.randrange(corpus.num_documents - 1)
    other += other >= d
    s0, s1 = int(corpus.document_offsets[other]), int(corpus.document_offsets[other + 1])
    start = rng.randrange(s0, s1)
    offsets = corpus.sentence_offsets
    lo = int(offsets[start])
    j = int(np.searchsorted(offsets[start + 1 : s1 + 1], lo + target_length, side="left"))
    return lo, int(offsets[min(start + 1 + j, s1)])


def plan_stats(a_lo, a_hi, b_lo, b_hi, is_random, max_num_tokens) -> list[str]:
    total = np.minimum((a_hi - a_lo) + (b_hi - b_lo), max_num_tokens)
    return [
        f"{len(a_lo):,}",
        f"{np.mean(is_random):.3f}",
        f"{total.mean():.1f}",
        f"{np.mean(total >= max_num_tokens - 8):.3f}",
        f"{np.mean(total < max_num_tokens // 2):.3f}",
    ]


# ---------------------------------------------------------------------------- measurements


def time_store(path: Path, tokenizer, batch_size: int, max_seq_len: int, batches: int) -> list[list[str]]:
    t0 = time.perf_counter()
    store = open_store(path, tokenizer)
    t1 = time.perf_counter()
    data = PretrainingData(store, tokenizer, batch_size=batch_size, max_seq_len=max_seq_len, seed=0)
    n = data.num_batches(0)
    t2 = time.perf_counter()
    stream = data.iter_batches(0)
    next(stream)
    t3 = time.perf_counter()
    for _ in range(batches):
        next(stream)
    t4 = time.perf_counter()
    return [
        [
            f"{store.num_tokens / 1e6:,.0f} M tokens, {len(store.shards)} shards, "
            f"{store.num_sentences / 1e6:.1f} M sentences",
            f"{t1 - t0:.2f}",
            f"{t2 - t1:.2f}",
            f"{t3 - t2:.3f}",
            f"**{t3 - t0:.1f}**",
            f"{n * batch_size:,}",
            f"{batches * batch_size / (t4 - t3):,.0f}",
        ]
    ]


def compare_planners(store_path: Path, tokenizer, small_tokens: int, max_seq_len: int):
    shard = open_store(store_path, tokenizer).shards[0]
    cut = int(np.searchsorted(shard.sentence_offsets, small_tokens))
    d = min(max(2, int(np.searchsorted(shard.document_offsets, cut))), shard.num_documents)
    s, t = int(shard.document_offsets[d]), int(shard.sentence_offsets[int(shard.document_offsets[d])])
    corpus = TokenizedCorpus(
        shard.path,
        "google",
        shard.tokens[:t],
        np.asarray(shard.sentence_offsets[: s + 1]),
        np.asarray(shard.document_offsets[: d + 1]),
    )
    m = max_seq_len - SPECIAL_TOKENS_IN_A_PAIR  # PretrainingData.max_num_tokens with NSP
    t0 = time.perf_counter()
    old = sequential_plan(corpus, m, 0.1, random.Random(0))
    t1 = time.perf_counter()
    new = plan_instances(corpus, m, 0.1, True, np.random.default_rng(0))
    t2 = time.perf_counter()
    new_cols = [new.a_lo, new.a_hi, new.b_lo, new.b_hi, new.is_random_next]
    rows = [
        ["sequential (before)", f"{t1 - t0:.3f}", *plan_stats(*old, m)],
        ["vectorised (now)", f"{t2 - t1:.3f}", *plan_stats(*new_cols, m)],
    ]
    return corpus, rows, (t1 - t0) / (t2 - t1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=float, default=200e6, help="store size in tokens (default 200 M)")
    ap.add_argument("--shard-tokens", type=float, default=float(64 << 20), help="tokens a shard (default 64 Mi)")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/plan_bench"), help="where the store is written")
    ap.add_argument("--batches", type=int, default=300, help="batches streamed after the first")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--max-seq-len", type=int, default=128)
    ap.add_argument(
        "--small-tokens",
        type=float,
        default=10e6,
        help="corpus size of the planner comparison (at most the first shard)",
    )
    args = ap.parse_args()
    setup(threads=1)
    tokenizer = BertTokenizer.from_pretrained(MINILM_DIR)
    store = args.dir / f"store-{int(args.tokens)}"
    if not (store / MANIFEST).is_file():
        print(f"writing a synthetic store of {args.tokens:,.0f} tokens in {store} ...", flush=True)
        t = time.perf_counter()
        write_synthetic_store(store, tokenizer, int(args.tokens), int(args.shard_tokens))
        print(f"  written in {time.perf_counter() - t:.0f} s", flush=True)
    print(machine_line())
    print(f"\nstore: batch {args.batch_size}, sequence {args.max_seq_len}, NSP on, 1 thread\n")
    print(
        markdown_table(
            [
                "store",
                "open (s)",
                "plan epoch 0 (s)",
                "first batch (s)",
                "total (s)",
                "examples in epoch 0",
                f"examples/s over {args.batches} batches",
            ],
            time_store(store, tokenizer, args.batch_size, args.max_seq_len, args.batches),
        )
    )
    corpus, rows, speedup = compare_planners(store, tokenizer, int(args.small_tokens), args.max_seq_len)
    print(
        f"\nplanners on one epoch of {corpus.num_tokens / 1e6:.1f} M tokens ({corpus.num_sentences:,} sentences, "
        f"{corpus.num_documents:,} documents), target {args.max_seq_len - SPECIAL_TOKENS_IN_A_PAIR} tokens, short_seq_prob 0.1:\n"
    )
    print(
        markdown_table(
            [
                "planner",
                "time (s)",
                "instances",
                "NSP random",
                "mean tokens",
                "full (>= target-8)",
                "short (< target/2)",
            ],
            rows,
        )
    )
    print(f"\nspeed-up: {speedup:.0f}x")


if __name__ == "__main__":
    main()
