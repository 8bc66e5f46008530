"""A sharded token store: a tokenised corpus of any size as a directory of memory-mapped numpy shards.

The format (pinned in issue 13; `bert corpus build` writes it, this module reads it):

    STORE_DIR/shard-00000.tokens.npy      token ids, flat: uint16 when the vocabulary fits, else int32
    STORE_DIR/shard-00000.sentences.npy   int64 (n_sentences + 1,): sentence i is tokens[s[i]:s[i + 1]]
    STORE_DIR/shard-00000.documents.npy   int64 (n_documents + 1,): document d is sentences d[d]..d[d + 1] - 1
    STORE_DIR/shard-00001.*, ...          whole documents only: a document never spans two shards
    STORE_DIR/manifest.json               written last: the store is complete iff it exists

Each shard is the same three arrays as the single-file token cache of model/data/corpus.py, so a shard
is read as a TokenizedCorpus. A TokenStore puts its shards end to end: global token, sentence and
document indices are a shard's local index plus the counts of the shards before it, and `tokens[lo:hi]`
reads the one shard that holds the range (a sentence, hence a segment, never spans shards).

A store is always packed as documents (Google's rules, model/data/pretraining.py), whatever its
sources' formats were: a line of a "pairs" source is a document of two sentences there.

Opening checks what is cheap: format and version, every shard's files, their lengths against the
manifest's counts, the arrays' end points, and the tokenizer fingerprint against the tokenizer a run
trains with. The builder's sha256 of each file is not re-hashed here (minutes on a large store).

    store = open_store("corpus.store", tokenizer)   # ValueError naming what is wrong
    store.num_tokens, store.shards[0].sentence(0), store.tokens[lo:hi]

Reference: numpy `.npy` format and `np.load(mmap_mode="r")`; Megatron-LM's indexed dataset (a flat
token file plus offset index, read memory-mapped) for the layout idea.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from model.data.corpus import TokenizedCorpus, tokenizer_fingerprint

STORE_FORMAT = "bertserve-token-store"
STORE_VERSION = 1
MANIFEST = "manifest.json"
PARTS = ("tokens", "sentences", "documents")
TOKEN_DTYPES = ("uint16", "int32")


def is_store(path: str | os.PathLike) -> bool:
    """True for a complete token store: a directory with a manifest.json."""
    path = Path(path)
    return path.is_dir() and (path / MANIFEST).is_file()


class ShardedTokens:
    """The shards' token arrays end to end, sliced as one: `tokens[lo:hi]` with global offsets."""

    def __init__(self, shards: list[TokenizedCorpus], bases: np.ndarray):
        self.shards, self.bases = shards, bases
        self.dtype = shards[0].tokens.dtype

    def __len__(self) -> int:
        return int(self.bases[-1])

    def __getitem__(self, key: slice) -> np.ndarray:
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError(f"token store views take contiguous slices only, got {key!r}")
        lo, hi, _ = key.indices(len(self))
        if hi <= lo:
            return np.empty(0, dtype=self.dtype)
        s = int(np.searchsorted(self.bases, lo, side="right")) - 1
        base = int(self.bases[s])
        if hi > self.bases[s + 1]:
            raise ValueError(f"tokens[{lo}:{hi}] spans shards {s} and {s + 1}; a segment never does")
        return self.shards[s].tokens[lo - base : hi - base]


@dataclass
class TokenStore:
    """Shards (TokenizedCorpus each) read as one corpus; `format` is "store", planned as documents."""

    path: Path
    manifest: dict
    shards: list[TokenizedCorpus]
    format: str = "store"
    token_bases: np.ndarray = field(init=False)  # (n_shards + 1,) global offset of each shard's first token
    sentence_bases: np.ndarray = field(init=False)
    document_bases: np.ndarray = field(init=False)

    def __post_init__(self):
        def bases(counts):
            return np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).astype(np.int64)

        self.token_bases = bases([s.num_tokens for s in self.shards])
        self.sentence_bases = bases([s.num_sentences for s in self.shards])
        self.document_bases = bases([s.num_documents for s in self.shards])
        self.tokens = ShardedTokens(self.shards, self.token_bases)

    @property
    def num_documents(self) -> int:
        return int(self.document_bases[-1])

    @property
    def num_sentences(self) -> int:
        return int(self.sentence_bases[-1])

    @property
    def num_tokens(self) -> int:
        return int(self.token_bases[-1])

    def document_of_token(self, offsets) -> np.ndarray:
        """Global document index holding each global token offset (for tracing where a segment came from)."""
        offsets = np.asarray(offsets, dtype=np.int64)
        shard = np.searchsorted(self.token_bases, offsets, side="right") - 1
        out = np.empty(offsets.shape, dtype=np.int64)
        for s in np.unique(shard):
            at = shard == s
            local = self.shards[s].document_of_token(offsets[at] - self.token_bases[s])
            out[at] = local + self.document_bases[s]
        return out

    def with_shards(self, shards: list[TokenizedCorpus]) -> TokenStore:
        """A store of other shards under the same path and manifest (a held-out split's two sides)."""
        return TokenStore(self.path, self.manifest, list(shards))


