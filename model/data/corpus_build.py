"""Build a sharded token store from raw text of any size: `bert corpus build` (the training side reads it).

A store is a directory of shards plus `manifest.json`:

    shard-00000.tokens.npy     flat token ids, uint16 when the vocabulary has <= 65536 ids, else int32
    shard-00000.sentences.npy  int64 (n_sentences + 1,): sentence i is tokens[s[i]:s[i + 1]], s[0] = 0
    shard-00000.documents.npy  int64 (n_documents + 1,): document d is sentences d[d]..d[d + 1] - 1
    ...                        (the arrays of model/data/corpus.py's cache, one set a shard)
    manifest.json              written last, by rename: the store is complete iff it exists

How it is built, and why it is a pure function of (inputs, tokenizer, options):

1. Inputs (files, folders, globs) are sorted by path and cut into work units: a whole file, or for an
   uncompressed text/JSONL file larger than `unit_bytes`, byte ranges cut at document boundaries.
2. Worker processes (spawned; tokenizers' Rust threads never see a fork) read a unit, drop exact-duplicate
   paragraphs within it, tokenise in large `encode_batch` calls, drop near-empty and non-text sentences
   and write the unit's arrays to `.build/` in parts of bounded size. At most 2 x workers units are
   in flight, so memory and temporary disk stay bounded whatever the corpus size.
3. The main process takes unit results strictly in unit order, drops paragraphs whose hash it has seen
   in an earlier unit (first occurrence wins), and appends whole documents to the open shard, closing it
   once it holds `shard_tokens` tokens.

Cleaning (counted in the manifest's "stats"): a sentence of fewer than 2 tokens is near-empty; one whose
tokens are less than half words (pieces with a letter or digit; punctuation, symbols and [UNK] are not)
is non-text (table rows, markup, binary junk). A pair ("pairs" format) loses both sides if one goes.

Deduplication: a paragraph's key is the first 8 bytes of blake2b over its sentences joined with single
spaces. The keys kept so far live in sorted uint64 arrays merged like an LSM tree: 8 bytes per distinct
paragraph (16 during a merge), e.g. 800 MB for 100 M distinct paragraphs. The chance of any false
duplicate among n paragraphs is about n^2 / 2^65: 0.03% at 100 M. A worker's own set (paragraphs of the
part it is writing) is cleared with each part, so it stays small even for one huge compressed file.

Resume: a closed shard's three files are renamed into place, then its paragraph keys and a done-record
(its counts, sha256s, the unit position it ends at and the cumulative stats) are written to `.build/`.
A rerun with the same inputs and options keeps the shards with done-records, restores the key set and
the stats from them and re-tokenises from the unit the last one ended in; the result is byte for byte
the store an uninterrupted build writes (except the manifest's created_at).

References: google-research/bert `create_pretraining_data.py` (documents of sentences); Lee et al. 2022,
"Deduplicating Training Data Makes Language Models Better" (exact-duplicate removal by hash); NVIDIA
Megatron-LM `tools/preprocess_data.py` (parallel tokenisation into an indexed binary dataset).
"""

from __future__ import annotations

import glob
import hashlib
import json
import multiprocessing as mp
import os
import re
import shutil
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np

from datadir.files import atomic_write_bytes, fsync_dir
from model.data.corpus import (
    READ_FORMATS,
    _ArrayWriter,
    compression_of,
    detect_format,
    read_paragraphs,
    tokenizer_fingerprint,
)
from model.data.store import MANIFEST, STORE_FORMAT, STORE_VERSION

BUILD_DIR = ".build"  # work files of an unfinished build (unit parts, done-records); removed at the end
DEFAULT_SHARD_TOKENS = 64 * 2**20
# Big enough to amortise a task, small enough to spread a file over workers and even out the last ones.
DEFAULT_UNIT_BYTES = 8 * 2**20
# Text per encode_batch call: large enough that Rust does the work, small enough to stream.
ENCODE_CHARS = 1 << 20
PART_TOKENS = 8 * 2**20  # a unit's output is written in parts of about this many tokens (bounded memory)
MIN_SENTENCE_TOKENS = 2
MIN_WORD_SHARE = 0.5
_WORD = re.compile(r"[^\W_]")  # a letter or digit in any script
_SHARD_NAME = "shard-{:05d}"
_STAT_KEYS = (
    "documents_read",
    "paragraphs_read",
    "sentences_read",
    "paragraphs_duplicate",
    "documents_duplicate",
    "sentences_near_empty",
    "sentences_non_text",
    "paragraphs_empty",
    "documents_empty",
    "wiki_redirects",
    "wiki_other_namespaces",
    "wiki_empty_articles",
    "wiki_oversize_pages",
)


