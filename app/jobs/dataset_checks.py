"""The format check of a dataset file, for app/jobs/uploads.py: what meta.json records of a file of
each kind (corpus, labelled, token-labelled, qa, pairs, scored-pairs, retrieval), or a 422 that says why
it is not usable. The readers are model/data's, the ones training (and evaluation) use.

The check reads the whole file, in a child process whose CPU time (and wall-clock time)
BERT_DATASET_CHECK_SECONDS bounds, so a hostile file costs the API process nothing but a wait: not
even its GIL, which a check in a thread would hold while the event loop waits for it. The children
fork from a forkserver that has this module imported (started at the first check, about a second
once), so a check costs a few milliseconds more than it would in a thread.

What one upload may hold is bounded too: at most BERT_MAX_LABELS distinct labels (tags), each at
most MAX_LABEL_CHARS long, and at most MAX_EXAMPLE_CHARS of text in one example (a row, a tagged
sentence, a QA context, a pair with its negatives, a query, a document), at most MAX_NEGATIVES hard
negatives a pair; a corpus's lines and paragraphs are cut by model/data/corpus.py's readers. A retrieval
archive (.zip, .tar.gz, .tgz, .tar) is unpacked by its check, in the child, into the folder `data` beside it
(at most model/data/retrieval_data.py's MAX_ARCHIVE_MEMBERS members and BERT_MAX_DATASET_BYTES in all,
counted as they stream), and is not kept.
meta.json lists at most LISTED_LABELS labels (the most frequent), so GET /datasets stays small;
`num_labels` counts them all.
"""

from __future__ import annotations

import functools
import logging
import math
import multiprocessing
import resource
import sys
from collections import Counter
from pathlib import Path
from typing import Any, NamedTuple

from app.errors import ServiceError
from app.settings import Settings
from datadir.datasets import LISTED_LABELS
from model.data.corpus import detect_format, read_documents
from model.data.finetune import load_classification_data, table_format
from model.data.pairs import ANCHOR, NEGATIVE, POSITIVE, load_pairs, load_scored_pairs
from model.data.question_answering import read_squad
from model.data.retrieval_data import default_split, load_retrieval_splits, unpack_retrieval
from model.data.token_classification import read_tagged
from model.errors import UserError
from model.scores import entities
from model.sources import ARCHIVE_SUFFIXES

log = logging.getLogger("bertserve")

MAX_LABEL_CHARS = 200
MAX_EXAMPLE_CHARS = 1 << 20  # characters of text in one row, tagged sentence, QA context, query or document
MAX_NEGATIVES = 100  # hard negatives a pair: a bound, not a number anyone needs
UNPACKED = "data"  # the folder a retrieval archive is unpacked into, beside it


class Limits(NamedTuple):
    """What one upload may hold, from the settings."""

    max_labels: int  # BERT_MAX_LABELS
    max_bytes: int  # BERT_MAX_DATASET_BYTES: also what a retrieval archive may unpack to


def check_file(kind: str, path: Path, settings: Settings) -> dict[str, Any]:
    """What meta.json records of a dataset file of this kind (a 422 when it is not usable), checked in a
    child process with a CPU and time bound. Blocks: call it in a thread."""
    limits = Limits(max_labels=settings.max_labels, max_bytes=settings.max_dataset_bytes)
    request = {"kind": kind, "path": str(path), "limits": limits._asdict()}
    seconds = settings.dataset_check_seconds
    too_slow = ServiceError(
        "validation",
        f"file: checking the dataset took longer than {seconds:g} s "
        "(BERT_DATASET_CHECK_SECONDS); upload a smaller file",
    )
    ctx = _check_context()
    receiver, sender = ctx.Pipe(duplex=False)
    child = ctx.Process(
        target=_check_child, args=(sender, request, seconds), name="bertserve-dataset-check", daemon=True
    )
    try:
        try:
            child.start()
        finally:
            sender.close()
        try:
            # The first check waits for the forkserver to import this module; the clock starts once
            # the child says it runs.
            if not receiver.poll(CHILD_START_SECONDS) or receiver.recv() != "started":
                raise RuntimeError("the dataset check process did not start")
            if not receiver.poll(seconds):
                raise too_slow
            answer = receiver.recv()
        except EOFError:  # it died without answering: past its CPU limit (SIGXCPU, then SIGKILL), or a crash
            child.join(5)
            if child.exitcode in (-9, -24):
                raise too_slow from None
            log.error("the dataset check process failed (exit status %s)", child.exitcode)
            raise RuntimeError("the dataset check process failed") from None
    finally:
        receiver.close()
        if child.pid is not None:
            if child.is_alive():
                child.kill()
            child.join()
    if "error" in answer:
        raise ServiceError("validation", answer["error"])
    return answer["meta"]


CHILD_START_SECONDS = 120


