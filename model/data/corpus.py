"""Pretraining corpora: read text, tokenise it once, keep the token ids beside the corpus as numpy arrays.

Four formats, detected from the file (or named with `format=`):

    "pairs"   one pair per line, `sentence A<TAB>sentence B` (the seed project's format)
    "google"  one sentence per line, documents separated by blank lines (Google's create_pretraining_data.py)
    "text"    plain text; a paragraph (blank-line separated block) is a document, split into sentences
    "jsonl"   one JSON object per line; its text field is a document, split into sentences

plus "wikixml", a Wikipedia `pages-articles` XML dump (model/data/wikixml.py), one article a document.
Any of them may be compressed: `.gz`, `.bz2`, `.xz` (standard library) or `.zst` (zstandard); the format is
detected from the name without that suffix and from the decompressed first lines (a `.txt` is text,
never a dump). `read_paragraphs` also reads a byte range of an uncompressed file (model/data/corpus_build.py
cuts large files so).

Every reader is bounded, so a small compressed file that holds one enormous line costs no more memory
than a normal one: a line is read at most MAX_LINE_CHARS characters at a time, and a longer one is cut
at word boundaries into lines of at most that ("pairs" and "jsonl" refuse it instead, naming the file
and line: a record cannot be cut); a paragraph (a document of "google" and "text", a blank-line
separated block of a JSONL text or an article) ends once it holds MAX_PARAGRAPH_CHARS, and the rest
goes on as the next one (likewise cut at word boundaries).

The cache for `<corpus>` and one tokenizer is four files beside it (or in `cache_dir`):

    <corpus>.<key>.tokens.npy     every token id, flat, uint16 when the vocabulary fits, else int32
    <corpus>.<key>.sentences.npy  int64 (n_sentences + 1,): sentence i is tokens[s[i]:s[i + 1]]
    <corpus>.<key>.documents.npy  int64 (n_documents + 1,): document d is sentences d[d]..d[d + 1] - 1
    <corpus>.<key>.meta.json      counts and the corpus size/mtime the arrays were built from

`key` hashes the tokenizer's vocabulary and lowercase flag with the format (and JSONL field); the meta file
holds the corpus's size and mtime, so an edited corpus is re-tokenised and an unchanged one never is.
Arrays are loaded with mmap, so a corpus larger than memory works. Each file is written to a temp name,
fsynced and renamed; the meta file goes last, so a crash mid-build leaves a cache that does not validate.

Reference: google-research/bert `create_pretraining_data.py` (input format, document handling).
"""

from __future__ import annotations

import bz2
import gzip
import hashlib
import io
import json
import logging
import lzma
import os
import re
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from datadir.files import atomic_write_bytes, fsync_path, iter_jsonl_objects

log = logging.getLogger(__name__)

FORMATS = ("pairs", "google", "text", "jsonl")
# What read_documents and load_corpus read: the four above and Wikipedia XML dumps.
READ_FORMATS = FORMATS + ("wikixml",)
COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst")
CACHE_VERSION = 1
# Sentences tokenised per call: big enough for the Rust tokenizer's parallelism, small enough to stream.
CHUNK_SENTENCES = 20_000
_SNIFF_LINES = 2_000
MAX_LINE_CHARS = 1 << 20  # a pretraining segment is 512 tokens; a line of a million characters is not prose
MAX_PARAGRAPH_CHARS = 1 << 20


# ---------------------------------------------------------------------------- sentence splitting

# Sentence end: . ! or ? (plus closing quotes/brackets), whitespace, then something that can start a sentence.
_BOUNDARY = re.compile(r"[.!?]+[\"'\u201d\u2019)\]]*\s+(?=[\"'\u201c\u2018(\[]?[A-Z0-9])")
_ABBREVIATIONS = frozenset(
    "mr mrs ms dr prof sr jr st vs etc e.g i.e inc ltd co corp no fig jan feb mar apr jun jul aug sep sept oct"
    " nov dec gen col lt sgt rev mt ft approx dept est u.s u.k a.m p.m".split()
)


def split_sentences(text: str) -> list[str]:
    """Split text into sentences with a simple rule: [.!?] + space + capital/digit, except after abbreviations.

    Newlines always end a sentence. Good enough for pretraining segments; not a linguistic parser.
    """
    sentences = []
    for line in text.splitlines():
        start = 0
        for m in _BOUNDARY.finditer(line):
            if _ends_with_abbreviation(line[start : m.start() + 1]):
                continue
            sentences.append(line[start : m.end()].strip())
            start = m.end()
        sentences.append(line[start:].strip())
    return [s for s in sentences if s]