@dataclass(frozen=True)
class Source:
    path: str
    bytes: int
    format: str
    compression: str | None


@dataclass(frozen=True)
class Unit:
    """One work unit: a whole file, or bytes [start, end) of an uncompressed one."""

    index: int
    path: str
    format: str
    start: int | None = None
    end: int | None = None

    @property
    def bytes(self) -> int:
        return self.end - self.start if self.start is not None and self.end is not None else os.path.getsize(self.path)


@dataclass
class BuildOptions:
    format: str | None = None  # None: detect per file
    text_field: str = "text"
    shard_tokens: int = DEFAULT_SHARD_TOKENS
    unit_bytes: int = DEFAULT_UNIT_BYTES

    def __post_init__(self):
        if self.format is not None and self.format not in READ_FORMATS:
            raise ValueError(f"unknown corpus format {self.format!r}; expected one of {READ_FORMATS}")
        if self.shard_tokens < 1:
            raise ValueError(f"shard_tokens must be >= 1, got {self.shard_tokens}")
        if self.unit_bytes < 1024:
            raise ValueError(f"unit_bytes must be >= 1024, got {self.unit_bytes}")


# ---------------------------------------------------------------------------- inputs and units


def expand_inputs(patterns: Sequence[str | os.PathLike]) -> list[Path]:
    """Files named by paths, folders (every non-hidden file below) and globs; sorted, each once."""
    if not patterns:
        raise ValueError("no inputs given")
    files: set[Path] = set()
    for pattern in map(str, patterns):
        matches = [Path(pattern)] if os.path.exists(pattern) else [Path(p) for p in glob.glob(pattern, recursive=True)]
        if not matches:
            raise FileNotFoundError(f"input not found: {pattern}")
        for match in matches:
            files.update(_files_below(match) if match.is_dir() else [match])
    if not files:
        raise ValueError(f"no files in the inputs {[str(p) for p in patterns]}")
    return sorted(p.resolve() for p in files)


def _files_below(folder: Path) -> Iterator[Path]:
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        yield from (Path(dirpath, f) for f in filenames if not f.startswith("."))


def describe_sources(files: Iterable[Path], format: str | None) -> list[Source]:
    return [Source(str(p), p.stat().st_size, format or detect_format(p), compression_of(p)) for p in files]


def plan_units(sources: Sequence[Source], unit_bytes: int) -> list[Unit]:
    """Work units in source order; large uncompressed line-based files are cut at document boundaries."""
    units: list[Unit] = []
    for src in sources:
        if src.compression or src.format == "wikixml" or src.bytes <= unit_bytes:
            units.append(Unit(len(units), src.path, src.format))
            continue
        cuts = _cut_points(Path(src.path), src.bytes, unit_bytes, blank_line=src.format in ("text", "google"))
        for start, end in zip(cuts, cuts[1:]):
            units.append(Unit(len(units), src.path, src.format, start, end))
    return units


def _cut_points(path: Path, size: int, unit_bytes: int, blank_line: bool) -> list[int]:
    """Offsets 0 < ... < size just after a document boundary near each multiple of unit_bytes."""
    boundary = re.compile(rb"\n[ \t\r\f\v]*\n" if blank_line else rb"\n")
    cuts = [0]
    with open(path, "rb") as f:
        while cuts[-1] + unit_bytes < size:
            cut = _next_boundary(f, cuts[-1] + unit_bytes, boundary)
            if cut is None or cut >= size:
                break
            cuts.append(cut)
    return cuts + [size]