@functools.cache
def _check_context():
    """The forkserver context the checks fork from, with this module preloaded in the server, and the
    main module too (`bert serve`'s script, or `python -m app.launcher.server`'s module), whose code every child
    would otherwise run again."""
    context = multiprocessing.get_context("forkserver")
    # A package's __main__ runs its program when imported; multiprocessing never runs it again.
    main = getattr(getattr(sys.modules["__main__"], "__spec__", None), "name", None)
    context.set_forkserver_preload(["__main__", *([main] if main and not main.endswith("__main__") else []), __name__])
    return context


def _check_child(conn, request: dict, seconds: float) -> None:
    """A check's child process: "started", then {"meta"} or {"error"} on `conn`."""
    cpu = max(1, math.ceil(seconds))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 5))  # SIGXCPU at `cpu` s, SIGKILL 5 s later
    conn.send("started")
    try:
        answer: dict[str, Any] = {"meta": CHECKS[request["kind"]](Path(request["path"]), Limits(**request["limits"]))}
    except ServiceError as e:
        answer = {"error": e.message}
    conn.send(answer)
    conn.close()


def _check_corpus(path: Path, limits: Limits) -> dict[str, Any]:
    if not _has_text(path):
        raise ServiceError("validation", "file: the corpus has no text")
    try:
        fmt = "jsonl" if path.suffix == ".jsonl" else detect_format(path)
        documents = sentences = 0
        for doc in read_documents(path, fmt):
            documents += 1
            sentences += len(doc)
    except (ValueError, UnicodeDecodeError) as e:
        raise ServiceError("validation", f"file: not a usable corpus: {_clean(e, path)}") from None
    if sentences == 0:
        raise ServiceError("validation", "file: the corpus has no text")
    return {"format": fmt, "documents": documents, "sentences": sentences}


def _has_text(path: Path) -> bool:
    with open(path, encoding="utf-8", errors="replace") as f:
        while piece := f.read(1 << 16):
            if not piece.isspace():
                return True
    return False


def _check_labelled(path: Path, limits: Limits) -> dict[str, Any]:
    try:
        data = load_classification_data(path, path)  # eval = train: no split, every row checked
    except (ValueError, UnicodeDecodeError, KeyError) as e:
        raise ServiceError(
            "validation",
            f"file: not a usable labelled table (columns text, label and optionally text_pair): {_clean(e, path)}",
        ) from None
    labels = list(data.id2label.values())
    if len(labels) < 2:
        raise ServiceError("validation", f"file: a classifier needs at least 2 labels, found {labels}")
    _check_labels(labels, limits.max_labels)
    _check_sizes(
        f"row {i + 1}'s text"
        for i, e in enumerate(data.train)
        if len(e.text) + len(e.text_pair or "") > MAX_EXAMPLE_CHARS
    )
    listed, counts = _listed(labels, Counter(data.id2label[int(example.label)] for example in data.train))
    return {
        "format": path.suffix.lstrip("."),
        "rows": len(data.train),
        "num_labels": len(labels),
        "labels": listed,
        "label_counts": counts,
        "is_pair": data.is_pair,
    }


def _check_token_labelled(path: Path, limits: Limits) -> dict[str, Any]:
    try:
        sentences = read_tagged(path)
    except (ValueError, UnicodeDecodeError) as e:
        raise ServiceError(
            "validation",
            f"file: not a usable token-labelled file (CoNLL columns, or JSONL with "
            f"tokens and tags; IOB2 tags): {_clean(e, path)}",
        ) from None
    tags = sorted({t for s in sentences for t in s.tags})
    _check_labels(tags, limits.max_labels)
    _check_sizes(f"the sentence on line {s.line}" for s in sentences if sum(map(len, s.tokens)) > MAX_EXAMPLE_CHARS)
    listed, _ = _listed(tags, Counter(t for s in sentences for t in s.tags))
    _, entity_counts = _listed([], Counter(type_ for s in sentences for type_, _, _ in entities(s.tags)))
    return {
        "format": "jsonl" if path.suffix == ".jsonl" else "conll",
        "sentences": len(sentences),
        "tokens": sum(len(s.tokens) for s in sentences),
        "num_labels": len(tags),
        "labels": listed,
        "entity_counts": dict(sorted(entity_counts.items())),
    }


def _check_qa(path: Path, limits: Limits) -> dict[str, Any]:
    try:
        examples = read_squad(path)
    except (ValueError, UnicodeDecodeError) as e:
        raise ServiceError("validation", f"file: not a usable SQuAD file: {_clean(e, path)}") from None
    _check_sizes(f"question {e.id!r}'s context" for e in examples if len(e.context) > MAX_EXAMPLE_CHARS)
    return {
        "format": "squad",
        "questions": len(examples),
        "impossible": sum(e.is_impossible for e in examples),
        "contexts": len({e.context for e in examples}),
    }