def _ends_with_abbreviation(text: str) -> bool:
    words = text.rsplit(None, 1)  # only the last word matters; splitting the whole text is quadratic
    if not words:
        return False
    word = words[-1].rstrip(".").lstrip("\"'(\u201c").lower()
    # A single letter before the dot is an initial ("J. R. R. Tolkien").
    return word in _ABBREVIATIONS or (len(word) == 1 and word.isalpha())


# ---------------------------------------------------------------------------- opening files


class _RawSlice(io.RawIOBase):
    """Bytes [start, end) of a file (end None: to its end), telling `on_read` how many bytes each read took."""

    def __init__(
        self, path: Path, start: int = 0, end: int | None = None, on_read: Callable[[int], None] | None = None
    ):
        self._f = open(path, "rb")  # noqa: SIM115  (a file object: open until its close())
        self._f.seek(start)
        self._left = None if end is None else end - start
        self._on_read = on_read

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        view = memoryview(buffer)
        if self._left is not None:
            view = view[: self._left]
        n = self._f.readinto(view)
        if self._left is not None:
            self._left -= n
        if self._on_read is not None and n:
            self._on_read(n)
        return n

    def close(self) -> None:
        self._f.close()
        super().close()


def compression_of(path: str | os.PathLike) -> str | None:
    """The compression suffix of a file name (".gz", ".bz2", ".xz", ".zst"), or None."""
    suffix = Path(path).suffix.lower()
    return suffix if suffix in COMPRESSIONS else None


def open_binary(
    path: str | os.PathLike,
    byte_range: tuple[int, int] | None = None,
    on_read: Callable[[int], None] | None = None,
) -> io.BufferedIOBase:
    """A file's bytes, decompressed by its suffix; `byte_range` (uncompressed files only) reads a slice.

    `on_read(n)` hears of every n bytes read from disk (compressed bytes for compressed files): progress.
    """
    path = Path(path)
    compression = compression_of(path)
    if byte_range is not None and compression is not None:
        raise ValueError(f"a byte range of a compressed file cannot be read: {path} ({byte_range})")
    start, end = byte_range or (0, None)
    raw = _RawSlice(path, start, end, on_read=on_read)
    if compression is None:
        return io.BufferedReader(raw, buffer_size=1 << 20)
    if compression == ".gz":
        return gzip.GzipFile(fileobj=io.BufferedReader(raw, 1 << 20), mode="rb")
    if compression == ".bz2":
        return bz2.BZ2File(io.BufferedReader(raw, 1 << 20), mode="rb")
    if compression == ".xz":
        return lzma.LZMAFile(io.BufferedReader(raw, 1 << 20), mode="rb")
    import zstandard  # only where .zst files are read

    # (zstandard's stubs ask for IO[bytes]; it reads any file object, this raw one included)
    reader = zstandard.ZstdDecompressor().stream_reader(raw, closefd=True)  # type: ignore[arg-type]
    return io.BufferedReader(reader, 1 << 20)


def open_text(
    path: str | os.PathLike,
    byte_range: tuple[int, int] | None = None,
    errors: str = "strict",
    on_read: Callable[[int], None] | None = None,
) -> io.TextIOBase:
    """A file as UTF-8 text with universal newlines, decompressed by its suffix (see open_binary)."""
    # (typeshed's BufferedIOBase lacks the `name` attribute its TextIOWrapper asks for)
    binary = open_binary(path, byte_range, on_read)
    return io.TextIOWrapper(binary, encoding="utf-8", errors=errors)  # type: ignore[type-var]


# ---------------------------------------------------------------------------- readers

# A document is a list of paragraphs, a paragraph a list of sentences (the unit corpus_build deduplicates).
# Readers stream documents so a corpus never has to fit in memory.
_PARAGRAPH_BREAK = re.compile(r"\n\s*\n")


@dataclass(frozen=True)
class Bounds:
    """The longest line and paragraph a reader takes (module docstring)."""

    line: int = MAX_LINE_CHARS
    paragraph: int = MAX_PARAGRAPH_CHARS