def _next_boundary(f, offset: int, boundary: re.Pattern) -> int | None:
    # Start one byte early so a boundary that begins just before `offset` is found whole.
    f.seek(offset - 1)
    carry, pos = b"", offset - 1
    while block := f.read(1 << 20):
        data = carry + block
        m = boundary.search(data)
        if m:
            return pos - len(carry) + m.end()
        carry = data[-64:]  # a blank line of spaces longer than this is not a boundary we need
        pos += len(block)
    return None


# ---------------------------------------------------------------------------- worker: one unit


_worker: dict = {}


def _init_worker(tokenizer_json: str, word_table: np.ndarray, counters) -> None:
    # One Rust thread per worker process: --workers N means N cores, not N x cores threads.
    os.environ["RAYON_NUM_THREADS"] = "1"
    from tokenizers import Tokenizer

    _worker.update(tokenizer=Tokenizer.from_str(tokenizer_json), words=word_table, counters=counters)


def word_token_table(tokenizer) -> np.ndarray:
    """bool per token id: does the token hold a letter or digit (special tokens and [UNK] do not)."""
    tokens = tokenizer.convert_ids_to_tokens(list(range(tokenizer.vocab_size)))
    special = set(tokenizer.all_special_ids)
    return np.array([i not in special and bool(_WORD.search(t)) for i, t in enumerate(tokens)], dtype=bool)


def _process_unit(unit: Unit, build_dir: str, text_field: str) -> dict:
    """Tokenise one unit into part files in build_dir; returns their paths, document counts and stats."""
    stats = dict.fromkeys(_STAT_KEYS, 0)
    counters, read_bytes = _worker["counters"], [0]

    def on_read(n: int) -> None:
        read_bytes[0] += n

    docs = read_paragraphs(
        unit.path,
        unit.format,
        text_field,
        errors="replace",
        on_read=on_read,
        stats=stats,
        byte_range=None if unit.start is None or unit.end is None else (unit.start, unit.end),
    )
    parts: list[tuple[str, int]] = []
    pending: list[dict] = []
    seen: set[int] = set()
    for batch in _batches(_dedup_in_unit(docs, seen, stats), ENCODE_CHARS):
        piece = _encode_batch(batch, unit.format == "pairs", stats)
        pending.append(piece)
        if sum(len(p["tokens"]) for p in pending) >= PART_TOKENS:
            parts.append(_write_part(build_dir, unit.index, len(parts), pending))
            pending = []
            seen.clear()  # bounds a huge compressed unit's memory; the writer's key set catches the rest
        _report(counters, read_bytes, len(piece["tokens"]))
    if pending or not parts:
        parts.append(_write_part(build_dir, unit.index, len(parts), pending))
    _report(counters, read_bytes, 0)
    return {"unit": unit.index, "parts": parts, "stats": stats}


def _report(counters, read_bytes: list[int], tokens: int) -> None:
    with counters["bytes"].get_lock():
        counters["bytes"].value += read_bytes[0]
    with counters["tokens"].get_lock():
        counters["tokens"].value += tokens
    read_bytes[0] = 0


def paragraph_key(sentences: Sequence[str]) -> int:
    """The dedup key of a paragraph: 64 bits of blake2b over its words joined by single spaces."""
    text = " ".join(" ".join(sentences).split()).encode("utf-8", "replace")
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")


def _dedup_in_unit(docs: Iterator[list[list[str]]], seen: set[int], stats: dict) -> Iterator[tuple]:
    """(paragraphs, keys) per document, without paragraphs already seen in this unit."""
    for doc in docs:
        stats["documents_read"] += 1
        stats["paragraphs_read"] += len(doc)
        stats["sentences_read"] += sum(map(len, doc))
        paragraphs, keys = [], []
        for paragraph in doc:
            key = paragraph_key(paragraph)
            if key in seen:
                stats["paragraphs_duplicate"] += 1
                continue
            seen.add(key)
            paragraphs.append(paragraph)
            keys.append(key)
        if paragraphs:
            yield paragraphs, keys
        else:
            stats["documents_duplicate"] += 1


