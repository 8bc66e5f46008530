"""Tokenisation throughput: model.BertTokenizer (MiniLM's vocabulary) against transformers' BertTokenizerFast.

10,000 sentences from the Wikipedia demo corpus, each side timed in turns (bench/common.py):
  single    one .encode / __call__ per sentence (a request with one text);
  batched   __call__ on batches of --batch sentences, padded to the longest, as LongTensors;
  all       one __call__ on all sentences, lists without padding (a corpus pre-tokenisation).
Both wrap the same Rust `tokenizers` WordPiece, so the gap is per-call Python overhead; the check
column says whether the ids are identical.

    .venv/bin/python -m bench.tokenizer_bench
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("RAYON_NUM_THREADS", "2")  # the Rust thread pool, sized like torch's
os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import transformers

from bench.common import MINILM_DIR, WIKI_JSON, interleaved, machine_line, markdown_table, setup, si
from model.data.corpus import split_sentences
from model.tokenizer import BertTokenizer


def sentences(n: int) -> list[str]:
    out = []
    for page in json.loads(WIKI_JSON.read_text()).values():
        out += [s for s in split_sentences(page["extract"]) if s.strip()]
        if len(out) >= n:
            return out[:n]
    raise SystemExit(f"{WIKI_JSON} has only {len(out)} sentences, {n} wanted")


def contenders(ours, hf, texts, batch):
    chunks = [texts[i : i + batch] for i in range(0, len(texts), batch)]
    kw = dict(max_length=512, truncation=True)
    return {
        "single": (
            lambda: [ours.encode(t, **kw)["input_ids"] for t in texts],
            lambda: [hf(t, **kw)["input_ids"] for t in texts],
        ),
        "batched": (
            lambda: [ours(c, **kw)["input_ids"] for c in chunks],
            lambda: [hf(c, padding=True, return_tensors="pt", **kw)["input_ids"] for c in chunks],
        ),
        "all": (
            lambda: ours(texts, padding=False, return_tensors=None, **kw)["input_ids"],
            lambda: hf(texts, **kw)["input_ids"],
        ),
    }


def same(a, b) -> bool:
    if isinstance(a, list) and a and hasattr(a[0], "tolist"):
        return all(x.tolist() == y.tolist() for x, y in zip(a, b))
    return a == b


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sentences", type=int, default=10_000)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    setup(args.threads)
    texts = sentences(args.sentences)
    ours = BertTokenizer.from_pretrained(MINILM_DIR)
    hf = transformers.BertTokenizerFast.from_pretrained(MINILM_DIR)
    n_tokens = sum(len(ids) for ids in ours(texts, padding=False, return_tensors=None)["input_ids"])
    print(f"## Tokenizer benchmark\n\n{machine_line()}\n")
    print(
        f"{len(texts)} Wikipedia sentences, {n_tokens} tokens with [CLS]/[SEP] "
        f"({n_tokens / len(texts):.1f} a sentence); batches of {args.batch}. "
        "Times: median (min-max) ms for all the sentences.\n"
    )
    rows = []
    for mode, (mine, theirs) in contenders(ours, hf, texts, args.batch).items():
        check = "ids identical" if same(mine(), theirs()) else "IDS DIFFER"
        t = interleaved({"ours": mine, "hf": theirs}, rounds=args.rounds, block_s=0.0)
        rows.append(
            [
                mode,
                t["ours"].fmt(digits=0),
                t["hf"].fmt(digits=0),
                si(len(texts) / t["ours"].median),
                si(len(texts) / t["hf"].median),
                si(n_tokens / t["ours"].median),
                f"{t['hf'].median / t['ours'].median:.2f}x",
                check,
            ]
        )
    print(
        markdown_table(
            ["mode", "ours ms", "hf ms", "ours sent/s", "hf sent/s", "ours tok/s", "ours vs hf", "check"], rows
        )
    )


if __name__ == "__main__":
    main()