def _check_pairs(path: Path, limits: Limits) -> dict[str, Any]:
    try:
        pairs = load_pairs(path)
    except (ValueError, UnicodeDecodeError) as e:
        raise ServiceError(
            "validation",
            "file: not a usable pairs file (columns anchor, positive and optionally negative or "
            f"negative_1 .. negative_n): {_clean(e, path)}",
        ) from None
    negatives = len(pairs[0].negatives)
    if negatives > MAX_NEGATIVES:
        raise ServiceError(
            "validation", f"file: {negatives} negatives a row, more than the {MAX_NEGATIVES} a pair may have"
        )
    _check_sizes(
        f"row {i + 1}'s text"
        for i, p in enumerate(pairs)
        if len(p.anchor) + len(p.positive) + sum(map(len, p.negatives)) > MAX_EXAMPLE_CHARS
    )
    mean_chars = {
        ANCHOR: _mean(len(p.anchor) for p in pairs),
        POSITIVE: _mean(len(p.positive) for p in pairs),
        **({NEGATIVE: _mean(len(n) for p in pairs for n in p.negatives)} if negatives else {}),
    }
    return {
        "format": table_format(path),
        "rows": len(pairs),
        "negatives": negatives,
        "ids": any(p.id is not None for p in pairs),
        "distinct_anchors": len({p.anchor for p in pairs}),
        "mean_chars": mean_chars,
    }


def _check_scored_pairs(path: Path, limits: Limits) -> dict[str, Any]:
    try:
        pairs = load_scored_pairs(path)
    except (ValueError, UnicodeDecodeError) as e:
        raise ServiceError(
            "validation",
            f"file: not a usable scored-pairs file (columns sentence1, sentence2 and score): {_clean(e, path)}",
        ) from None
    _check_sizes(
        f"row {i + 1}'s text" for i, p in enumerate(pairs) if len(p.sentence1) + len(p.sentence2) > MAX_EXAMPLE_CHARS
    )
    return {
        "format": table_format(path),
        "rows": len(pairs),
        "mean_score": round(sum(p.score for p in pairs) / len(pairs), 4),
        "mean_chars": {
            "sentence1": _mean(len(p.sentence1) for p in pairs),
            "sentence2": _mean(len(p.sentence2) for p in pairs),
        },
    }


def _check_retrieval(path: Path, limits: Limits) -> dict[str, Any]:
    unpacked = path.name.endswith(ARCHIVE_SUFFIXES)
    where = path
    try:
        if unpacked:
            where = unpack_retrieval(path, path.parent / UNPACKED, limits.max_bytes, label="the archive")
            path.unlink()  # the folder is what is kept and read
        splits = load_retrieval_splits(where)
        split = default_split(where, splits)
    except (ValueError, UnicodeDecodeError, UserError) as e:
        raise ServiceError(
            "validation",
            "file: not a usable retrieval set (a BEIR folder's corpus.jsonl, queries.jsonl and qrels, in a "
            f".zip or .tar.gz; or one JSONL of documents and queries): {_clean(e, where)}",
        ) from None
    judged = splits[split]
    _check_sizes(f"query {q!r}" for q, text in judged.queries.items() if len(text) > MAX_EXAMPLE_CHARS)
    _check_sizes(f"document {d!r}" for d, text in judged.corpus.items() if len(text) > MAX_EXAMPLE_CHARS)
    return {
        **({"file": UNPACKED} if unpacked else {}),
        "format": "beir" if unpacked else "jsonl",
        "queries": len(judged.queries),
        "documents": len(judged.corpus),
        "judgements": sum(len(cids) for cids in judged.relevant.values()),
        "split": split,
        "splits": list(splits),
    }


def _mean(values) -> float:
    values = list(values)
    return round(sum(values) / len(values), 1) if values else 0.0


CHECKS = {
    "corpus": _check_corpus,
    "labelled": _check_labelled,
    "token-labelled": _check_token_labelled,
    "qa": _check_qa,
    "pairs": _check_pairs,
    "scored-pairs": _check_scored_pairs,
    "retrieval": _check_retrieval,
}


def _check_labels(labels: list[str], max_labels: int) -> None:
    if len(labels) > max_labels:
        raise ServiceError(
            "validation",
            f"file: {len(labels)} distinct labels, more than the {max_labels} this service allows (BERT_MAX_LABELS)",
        )
    long = next((label for label in labels if len(label) > MAX_LABEL_CHARS), None)
    if long is not None:
        raise ServiceError(
            "validation",
            f"file: the label {long[:40]!r}... is {len(long)} characters long; a label has at most {MAX_LABEL_CHARS}",
        )


def _check_sizes(too_long) -> None:
    """A 422 naming the first example (`too_long` yields their descriptions) over MAX_EXAMPLE_CHARS."""
    first = next(iter(too_long), None)
    if first is not None:
        raise ServiceError(
            "validation", f"file: {first} is longer than {MAX_EXAMPLE_CHARS} characters, the most one example may hold"
        )


def _listed(labels: list[str], counts: Counter) -> tuple[list[str], dict[str, int]]:
    """The labels and counts meta.json lists: all of them, or the LISTED_LABELS most frequent."""
    if len(labels) <= LISTED_LABELS and len(counts) <= LISTED_LABELS:
        return labels, dict(counts)
    top = dict(counts.most_common(LISTED_LABELS))
    return [label for label in labels if label in top][:LISTED_LABELS], top


def _clean(error: Exception, path: Path) -> str:
    """The data module's message without our temp path in it."""
    return str(error).replace(str(path), "the file")[:500]