def _batches(docs: Iterator[tuple], max_chars: int) -> Iterator[list[tuple]]:
    batch, size = [], 0
    for doc in docs:
        batch.append(doc)
        size += sum(len(s) for p in doc[0] for s in p)
        if size >= max_chars:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _encode_batch(batch: list[tuple], pairs: bool, stats: dict) -> dict:
    """Tokenise a batch of documents and apply the sentence filters; returns the kept part as arrays."""
    sentences = [s for paragraphs, _ in batch for p in paragraphs for s in p]
    sent_per_para = np.array([len(p) for paragraphs, _ in batch for p in paragraphs], dtype=np.int64)
    para_per_doc = np.array([len(paragraphs) for paragraphs, _ in batch], dtype=np.int64)
    keys = np.fromiter(chain.from_iterable(k for _, k in batch), dtype=np.uint64, count=len(sent_per_para))
    ids = [e.ids for e in _worker["tokenizer"].encode_batch_fast(sentences, add_special_tokens=False)]
    lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    tokens = np.fromiter(chain.from_iterable(ids), dtype=np.int32, count=int(lengths.sum()))
    return _filter(tokens, lengths, sent_per_para, para_per_doc, keys, pairs, stats)


def _filter(tokens, lengths, sent_per_para, para_per_doc, keys, pairs: bool, stats: dict) -> dict:
    word_cum = np.concatenate([[0], np.cumsum(_worker["words"][tokens], dtype=np.int64)])
    ends = np.cumsum(lengths)
    words = word_cum[ends] - word_cum[ends - lengths]
    near_empty = lengths < MIN_SENTENCE_TOKENS
    non_text = ~near_empty & (words < MIN_WORD_SHARE * lengths)
    stats["sentences_near_empty"] += int(near_empty.sum())
    stats["sentences_non_text"] += int(non_text.sum())
    keep_sent = ~(near_empty | non_text)
    kept_per_para = _segment_sums(keep_sent, sent_per_para)
    keep_para = kept_per_para == sent_per_para if pairs else kept_per_para > 0
    stats["paragraphs_empty"] += int((~keep_para).sum())
    keep_sent &= np.repeat(keep_para, sent_per_para)
    kept_paras_per_doc = _segment_sums(keep_para, para_per_doc)
    stats["documents_empty"] += int((kept_paras_per_doc == 0).sum())
    kept_lengths = lengths[keep_sent]
    return {
        "tokens": tokens[np.repeat(keep_sent, lengths)],
        "sent_lengths": kept_lengths,
        "sent_per_para": kept_per_para[keep_para],
        "para_per_doc": kept_paras_per_doc[kept_paras_per_doc > 0],
        "keys": keys[keep_para],
    }


