"""Late interaction (ColBERT) encoding, this project's against PyLate's, side by side in one run on one machine:
documents and queries per second through model/late_interaction.py (the engine's late_interaction runner's
computation: rows as PyLate makes them, the encoder padded, the projection, unit length, the skiplist) and
through `pylate.models.ColBERT.encode` in the Python that BERT_PYLATE_PYTHON names (PyLate is not a dependency
of this project), on the same checkpoint: all-MiniLM-L6-v2's encoder with PyLate's new 128-wide head
(model/training/colbert.py), written in PyLate's layout. Texts: the bundled held-out Wikipedia leads, the first
sentence of each a query, the lead a document. Both sides fp32 on the CPU, the same threads and batch size; the
first batch of each side is a warm-up. Prints a markdown table and the ratio.

    BERT_PYLATE_PYTHON=/path/to/venv/bin/python .venv/bin/python -m bench.colbert_bench --texts 256 --batch-size 32
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

PYLATE_SIDE = """
import json, sys, time, torch
from pylate import models
spec = json.load(sys.stdin)
torch.set_num_threads(spec["threads"])
model = models.ColBERT(spec["model"], device="cpu")
out = {}
for name, texts, is_query in (("documents", spec["documents"], False), ("queries", spec["queries"], True)):
    model.encode(texts[: spec["batch_size"]], is_query=is_query, batch_size=spec["batch_size"])  # warm-up
    start = time.perf_counter()
    model.encode(texts, is_query=is_query, batch_size=spec["batch_size"])
    out[name] = len(texts) / (time.perf_counter() - start)
json.dump(out, sys.stdout)
"""


def leads(n: int) -> tuple[list[str], list[str]]:
    from model.model_card import heldout_leads

    pairs = [(title, sentences) for title, sentences in heldout_leads() if sentences][:n]
    return [s[0] for _, s in pairs], [" ".join(s) for _, s in pairs]


def ours(path: Path, texts: list[str], is_query: bool, batch_size: int) -> float:
    from model.late_interaction import read_late_interaction, token_vectors
    from model.modeling import load_model
    from model.tokenizer import BertTokenizer

    li, bert, tok = read_late_interaction(path), load_model(path).eval(), BertTokenizer.from_pretrained(path)
    assert li is not None

    def run(chunk: list[str]) -> None:
        rows = [li.encode(tok, t, is_query) for t in chunk]
        width = max(len(r) for r, _ in rows)
        ids = torch.tensor([r + [tok.pad_token_id] * (width - len(r)) for r, _ in rows])
        mask = torch.tensor([[1] * a + [0] * (width - a) for _, a in rows])
        vectors = token_vectors(bert, li, ids, mask)
        kept = li.kept(tok, ids, mask, is_query)
        [v[k] for v, k in zip(vectors, kept)]

    with torch.inference_mode():
        run(texts[:batch_size])  # warm-up
        start = time.perf_counter()
        for i in range(0, len(texts), batch_size):
            run(texts[i : i + batch_size])
        return len(texts) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--texts", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    pylate = os.environ.get("BERT_PYLATE_PYTHON")
    if not pylate:
        sys.exit("set BERT_PYLATE_PYTHON to a Python with pylate installed")
    from model.tokenizer import BertTokenizer
    from model.training.colbert import ColBERTModel
    from tests.conftest import MINILM_DIR

    torch.set_num_threads(args.threads)
    queries, documents = leads(args.texts)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "colbert"
        torch.manual_seed(0)
        ColBERTModel.from_pretrained(MINILM_DIR).save_pretrained(
            path, tokenizer=BertTokenizer.from_pretrained(MINILM_DIR)
        )
        spec = {"model": str(path), "queries": queries, "documents": documents, "batch_size": args.batch_size}
        done = subprocess.run(
            [pylate, "-c", PYLATE_SIDE],
            input=json.dumps({**spec, "threads": args.threads}),
            capture_output=True,
            text=True,
        )
        if done.returncode:
            sys.exit(done.stderr[-2000:])
        theirs = json.loads(done.stdout)
        mine = {
            "documents": ours(path, documents, False, args.batch_size),
            "queries": ours(path, queries, True, args.batch_size),
        }
    print(f"{len(documents)} texts, batch {args.batch_size}, {args.threads} threads, fp32 CPU\n")
    print("| texts | this project (texts/s) | PyLate (texts/s) | ratio |\n|---|---:|---:|---:|")
    for name in ("documents", "queries"):
        print(f"| {name} | {mine[name]:.1f} | {theirs[name]:.1f} | {mine[name] / theirs[name]:.2f} |")


if __name__ == "__main__":
    main()