def open_store(path: str | os.PathLike, tokenizer=None) -> TokenStore:
    """A validated, memory-mapped token store; with `tokenizer`, also checks it built the store."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"token store not found: {path}")
    manifest = _read_manifest(path)
    shards = [_open_shard(path, entry, manifest["dtype"]) for entry in manifest["shards"]]
    store = TokenStore(path, manifest, shards)
    totals = manifest.get("totals") or {}
    found = {"documents": store.num_documents, "sentences": store.num_sentences, "tokens": store.num_tokens}
    if {k: totals.get(k) for k in found} != found:
        raise ValueError(f"{path / MANIFEST}: totals {totals} do not match the shards' sum {found}")
    if tokenizer is not None:
        check_tokenizer(store, tokenizer)
    return store


def check_tokenizer(store: TokenStore, tokenizer) -> None:
    """ValueError unless `tokenizer` is the one the store was built with (same vocabulary and case)."""
    built = store.manifest.get("tokenizer") or {}
    mine = tokenizer_fingerprint(tokenizer)
    if built.get("fingerprint") != mine:
        raise ValueError(
            f"{store.path} was tokenised by another tokenizer: fingerprint {built.get('fingerprint')!r} "
            f"(vocab_size {built.get('vocab_size')}, lowercase {built.get('lowercase')}), but this run's "
            f"tokenizer is {mine!r} (vocab_size {tokenizer.vocab_size}, lowercase {bool(tokenizer.lowercase)}); "
            "rebuild the store with this tokenizer or train with the store's"
        )


def _read_manifest(path: Path) -> dict:
    file = path / MANIFEST
    if not file.is_file():
        raise ValueError(f"{path} is not a complete token store: no {MANIFEST} (the builder writes it last)")
    try:
        manifest = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file} is not valid JSON: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != STORE_FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise ValueError(f"{file}: format is {found!r}, expected {STORE_FORMAT!r}")
    if manifest.get("version") != STORE_VERSION:
        raise ValueError(
            f"{file}: version {manifest.get('version')!r} is not supported (this reader reads version {STORE_VERSION})"
        )
    if manifest.get("dtype") not in TOKEN_DTYPES:
        raise ValueError(f"{file}: dtype {manifest.get('dtype')!r}, expected one of {TOKEN_DTYPES}")
    if not manifest.get("shards"):
        raise ValueError(f"{file}: the store has no shards")
    return manifest


def _open_shard(path: Path, entry: dict, dtype: str) -> TokenizedCorpus:
    name = entry.get("name")
    arrays = {}
    for part in PARTS:
        file = path / f"{name}.{part}.npy"
        if not file.is_file():
            raise ValueError(f"{path}: shard {name!r} has no {file.name} (an incomplete or damaged store)")
        try:
            arrays[part] = np.load(file, mmap_mode="r")
        except ValueError as e:
            raise ValueError(f"{file} is not a readable .npy array: {e}") from None
    expected = {
        "tokens": entry.get("tokens"),
        "sentences": _plus_one(entry.get("sentences")),
        "documents": _plus_one(entry.get("documents")),
    }
    for part in PARTS:
        if arrays[part].ndim != 1 or len(arrays[part]) != expected[part]:
            raise ValueError(
                f"{path / f'{name}.{part}.npy'} has {arrays[part].shape[0]} entries, the manifest "
                f"says {expected[part]} ({_counts(entry)})"
            )
    if arrays["tokens"].dtype != np.dtype(dtype):
        raise ValueError(f"{path / f'{name}.tokens.npy'} holds {arrays['tokens'].dtype}, the manifest says {dtype}")
    s, d = arrays["sentences"], arrays["documents"]
    if s[0] != 0 or s[-1] != len(arrays["tokens"]) or d[0] != 0 or d[-1] != len(s) - 1:
        raise ValueError(
            f"{path}: shard {name!r} offsets do not start at 0 and end at its token and sentence "
            f"counts (sentences {s[0]}..{s[-1]}, documents {d[0]}..{d[-1]})"
        )
    return TokenizedCorpus(path / str(name), "store", arrays["tokens"], s, d)


def _plus_one(count) -> int | None:
    return count + 1 if isinstance(count, int) else None


def _counts(entry: dict) -> str:
    return ", ".join(f"{k} {entry.get(k)}" for k in ("documents", "sentences", "tokens"))