def _segment_sums(values: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Sum of values over consecutive segments of the given lengths (zero-length segments sum to 0)."""
    cum = np.concatenate([[0], np.cumsum(values, dtype=np.int64)])
    ends = np.cumsum(lengths)
    return cum[ends] - cum[ends - lengths]


def _write_part(build_dir: str, unit: int, part: int, pieces: list[dict]) -> tuple[str, int]:
    path = os.path.join(build_dir, f"unit-{unit:06d}-{part:04d}.npz")
    dtypes = {
        "tokens": np.int32,
        "sent_lengths": np.int64,
        "sent_per_para": np.int64,
        "para_per_doc": np.int64,
        "keys": np.uint64,
    }
    arrays = {k: np.concatenate([p[k] for p in pieces] + [np.zeros(0, dtype)]) for k, dtype in dtypes.items()}
    with open(path, "wb") as f:
        np.savez(f, **arrays)  # type: ignore[arg-type]  # (numpy's stubs: **arrays might fill allow_pickle)
    return path, len(arrays["para_per_doc"])


# ---------------------------------------------------------------------------- main process: the shards


class _KeySet:
    """Set of uint64 keys as a few sorted arrays (sizes roughly halving), merged as they fill: 8 bytes a key."""

    def __init__(self):
        self.levels: list[np.ndarray] = []

    def __len__(self) -> int:
        return sum(len(level) for level in self.levels)

    def contains(self, keys: np.ndarray) -> np.ndarray:
        found = np.zeros(len(keys), dtype=bool)
        for level in self.levels:
            idx = np.minimum(np.searchsorted(level, keys), len(level) - 1)
            found |= level[idx] == keys
        return found

    def add(self, keys: np.ndarray) -> None:
        if len(keys):
            self.levels.append(np.sort(keys))
        while len(self.levels) > 1 and len(self.levels[-2]) <= 2 * len(self.levels[-1]):
            last = self.levels.pop()
            self.levels[-1] = np.sort(np.concatenate([self.levels[-1], last]))


@dataclass
class _Docs:
    """Consecutive documents as flat arrays (a unit part, or a selection of one)."""

    tokens: np.ndarray
    sent_lengths: np.ndarray
    sent_per_para: np.ndarray
    para_per_doc: np.ndarray
    keys: np.ndarray

    @classmethod
    def load(cls, path: str) -> _Docs:
        with np.load(path) as z:
            return cls(*(z[k] for k in ("tokens", "sent_lengths", "sent_per_para", "para_per_doc", "keys")))

    def __len__(self) -> int:
        return len(self.para_per_doc)

    def offsets(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Start of each document in paragraphs, each paragraph in sentences, each sentence in tokens (+ end)."""
        cum = lambda a: np.concatenate([[0], np.cumsum(a, dtype=np.int64)])  # noqa: E731
        return cum(self.para_per_doc), cum(self.sent_per_para), cum(self.sent_lengths)

    def slice(self, a: int, b: int) -> _Docs:
        """Documents a..b-1."""
        p, s, t = self.offsets()
        pa, pb = p[a], p[b]
        return _Docs(
            self.tokens[t[s[pa]] : t[s[pb]]],
            self.sent_lengths[s[pa] : s[pb]],
            self.sent_per_para[pa:pb],
            self.para_per_doc[a:b],
            self.keys[pa:pb],
        )

    def keep_paragraphs(self, keep: np.ndarray) -> _Docs:
        """Only the paragraphs where `keep`; documents left with none disappear."""
        keep_sent = np.repeat(keep, self.sent_per_para)
        paras = _segment_sums(keep, self.para_per_doc)
        return _Docs(
            self.tokens[np.repeat(keep_sent, self.sent_lengths)],
            self.sent_lengths[keep_sent],
            self.sent_per_para[keep],
            paras[paras > 0],
            self.keys[keep],
        )

    def doc_tokens(self) -> np.ndarray:
        return _segment_sums(_segment_sums(self.sent_lengths, self.sent_per_para), self.para_per_doc)


@dataclass
class _Position:
    """Where the build stands: units before `unit` are written, and the first `docs` documents of `unit`."""

    unit: int = 0
    docs: int = 0


@dataclass
class _ResumeState:
    position: _Position = field(default_factory=_Position)
    records: list[dict] = field(default_factory=list)
    keys: _KeySet = field(default_factory=_KeySet)
    stats: dict = field(default_factory=lambda: dict.fromkeys(_STAT_KEYS, 0))


class _ShardWriter:
    """Appends documents in order to the open shard; closes it (files, keys, done-record) when it is full."""

    def __init__(self, out: Path, dtype, shard_tokens: int, state: _ResumeState):
        self.out, self.build, self.dtype, self.shard_tokens = out, out / BUILD_DIR, np.dtype(dtype), shard_tokens
        self.records, self.keys, self.stats = state.records, state.keys, state.stats
        self.position = state.position
        self._shard: _OpenShard | None = None

    def consume(self, result: dict, skip_docs: int) -> None:
        """A unit's result: its stats (unless it is the unit a resume restarts inside), then its documents."""
        if skip_docs == 0:
            _add_stats(self.stats, result["stats"])
        self.position = _Position(result["unit"], skip_docs)
        for path, n_docs in result["parts"]:
            if skip_docs >= n_docs:
                skip_docs -= n_docs
            else:
                docs = _Docs.load(path)
                self._consume_part(docs.slice(skip_docs, len(docs)) if skip_docs else docs)
                skip_docs = 0
            os.unlink(path)

    def _consume_part(self, docs: _Docs) -> None:
        dup = self.keys.contains(docs.keys)
        dup_per_doc = _segment_sums(dup, docs.para_per_doc)
        kept_docs = np.flatnonzero(dup_per_doc < docs.para_per_doc)  # index in `docs` of each kept document
        kept = docs.keep_paragraphs(~dup) if dup.any() else docs
        cum = np.cumsum(kept.doc_tokens())
        start, base, counted = 0, 0, 0  # next kept doc; tokens before it in cum; docs counted in stats
        while start < len(kept):
            shard = self._open()
            need = self.shard_tokens - shard.tokens + base
            end = min(int(np.searchsorted(cum, need)) + 1, len(kept))
            piece = kept.slice(start, end)
            shard.append(piece)
            self.keys.add(piece.keys)
            base, start = int(cum[end - 1]), end
            if shard.tokens >= self.shard_tokens:
                through = int(kept_docs[end - 1]) + 1
                counted = self._count_duplicates(dup_per_doc, docs.para_per_doc, counted, through)
                self._close(_Position(self.position.unit, self.position.docs + through))
        self._count_duplicates(dup_per_doc, docs.para_per_doc, counted, len(docs))
        self.position.docs += len(docs)

    def _count_duplicates(self, dup_per_doc, para_per_doc, a: int, b: int) -> int:
        self.stats["paragraphs_duplicate"] += int(dup_per_doc[a:b].sum())
        self.stats["documents_duplicate"] += int((dup_per_doc[a:b] == para_per_doc[a:b]).sum())
        return b

    def _open(self) -> _OpenShard:
        if self._shard is None:
            self._shard = _OpenShard(self.out, len(self.records), self.dtype)
        return self._shard

    def _close(self, position: _Position) -> None:
        assert self._shard is not None
        record = self._shard.close(self.build, position, self.stats)
        self.records.append(record)
        self._shard = None

    def finish(self, n_units: int) -> None:
        if self._shard is not None and self._shard.documents:
            self._close(_Position(n_units, 0))
        elif self._shard is not None:
            self._shard.abort()


class _OpenShard:
    def __init__(self, out: Path, index: int, dtype: np.dtype):
        self.out, self.name = out, _SHARD_NAME.format(index)
        self.writers = {
            part: _ArrayWriter(out / f"{self.name}.{part}.npy", dtype if part == "tokens" else np.int64)
            for part in ("tokens", "sentences", "documents")
        }
        self.writers["sentences"].append([0])
        self.writers["documents"].append([0])
        self.tokens = self.sentences = self.documents = 0
        self.keys: list[np.ndarray] = []

    def append(self, docs: _Docs) -> None:
        self.writers["tokens"].append(docs.tokens)
        self.writers["sentences"].append(self.tokens + np.cumsum(docs.sent_lengths))
        self.writers["documents"].append(
            self.sentences + np.cumsum(_segment_sums(docs.sent_per_para, docs.para_per_doc))
        )
        self.tokens += int(docs.sent_lengths.sum())
        self.sentences += len(docs.sent_lengths)
        self.documents += len(docs)
        self.keys.append(docs.keys)

    def close(self, build: Path, position: _Position, stats: dict) -> dict:
        for writer in self.writers.values():
            writer.finish()
        fsync_dir(self.out)
        keys = np.concatenate(self.keys) if self.keys else np.zeros(0, np.uint64)
        _atomic_save(build / f"{self.name}.keys.npy", keys)
        record = {
            "name": self.name,
            "documents": self.documents,
            "sentences": self.sentences,
            "tokens": self.tokens,
            "sha256": {part: _sha256(self.out / f"{self.name}.{part}.npy") for part in self.writers},
            "position": asdict(position),
            "stats": dict(stats),
        }
        atomic_write_bytes(build / f"{self.name}.done.json", json.dumps(record, indent=1).encode())
        return record

    def abort(self) -> None:
        for writer in self.writers.values():
            writer.abort()


def _add_stats(total: dict, more: dict) -> None:
    for key, value in more.items():
        total[key] = total.get(key, 0) + value


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def _atomic_save(path: Path, array: np.ndarray) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        np.save(f, array)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# ---------------------------------------------------------------------------- the build


def build_store(
    inputs: Sequence[str | os.PathLike],
    tokenizer,
    out: str | os.PathLike,
    *,
    workers: int = 1,
    options: BuildOptions | None = None,
    on_progress: Callable[[dict], None] | None = None,
) -> dict:
    """Build (or finish, or find finished) the token store `out` from `inputs`; returns its manifest.

    workers=1 tokenises in this process; more spawn that many processes. `on_progress` gets a dict
    (bytes_done, bytes_total, tokens, shards, elapsed_s) about twice a second.
    """
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    options = options or BuildOptions()
    sources = describe_sources(expand_inputs(inputs), options.format)
    units = plan_units(sources, options.unit_bytes)
    dtype = np.uint16 if tokenizer.vocab_size <= np.iinfo(np.uint16).max + 1 else np.int32
    out = Path(out)
    plan = _plan_record(sources, units, tokenizer, dtype, options)
    finished = _finished_manifest(out, plan)
    if finished is not None:
        return finished
    state = _resume(out, plan)
    writer = _ShardWriter(out, dtype, options.shard_tokens, state)
    todo = units[state.position.unit :]
    skip = {state.position.unit: state.position.docs}
    progress = _Progress(
        on_progress,
        sum(u.bytes for u in units),
        sum(u.bytes for u in units[: state.position.unit]),
        lambda: len(writer.records),
    )
    for result in _run_units(
        todo, tokenizer, word_token_table(tokenizer), out / BUILD_DIR, options.text_field, workers, progress
    ):
        writer.consume(result, skip.get(result["unit"], 0))
    writer.finish(len(units))
    if not writer.records:
        raise ValueError(f"the inputs hold no text that survives cleaning: {[s.path for s in sources]}")
    manifest = _manifest(plan, writer)
    atomic_write_bytes(out / MANIFEST, json.dumps(manifest, indent=1).encode())
    shutil.rmtree(out / BUILD_DIR, ignore_errors=True)
    progress.report(final=True)
    return manifest


def _plan_record(sources, units, tokenizer, dtype, options: BuildOptions) -> dict:
    return {
        "format": STORE_FORMAT,
        "version": STORE_VERSION,
        "tokenizer": {
            "fingerprint": tokenizer_fingerprint(tokenizer),
            "vocab_size": tokenizer.vocab_size,
            "lowercase": bool(tokenizer.lowercase),
        },
        "dtype": np.dtype(dtype).name,
        "sources": [asdict(s) for s in sources],
        "options": {
            "shard_tokens": options.shard_tokens,
            "unit_bytes": options.unit_bytes,
            "text_field": options.text_field,
            "units": len(units),
        },
        "mtimes_ns": [Path(s.path).stat().st_mtime_ns for s in sources],
    }


def _same_build(plan: dict, other: dict) -> bool:
    keys = ("format", "version", "tokenizer", "dtype", "sources", "options")
    return all(plan.get(k) == other.get(k) for k in keys)


def _finished_manifest(out: Path, plan: dict) -> dict | None:
    """The manifest of a finished store built exactly so; a ValueError if `out` holds another store."""
    try:
        manifest = json.loads((out / MANIFEST).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    built = {**manifest, "options": manifest.get("build")}
    if not _same_build({k: v for k, v in plan.items() if k != "mtimes_ns"}, built):
        raise ValueError(
            f"{out} holds a finished store built from other inputs, tokenizer or options; "
            "choose another output directory or delete it"
        )
    return manifest


def _resume(out: Path, plan: dict) -> _ResumeState:
    """State after the shards a killed build finished; removes what it left half-written."""
    build = out / BUILD_DIR
    build.mkdir(parents=True, exist_ok=True)
    plan_path = build / "plan.json"
    if plan_path.is_file():
        previous = json.loads(plan_path.read_text(encoding="utf-8"))
        if not _same_build(plan, previous) or previous.get("mtimes_ns") != plan["mtimes_ns"]:
            raise ValueError(
                f"{out} holds an unfinished build of other inputs, tokenizer or options (or the "
                "inputs changed since); delete it, or rerun with the same inputs and options"
            )
    else:
        if any(out.glob("shard-*")):
            raise ValueError(f"{out} holds shards but no build record; delete it or choose another directory")
        atomic_write_bytes(plan_path, json.dumps(plan, indent=1).encode())
    state = _ResumeState()
    while (record_path := build / f"{_SHARD_NAME.format(len(state.records))}.done.json").is_file():
        record = json.loads(record_path.read_text(encoding="utf-8"))
        state.records.append(record)
        state.keys.add(np.load(build / f"{record['name']}.keys.npy"))
    if state.records:
        state.position = _Position(**state.records[-1]["position"])
        state.stats = dict(state.records[-1]["stats"])
    _remove_leftovers(out, len(state.records))
    return state


def _remove_leftovers(out: Path, n_done: int) -> None:
    """Delete shards past the finished ones, temp files and unit parts of a killed build."""
    for path in out.glob("shard-*"):
        if int(path.name[len("shard-") :].split(".")[0]) >= n_done:
            path.unlink()
    for path in chain(out.glob(".shard-*"), (out / BUILD_DIR).glob("unit-*"), (out / BUILD_DIR).glob(".*")):
        path.unlink()
    for path in (out / BUILD_DIR).glob("shard-*"):
        if int(path.name[len("shard-") :].split(".")[0]) >= n_done:
            path.unlink()


def _manifest(plan: dict, writer: _ShardWriter) -> dict:
    shards = [{k: r[k] for k in ("name", "documents", "sentences", "tokens", "sha256")} for r in writer.records]
    totals = {k: sum(s[k] for s in shards) for k in ("documents", "sentences", "tokens")}
    stats = {
        **writer.stats,
        "unique_paragraphs": len(writer.keys),
        "dedup_key": "blake2b-64 of each paragraph's words joined by single spaces",
    }
    return {
        "format": STORE_FORMAT,
        "version": STORE_VERSION,
        "tokenizer": plan["tokenizer"],
        "dtype": plan["dtype"],
        "shards": shards,
        "totals": totals,
        "sources": plan["sources"],
        "stats": stats,
        "build": plan["options"],
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }


class _Progress:
    """Throttled progress callbacks from the shared counters the workers bump."""

    def __init__(self, callback, bytes_total: int, bytes_before: int, shards: Callable[[], int]):
        self.callback, self.bytes_total, self.bytes_before, self.shards = callback, bytes_total, bytes_before, shards
        self.started, self.last = time.monotonic(), 0.0
        self.counters: dict[str, Any] | None = None  # the shared counters, once _run_units makes them

    def report(self, final: bool = False) -> None:
        now = time.monotonic()
        if self.callback is None or self.counters is None or (not final and now - self.last < 0.5):
            return
        self.last = now
        self.callback(
            {
                "bytes_done": self.bytes_before + self.counters["bytes"].value,
                "bytes_total": self.bytes_total,
                "tokens": self.counters["tokens"].value,
                "shards": self.shards(),
                "elapsed_s": now - self.started,
                "final": final,
            }
        )


def _run_units(
    units: list[Unit], tokenizer, words: np.ndarray, build: Path, text_field: str, workers: int, progress: _Progress
) -> Iterator[dict]:
    """Each unit's result, in unit order; at most 2 x workers units tokenised ahead of the writer."""
    ctx = mp.get_context("spawn")
    counters = {"bytes": ctx.Value("q", 0), "tokens": ctx.Value("q", 0)}
    progress.counters = counters
    init = (tokenizer.backend_tokenizer.to_str(), words, counters)
    if workers == 1:
        _init_worker_here(*init)
        for unit in units:
            result = _process_unit(unit, str(build), text_field)
            progress.report()
            yield result
        return
    # concurrent.futures (not multiprocessing.Pool): a worker that dies fails the build instead of hanging it.
    with ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker, initargs=init) as pool:
        queue: deque[Future[dict]] = deque()
        todo = iter(units)
        for unit in _take(todo, 2 * workers):
            queue.append(pool.submit(_process_unit, unit, str(build), text_field))
        while queue:
            while not wait([queue[0]], timeout=0.5).done:
                progress.report()
            result = queue.popleft().result()
            for unit in _take(todo, 1):
                queue.append(pool.submit(_process_unit, unit, str(build), text_field))
            yield result


def _init_worker_here(tokenizer_json: str, word_table: np.ndarray, counters) -> None:
    # In this process the tokenizer keeps its default threads (RAYON_NUM_THREADS is the caller's business).
    from tokenizers import Tokenizer

    _worker.update(tokenizer=Tokenizer.from_str(tokenizer_json), words=word_table, counters=counters)


def _take(it: Iterator, n: int) -> list:
    return [x for _, x in zip(range(n), it)]
