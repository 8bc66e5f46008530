"""Token stores for tests, written straight in the pinned format (model/data/store.py) from a tokenised
corpus cut into shards at document boundaries: the reader is tested without the builder."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from model.data.corpus import TokenizedCorpus, tokenizer_fingerprint


def write_store(path: Path, corpus: TokenizedCorpus, tokenizer, cuts: list[int]) -> Path:
    """`corpus` as a store whose shards start at documents `cuts` (0 < c < n_documents, ascending)."""
    path.mkdir(parents=True)
    edges = [0, *cuts, corpus.num_documents]
    entries = [_write_shard(path, f"shard-{i:05d}", corpus, d0, d1) for i, (d0, d1) in enumerate(zip(edges, edges[1:]))]
    totals = {k: sum(e[k] for e in entries) for k in ("documents", "sentences", "tokens")}
    manifest = {
        "format": "bertserve-token-store",
        "version": 1,
        "tokenizer": {
            "fingerprint": tokenizer_fingerprint(tokenizer),
            "vocab_size": tokenizer.vocab_size,
            "lowercase": bool(tokenizer.lowercase),
        },
        "dtype": corpus.tokens.dtype.name,
        "shards": entries,
        "totals": totals,
        "sources": [{"path": str(corpus.path), "bytes": 0, "format": corpus.format}],
        "stats": {},
        "created_at": "2026-12-02T00:00:00Z",
    }
    (path / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return path


def _write_shard(path: Path, name: str, corpus: TokenizedCorpus, d0: int, d1: int) -> dict:
    s0, s1 = int(corpus.document_offsets[d0]), int(corpus.document_offsets[d1])
    t0, t1 = int(corpus.sentence_offsets[s0]), int(corpus.sentence_offsets[s1])
    arrays = {
        "tokens": np.asarray(corpus.tokens[t0:t1]),
        "sentences": np.asarray(corpus.sentence_offsets[s0 : s1 + 1]) - t0,
        "documents": np.asarray(corpus.document_offsets[d0 : d1 + 1]) - s0,
    }
    sha = {}
    for part, array in arrays.items():
        np.save(path / f"{name}.{part}.npy", array)
        sha[part] = hashlib.sha256((path / f"{name}.{part}.npy").read_bytes()).hexdigest()
    return {"name": name, "documents": d1 - d0, "sentences": s1 - s0, "tokens": t1 - t0, "sha256": sha}