def bounded_lines(f, path: Path, max_chars: int, cut: bool = True) -> Iterator[tuple[int, str]]:
    """(line number, line) of a text file, reading at most `max_chars` + 1 characters at a time. A longer
    line comes as several pieces with its number, cut at word boundaries (`cut`), or is a ValueError
    naming the file and line."""
    lineno, carry = 0, ""
    while True:
        text = carry + f.readline(max_chars + 1 - len(carry))
        if not text:
            return
        if text.endswith("\n") or len(text) <= max_chars:  # a whole line (or the last, unterminated one)
            lineno, carry = lineno + 1, ""
            yield lineno, text
            continue
        if not cut:
            raise ValueError(
                f"{path}, line {lineno + 1}: longer than {max_chars} characters, the most one line may hold"
            )
        head, carry = _cut(text, max_chars)
        yield lineno + 1, head + "\n"


def _cut(text: str, max_chars: int) -> tuple[str, str]:
    """`text` cut after its last whitespace within `max_chars` (at `max_chars` when it has none there)."""
    at = max(text.rfind(" ", 0, max_chars + 1), text.rfind("\t", 0, max_chars + 1))
    at = at if at > 0 else max_chars
    return text[:at], text[at:].lstrip(" \t")


def cut_at_words(text: str, max_chars: int) -> list[str]:
    """`text` in pieces of at most `max_chars`, cut at word boundaries where it has them."""
    pieces = []
    while len(text) > max_chars:
        head, text = _cut(text, max_chars)
        pieces.append(head)
    return pieces + [text]


def _read_pairs(f, path: Path, bounds: Bounds) -> Iterator[list[list[str]]]:
    for lineno, line in bounded_lines(f, path, bounds.line, cut=False):
        line = line.rstrip("\r\n")
        if not line.strip():
            continue
        parts = line.split("\t")
        if len(parts) != 2:
            what = "no tab" if len(parts) == 1 else f"{len(parts) - 1} tabs"
            raise ValueError(
                f"{path}, line {lineno}: expected 'sentence A<TAB>sentence B', found {what}: {line[:80]!r}"
            )
        a, b = parts[0].strip(), parts[1].strip()
        if not a or not b:
            raise ValueError(f"{path}, line {lineno}: sentence {'A' if not a else 'B'} is empty: {line[:80]!r}")
        yield [[a, b]]


def _read_google(f, path: Path, bounds: Bounds) -> Iterator[list[list[str]]]:
    doc: list[str] = []
    chars = 0
    for _, line in bounded_lines(f, path, bounds.line):
        line = line.strip()
        if doc and (not line or chars + len(line) > bounds.paragraph):  # a blank line, or the bound reached
            yield [doc]
            doc, chars = [], 0
        if line:
            doc.append(line)
            chars += len(line)
    if doc:
        yield [doc]


def _read_text(f, path: Path, bounds: Bounds) -> Iterator[list[list[str]]]:
    for [paragraph] in _read_google(f, path, bounds):
        yield [split_sentences(" ".join(paragraph))]


def _read_jsonl(f, path: Path, text_field: str, bounds: Bounds) -> Iterator[list[list[str]]]:
    lines = (line for _, line in bounded_lines(f, path, bounds.line, cut=False))
    for lineno, record in iter_jsonl_objects(lines, path):
        if text_field not in record:
            raise ValueError(f"{path}, line {lineno}: no {text_field!r} field (set text_field to the right name)")
        text = record[text_field]
        if not isinstance(text, str):
            raise ValueError(f"{path}, line {lineno}: field {text_field!r} is {type(text).__name__}, not a string")
        yield [
            split_sentences(piece) for p in _PARAGRAPH_BREAK.split(text) for piece in cut_at_words(p, bounds.paragraph)
        ]


def read_paragraphs(
    path: str | os.PathLike,
    format: str | None = None,
    text_field: str = "text",
    *,
    byte_range: tuple[int, int] | None = None,
    errors: str = "strict",
    on_read: Callable[[int], None] | None = None,
    stats: dict | None = None,
    bounds: Bounds = Bounds(),
) -> Iterator[list[list[str]]]:
    """Stream the documents of a corpus file as lists of paragraphs (lists of sentence strings).

    `byte_range` reads only that slice of an uncompressed file (cut at a document boundary: a blank line,
    or a newline for one-document-a-line formats); line numbers in errors then count from its start.
    `stats` (wikixml) gets counts of what the reader skipped. `bounds`: the longest line and paragraph.
    """
    path = Path(path)
    format = format or detect_format(path)
    if format not in READ_FORMATS:
        raise ValueError(f"unknown corpus format {format!r}; expected one of {READ_FORMATS}")
    return _paragraphs(path, format, text_field, byte_range, errors, on_read, stats, bounds)


