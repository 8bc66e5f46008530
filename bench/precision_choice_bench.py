"""What `auto` chooses on this CPU for each kind of model (model/precision_choice.py): the card's measured table,
as an import or publish writes it (model.model_card.measure_precisions), for real MiniLM (all-MiniLM-L6-v2) as
each kind of model:

  encoder         MiniLM as it is (embeddings only)
  classifier      MiniLM with a fresh 3-label classification head (embeddings, classification)
  cross-encoder   MiniLM with a fresh 1-label head (embeddings, reranking order)
  fill-mask       MiniLM with an MLM head trained briefly (bench.precision_bench.train_mlm) (embeddings, top-5)

The heads are random or briefly trained: what they show is how far each precision moves an output, which is
what the bounds judge, not how good the head is. Speeds are one short timing each (the card's), on a machine
that may be busy: read them as rough.

    .venv/bin/python -m bench.precision_choice_bench                # ~5 minutes on 2 idle cores
    .venv/bin/python -m bench.precision_choice_bench --mlm-steps 30  # a briefer MLM head
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.common import MINILM_DIR, machine_line, markdown_table, setup
from bench.precision_bench import train_mlm
from model import precision_choice
from model.model_card import measure_precisions
from model.modeling import BertForSequenceClassification, BertModel
from model.tokenizer import BertTokenizer


def models(minilm: Path, mlm_steps: int):
    """(name, model) of each kind, MiniLM's weights under each head."""
    tok = BertTokenizer.from_pretrained(minilm)
    yield "encoder", BertModel.from_pretrained(minilm)
    for name, labels in (("classifier", 3), ("cross-encoder", 1)):
        torch.manual_seed(0)
        config = {"id2label": {i: f"l{i}" for i in range(labels)}}
        yield name, BertForSequenceClassification.from_pretrained(minilm, init_missing_heads=True, **config)
    yield "fill-mask", train_mlm(minilm, tok, mlm_steps)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--minilm", type=Path, default=MINILM_DIR)
    p.add_argument("--mlm-steps", type=int, default=120)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    setup(args.threads)
    tok = BertTokenizer.from_pretrained(args.minilm)
    print(f"{machine_line()}; kind {precision_choice.cpu_kind()}\n", flush=True)
    rows = []
    for name, model in models(args.minilm, args.mlm_steps):
        with tempfile.TemporaryDirectory() as tmp:
            model.eval().save_pretrained(tmp, tokenizer=tok)
            row = measure_precisions(tmp)
        chosen, why = precision_choice.choose(row)
        for precision, scores in row["precisions"].items():
            if precision == "fp32":
                continue
            measured = "; ".join(
                f"{output} " + ", ".join(f"{k} {v:.6g}" for k, v in values.items())
                for output, values in scores.items()
                if isinstance(values, dict)
            )
            rows.append([name, precision, f"{scores['speed']:g}x", measured])
        rows.append([name, f"**auto: {chosen}**", "", why])
        print(rows[-1], flush=True)
    print(markdown_table(["model", "precision", "speed vs fp32", "against fp32"], rows))


if __name__ == "__main__":
    main()