def _paragraphs(path, format, text_field, byte_range, errors, on_read, stats, bounds) -> Iterator[list[list[str]]]:
    if format == "wikixml":
        from model.data.wikixml import read_wiki_articles  # mwparserfromhell loads only for dumps

        with open_binary(path, byte_range, on_read) as f:
            for article in read_wiki_articles(f, path, stats):
                pieces = (piece for p in article for piece in cut_at_words(p, bounds.paragraph))
                paragraphs = [p for p in map(split_sentences, pieces) if p]
                if paragraphs:
                    yield paragraphs
        return
    with open_text(path, byte_range, errors, on_read) as f:
        if format == "pairs":
            yield from _read_pairs(f, path, bounds)
        elif format == "google":
            yield from _read_google(f, path, bounds)
        elif format == "text":
            yield from _read_text(f, path, bounds)
        else:
            yield from _read_jsonl(f, path, text_field, bounds)


def read_documents(
    path: str | os.PathLike,
    format: str | None = None,
    text_field: str = "text",
    bounds: Bounds = Bounds(),
    on_read: Callable[[int], None] | None = None,
) -> Iterator[list[str]]:
    """Stream the documents (lists of sentence strings) of a corpus file (`on_read`: as read_paragraphs)."""
    paragraphs = read_paragraphs(path, format, text_field, bounds=bounds, on_read=on_read)
    return ([s for paragraph in doc for s in paragraph] for doc in paragraphs)


def detect_format(path: str | os.PathLike) -> str:
    """Guess a corpus's format: by extension (.jsonl/.ndjson, .tsv, .xml; a compression suffix is looked
    through), else from its first lines."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"corpus not found: {path}")
    name = path.name[: -len(compressed)] if (compressed := compression_of(path)) else path.name
    suffix = Path(name).suffix.lower()
    if suffix in (".jsonl", ".ndjson"):
        return "jsonl"
    if suffix == ".tsv":
        return "pairs"
    if suffix == ".xml":
        return "wikixml"
    lines = []
    try:
        with open_text(path) as f:
            for _, line in bounded_lines(f, path, MAX_LINE_CHARS):
                if line.strip():
                    lines.append(line.rstrip("\r\n"))
                    if len(lines) >= _SNIFF_LINES:
                        break
    except UnicodeDecodeError as e:
        raise ValueError(
            f"corpus {path} is not UTF-8 text (byte {e.object[e.start]:#04x} where UTF-8 was expected)"
        ) from None
    if not lines:
        raise ValueError(f"corpus {path} is empty")
    if suffix != ".txt" and lines[0].lstrip().startswith(("<mediawiki", "<?xml")):
        return "wikixml"
    if all("\t" in line for line in lines):
        return "pairs"
    if lines[0].lstrip().startswith("{") and _is_json_object(lines[0]):
        return "jsonl"
    multi = sum(len(split_sentences(line)) > 1 for line in lines)
    # Google's format has one sentence per line; wrapped prose or paragraph-per-line text has many.
    return "text" if multi > 0.2 * len(lines) else "google"


def _is_json_object(line: str) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except (json.JSONDecodeError, RecursionError):
        return False


# ---------------------------------------------------------------------------- tokenising


def tokenizer_fingerprint(tokenizer) -> str:
    """Hash of what decides token ids: the vocabulary in id order and the lowercase flag."""
    h = hashlib.sha256()
    for token in tokenizer.convert_ids_to_tokens(list(range(tokenizer.vocab_size))):
        h.update(token.encode("utf-8") + b"\n")
    h.update(f"lowercase={bool(tokenizer.lowercase)}".encode())
    return h.hexdigest()[:16]


def encode_sentences(tokenizer, sentences: Sequence[str]) -> list[list[int]]:
    """Token ids of each sentence, without [CLS]/[SEP], in one batched tokenizer call."""
    # The tokenizer's batch call adds [CLS] ... [SEP]; strip them. No length limit: packing truncates later.
    encoded = tokenizer(list(sentences), max_length=2**31 - 1, truncation=False, padding=False, return_tensors=None)
    return [ids[1:-1] for ids in encoded["input_ids"]]


class _ArrayWriter:
    """Append-only 1-D array on disk, finished as an .npy file by an atomic rename."""

    def __init__(self, path: Path, dtype):
        self.path, self.dtype, self.count = path, np.dtype(dtype), 0
        self._raw = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.raw")
        self._f = open(self._raw, "wb")  # noqa: SIM115  (open across append() calls until finish())

    def append(self, values) -> None:
        arr = np.asarray(values, dtype=self.dtype)
        self._f.write(arr.tobytes())
        self.count += arr.size

    def finish(self) -> None:
        self._f.close()
        tmp = self.path.with_name(f".{self.path.name}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            out = np.lib.format.open_memmap(tmp, mode="w+", dtype=self.dtype, shape=(self.count,))
            raw = np.memmap(self._raw, dtype=self.dtype, mode="r", shape=(self.count,)) if self.count else None
            step = 1 << 24
            for i in range(0, self.count, step):
                assert raw is not None
                out[i : i + step] = raw[i : i + step]
            out.flush()
            del out, raw
            fsync_path(tmp)
            os.replace(tmp, self.path)
        finally:
            tmp.unlink(missing_ok=True)
            self._raw.unlink(missing_ok=True)

    def abort(self) -> None:
        self._f.close()
        self._raw.unlink(missing_ok=True)


# ---------------------------------------------------------------------------- the cached corpus


@dataclass
class TokenizedCorpus:
    """A corpus as flat token ids (memory-mapped), with sentence and document boundaries."""

    path: Path
    format: str
    tokens: np.ndarray  # (n_tokens,) uint16 or int32
    sentence_offsets: np.ndarray  # (n_sentences + 1,) int64 token offsets
    document_offsets: np.ndarray  # (n_documents + 1,) int64 sentence offsets

    @property
    def num_documents(self) -> int:
        return len(self.document_offsets) - 1

    @property
    def num_sentences(self) -> int:
        return len(self.sentence_offsets) - 1

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def sentence(self, i: int) -> np.ndarray:
        return self.tokens[self.sentence_offsets[i] : self.sentence_offsets[i + 1]]

    def document(self, d: int) -> list[np.ndarray]:
        return [self.sentence(i) for i in range(self.document_offsets[d], self.document_offsets[d + 1])]

    def document_of_token(self, offsets) -> np.ndarray:
        """Document index holding each token offset (for tracing where a segment came from)."""
        sentence = np.searchsorted(self.sentence_offsets, offsets, side="right") - 1
        return np.searchsorted(self.document_offsets, sentence, side="right") - 1


def cache_paths(corpus: Path, key: str, cache_dir: Path | None = None) -> dict[str, Path]:
    base = (cache_dir or corpus.parent) / f"{corpus.name}.{key}"
    paths = {part: Path(f"{base}.{part}.npy") for part in ("tokens", "sentences", "documents")}
    return {**paths, "meta": Path(f"{base}.meta.json")}


def load_corpus(
    path: str | os.PathLike,
    tokenizer,
    *,
    format: str | None = None,
    text_field: str = "text",
    cache_dir: str | os.PathLike | None = None,
    on_tokenise: Callable[[int, int], None] | None = None,
) -> TokenizedCorpus:
    """Tokenised corpus from its cache, building the cache first if missing or stale. While it builds,
    `on_tokenise(done, total)` hears the bytes of the file read so far (0 first) and its size."""
    path = Path(path)
    format = format or detect_format(path)
    if format not in READ_FORMATS:
        raise ValueError(f"unknown corpus format {format!r}; expected one of {READ_FORMATS}")
    key_src = f"v{CACHE_VERSION}|{tokenizer_fingerprint(tokenizer)}|{format}|{text_field if format == 'jsonl' else ''}"
    key = hashlib.sha256(key_src.encode()).hexdigest()[:16]
    cache_dir = Path(cache_dir) if cache_dir is not None else None
    if cache_dir is not None:
        cache_dir.mkdir(parents=True, exist_ok=True)
    paths = cache_paths(path, key, cache_dir)
    corpus = _load_cached(path, format, paths)
    if corpus is None:
        log.info("tokenising %s (%s format) into %s", path, format, paths["tokens"])
        _build_cache(path, format, text_field, tokenizer, paths, on_tokenise)
        corpus = _load_cached(path, format, paths)
        assert corpus is not None, "freshly built cache did not validate"
    return corpus


def _stat_key(path: Path) -> dict:
    st = path.stat()
    return {"corpus_size": st.st_size, "corpus_mtime_ns": st.st_mtime_ns}


def _load_cached(path: Path, format: str, paths: dict[str, Path]) -> TokenizedCorpus | None:
    try:
        meta = json.loads(paths["meta"].read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    built_from = {k: meta.get(k) for k in ("corpus_size", "corpus_mtime_ns")}
    if meta.get("version") != CACHE_VERSION or built_from != _stat_key(path):
        return None
    try:
        arrays = {part: np.load(paths[part], mmap_mode="r") for part in ("tokens", "sentences", "documents")}
    except (FileNotFoundError, ValueError):
        return None
    if (len(arrays["tokens"]), len(arrays["sentences"]), len(arrays["documents"])) != (
        meta["n_tokens"],
        meta["n_sentences"] + 1,
        meta["n_documents"] + 1,
    ):
        return None
    return TokenizedCorpus(path, format, arrays["tokens"], arrays["sentences"], arrays["documents"])


def _build_cache(
    path: Path,
    format: str,
    text_field: str,
    tokenizer,
    paths: dict[str, Path],
    on_tokenise: Callable[[int, int], None] | None = None,
) -> None:
    before = _stat_key(path)
    on_read = _bytes_read(on_tokenise, before["corpus_size"]) if on_tokenise is not None else None
    dtype = np.uint16 if tokenizer.vocab_size <= np.iinfo(np.uint16).max + 1 else np.int32
    if not os.access(paths["tokens"].parent, os.W_OK):
        raise PermissionError(f"cannot write the token cache in {paths['tokens'].parent}; pass cache_dir=")
    writers = {
        "tokens": _ArrayWriter(paths["tokens"], dtype),
        "sentences": _ArrayWriter(paths["sentences"], np.int64),
        "documents": _ArrayWriter(paths["documents"], np.int64),
    }
    state = {"tokens": 0, "sentences": 0, "dropped": 0}
    writers["sentences"].append([0])
    writers["documents"].append([0])
    try:
        for chunk in _chunks(read_documents(path, format, text_field, on_read=on_read), CHUNK_SENTENCES):
            _write_chunk(chunk, tokenizer, writers, state, min_sentences=2 if format == "pairs" else 1)
        n_docs = writers["documents"].count - 1
        if n_docs == 0:
            raise ValueError(f"corpus {path} has no text ({format} format)")
        for w in writers.values():
            w.finish()
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    if state["dropped"]:
        log.warning("%s: dropped %d documents or pairs that tokenised to nothing", path, state["dropped"])
    meta = {
        "version": CACHE_VERSION,
        **before,
        "format": format,
        "n_tokens": state["tokens"],
        "n_sentences": state["sentences"],
        "n_documents": n_docs,
        "dtype": np.dtype(dtype).name,
    }
    atomic_write_bytes(paths["meta"], json.dumps(meta, indent=1).encode())


def _bytes_read(report: Callable[[int, int], None], total: int) -> Callable[[int], None]:
    """An `on_read` that tells `report` the bytes read so far of `total`; it hears (0, total) at once."""
    done = 0

    def on_read(n: int) -> None:
        nonlocal done
        done += n
        report(done, total)

    report(0, total)
    return on_read


def _chunks(documents: Iterator[list[str]], max_sentences: int) -> Iterator[list[list[str]]]:
    chunk, size = [], 0
    for doc in documents:
        chunk.append(doc)
        size += len(doc)
        if size >= max_sentences:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def _write_chunk(chunk: list[list[str]], tokenizer, writers: dict, state: dict, min_sentences: int) -> None:
    flat = [s for doc in chunk for s in doc]
    encoded = encode_sentences(tokenizer, flat) if flat else []
    tokens: list[int] = []
    sentence_ends: list[int] = []
    document_ends: list[int] = []
    pos = 0
    for doc in chunk:
        doc_ids, pos = encoded[pos : pos + len(doc)], pos + len(doc)
        kept = [s for s in doc_ids if s]
        # A pair must keep both sides; elsewhere an empty sentence (only control chars, say) is just skipped.
        if len(kept) < min_sentences or (min_sentences == 2 and len(kept) != len(doc_ids)):
            state["dropped"] += 1
            continue
        for s in kept:
            tokens.extend(s)
            state["tokens"] += len(s)
            sentence_ends.append(state["tokens"])
        state["sentences"] += len(kept)
        document_ends.append(state["sentences"])
    writers["tokens"].append(tokens)
    writers["sentences"].append(sentence_ends)
    writers["documents"].append(document_ends)
