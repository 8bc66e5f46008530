"""BERT WordPiece tokenizer: a thin, typed wrapper over the Rust `tokenizers` library.

The pipeline is the original BERT one, built the way transformers' `BertTokenizer`
(tokenizers backend) builds it, so ids match that tokenizer token for token:

    BertNormalizer (clean text, split CJK chars, lowercase + strip accents per model)
    -> BertPreTokenizer -> WordPiece ("##" continuation prefix)
    -> TemplateProcessing "[CLS] $A [SEP]" / "[CLS] $A [SEP] $B:1 [SEP]:1"
    -> WordPiece decoder

A model directory holds `tokenizer.json` (preferred) and/or `vocab.txt`, plus
`tokenizer_config.json` (do_lower_case, model_max_length, special tokens), in the layout
transformers writes and reads.

References: Devlin et al. 2018 (BERT) section 3; huggingface/tokenizers
`bindings/python/py_src/tokenizers/implementations/bert_wordpiece.py`;
huggingface/transformers `models/bert/tokenization_bert.py`.
"""

from __future__ import annotations

import json
import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import overload

import torch
from tokenizers import (
    AddedToken,
    Encoding,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

from datadir.files import atomic_write_bytes

VOCAB_FILE = "vocab.txt"
TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"

# Role -> default token. Order is the order new vocabularies get them (ids 0..4) and the
# order of the tokenizer_config.json keys transformers reads ("pad_token", ...).
DEFAULT_SPECIAL_TOKENS = {"pad": "[PAD]", "unk": "[UNK]", "cls": "[CLS]", "sep": "[SEP]", "mask": "[MASK]"}

# BERT's input layout (Devlin et al. 2018, section 3): each piece and its token type. One text is
# "[CLS] a [SEP]"; a pair adds "b [SEP]", of type 1. The Rust post-processor's templates
# (`_assemble_pipeline`) and `with_special_tokens` (for texts tokenized already) are both built from it.
ONE_TEXT = (("cls", 0), ("a", 0), ("sep", 0))
A_PAIR = (*ONE_TEXT, ("b", 1), ("sep", 1))
_TEXTS = ("a", "b")
SPECIAL_TOKENS_IN_ONE_TEXT = sum(piece not in _TEXTS for piece, _ in ONE_TEXT)  # 2
SPECIAL_TOKENS_IN_A_PAIR = sum(piece not in _TEXTS for piece, _ in A_PAIR)  # 3

# BERT's position table; also what transformers falls back to for BERT checkpoints.
DEFAULT_MODEL_MAX_LENGTH = 512
# transformers writes int(1e30) as model_max_length when it does not know the limit.
_UNKNOWN_MAX_LENGTH = 10**9


class BertTokenizer:
    """BERT WordPiece tokenizer. Build it with `from_pretrained`, `from_vocab` or `train`."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        lowercase: bool = True,
        strip_accents: bool | None = None,
        tokenize_chinese_chars: bool = True,
        model_max_length: int = DEFAULT_MODEL_MAX_LENGTH,
        special_tokens: dict[str, str] | None = None,
    ):
        if not isinstance(tokenizer.model, models.WordPiece):
            raise ValueError(f"expected a WordPiece model, got {type(tokenizer.model).__name__}")
        if not isinstance(model_max_length, int) or model_max_length < 2:
            raise ValueError(f"model_max_length must be an int >= 2, got {model_max_length!r}")
        self.lowercase = bool(lowercase)
        # None means "follow lowercase", as in the original BERT.
        self.strip_accents = strip_accents
        self.tokenize_chinese_chars = bool(tokenize_chinese_chars)
        self.model_max_length = model_max_length
        self.special_tokens = {**DEFAULT_SPECIAL_TOKENS, **(special_tokens or {})}
        self._ids = {role: _required_id(tokenizer, tok) for role, tok in self.special_tokens.items()}
        self._tok = tokenizer
        self._assemble_pipeline()
        # One truncating copy per max_length: the Rust tokenizer's truncation is mutable state,
        # and flipping it per call would race between threads that share this object.
        self._truncating: dict[int, Tokenizer] = {}
        self._lock = threading.Lock()

    def _assemble_pipeline(self) -> None:
        tok, cls, sep = self._tok, self.special_tokens["cls"], self.special_tokens["sep"]
        tok.normalizer = normalizers.BertNormalizer(
            clean_text=True,
            handle_chinese_chars=self.tokenize_chinese_chars,
            strip_accents=self.strip_accents,
            lowercase=self.lowercase,
        )
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.post_processor = processors.TemplateProcessing(
            single=self._template(ONE_TEXT),
            pair=self._template(A_PAIR),
            special_tokens=[(cls, self._ids["cls"]), (sep, self._ids["sep"])],
        )
        tok.decoder = decoders.WordPiece(prefix="##")
        # Added (not normalized) so "[MASK]" typed in a text is the mask token, not "[", "mask", "]".
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in self.special_tokens.values()])
        # tokenizer.json files often carry a fixed padding/truncation (MiniLM's: 128); we decide per call.
        tok.no_padding()
        tok.no_truncation()

    def _template(self, layout: tuple[tuple[str, int], ...]) -> str:
        """A layout as TemplateProcessing writes it: "[CLS]:0 $A:0 [SEP]:0 $B:1 [SEP]:1"."""
        return " ".join(f"${p.upper()}:{t}" if p in _TEXTS else f"{self.special_tokens[p]}:{t}" for p, t in layout)

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> BertTokenizer:
        """Load from a model directory: tokenizer.json if present, else vocab.txt."""
        path = Path(path)
        if not path.is_dir():
            raise FileNotFoundError(f"tokenizer directory not found: {path}")
        config = _read_config(path / CONFIG_FILE)
        if (path / TOKENIZER_FILE).is_file():
            tokenizer = Tokenizer.from_file(str(path / TOKENIZER_FILE))
            normalizer = json.loads(tokenizer.to_str()).get("normalizer") or {}
        elif (path / VOCAB_FILE).is_file():
            special_unk = _special_tokens_from_config(config).get("unk", DEFAULT_SPECIAL_TOKENS["unk"])
            tokenizer = Tokenizer(models.WordPiece(_read_vocab_file(path / VOCAB_FILE), unk_token=special_unk))
            normalizer = {}
        else:
            raise FileNotFoundError(f"no {TOKENIZER_FILE} or {VOCAB_FILE} in {path}")
        # tokenizer_config.json wins (as in transformers); then tokenizer.json's normalizer; then BERT defaults.
        if normalizer.get("type") != "BertNormalizer":
            normalizer = {}
        return cls(
            tokenizer,
            lowercase=config.get("do_lower_case", normalizer.get("lowercase", True)),
            strip_accents=config.get("strip_accents", normalizer.get("strip_accents")),
            tokenize_chinese_chars=config.get("tokenize_chinese_chars", normalizer.get("handle_chinese_chars", True)),
            model_max_length=_model_max_length(config),
            special_tokens=_special_tokens_from_config(config),
        )

    @classmethod
    def from_vocab(
        cls,
        vocab: str | os.PathLike | Sequence[str],
        lowercase: bool = True,
        *,
        strip_accents: bool | None = None,
        model_max_length: int = DEFAULT_MODEL_MAX_LENGTH,
    ) -> BertTokenizer:
        """Build from a vocab.txt path or a list of tokens (a token's id is its index)."""
        if isinstance(vocab, (str, os.PathLike)):
            token_to_id = _read_vocab_file(Path(vocab))
        else:
            token_to_id = _vocab_from_list(list(vocab))
        tokenizer = Tokenizer(models.WordPiece(token_to_id, unk_token=DEFAULT_SPECIAL_TOKENS["unk"]))
        return cls(tokenizer, lowercase=lowercase, strip_accents=strip_accents, model_max_length=model_max_length)

    @classmethod
    def train(
        cls,
        files: Iterable[str | os.PathLike],
        vocab_size: int = 30522,
        lowercase: bool = True,
        min_frequency: int = 2,
        *,
        model_max_length: int = DEFAULT_MODEL_MAX_LENGTH,
    ) -> BertTokenizer:
        """Learn a WordPiece vocabulary from UTF-8 text files; [PAD] [UNK] [CLS] [SEP] [MASK] get ids 0..4."""
        names = [str(f) for f in files]
        if not names:
            raise ValueError("train needs at least one text file, got none")
        missing = [f for f in names if not Path(f).is_file()]
        if missing:
            raise FileNotFoundError(f"training files not found: {missing}")
        specials = list(DEFAULT_SPECIAL_TOKENS.values())
        if vocab_size <= len(specials):
            raise ValueError(f"vocab_size must be > {len(specials)} (the special tokens), got {vocab_size}")
        tokenizer = Tokenizer(models.WordPiece(unk_token=DEFAULT_SPECIAL_TOKENS["unk"]))
        tokenizer.normalizer = normalizers.BertNormalizer(lowercase=lowercase)
        tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        # limit_alphabet=1000 as in tokenizers' BertWordPieceTokenizer: rare characters become [UNK]
        # instead of each costing a vocabulary slot.
        trainer = trainers.WordPieceTrainer(
            vocab_size=vocab_size,
            min_frequency=min_frequency,
            special_tokens=specials,
            limit_alphabet=1000,
            continuing_subword_prefix="##",
            show_progress=False,
        )
        tokenizer.train(names, trainer)
        return cls(tokenizer, lowercase=lowercase, model_max_length=model_max_length)

    # ------------------------------------------------------------------ saving

    def save_pretrained(self, path: str | os.PathLike) -> None:
        """Write vocab.txt, tokenizer.json and tokenizer_config.json into the existing directory `path`.

        Each file is written to a temp name and renamed, so a reader never sees half a file;
        the directory as a whole is not atomic (use datadir.files.atomic_dir around it for that).
        """
        path = Path(path)
        if not path.is_dir():
            raise FileNotFoundError(f"directory not found: {path}")
        vocab = self._vocab_in_id_order()
        _write_text(path / VOCAB_FILE, "".join(token + "\n" for token in vocab))
        _write_text(path / TOKENIZER_FILE, self._tok.to_str(pretty=True))
        _write_text(path / CONFIG_FILE, json.dumps(self._config_dict(), indent=2) + "\n")

    def _vocab_in_id_order(self) -> list[str]:
        by_id = {i: t for t, i in self._tok.get_vocab(with_added_tokens=True).items()}
        if sorted(by_id) != list(range(len(by_id))):
            raise ValueError(f"vocabulary ids are not contiguous 0..{len(by_id) - 1}; cannot write {VOCAB_FILE}")
        return [by_id[i] for i in range(len(by_id))]

    def _config_dict(self) -> dict:
        return {
            "tokenizer_class": "BertTokenizer",
            "do_lower_case": self.lowercase,
            "strip_accents": self.strip_accents,
            "tokenize_chinese_chars": self.tokenize_chinese_chars,
            "model_max_length": self.model_max_length,
            **{f"{role}_token": tok for role, tok in self.special_tokens.items()},
            "clean_up_tokenization_spaces": True,
        }

    # ------------------------------------------------------------------ vocabulary

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    def get_vocab(self) -> dict[str, int]:
        return self._tok.get_vocab(with_added_tokens=True)

    pad_token_id = property(lambda self: self._ids["pad"])
    unk_token_id = property(lambda self: self._ids["unk"])
    cls_token_id = property(lambda self: self._ids["cls"])
    sep_token_id = property(lambda self: self._ids["sep"])
    mask_token_id = property(lambda self: self._ids["mask"])
    pad_token = property(lambda self: self.special_tokens["pad"])
    unk_token = property(lambda self: self.special_tokens["unk"])
    cls_token = property(lambda self: self.special_tokens["cls"])
    sep_token = property(lambda self: self.special_tokens["sep"])
    mask_token = property(lambda self: self.special_tokens["mask"])

    @property
    def all_special_ids(self) -> list[int]:
        return [self._ids[role] for role in ("unk", "sep", "pad", "cls", "mask")]  # transformers' order

    @property
    def backend_tokenizer(self) -> Tokenizer:
        """The Rust `tokenizers.Tokenizer` underneath (transformers' name for it), for what this wrapper
        does not expose: offsets, special-token masks, other truncation. Read it; do not reconfigure it."""
        return self._tok

    def tokenize(self, text: str) -> list[str]:
        """WordPiece tokens of `text`, without [CLS]/[SEP]."""
        return encode_one(self._tok, _check_text(text, "text"), add_special_tokens=False).tokens

    @overload  # (a str is also a Sequence[str]; this overload, the first, is the one it matches)
    def convert_tokens_to_ids(self, tokens: str) -> int: ...  # type: ignore[overload-overlap]
    @overload
    def convert_tokens_to_ids(self, tokens: Sequence[str]) -> list[int]: ...
    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> int | list[int]:
        """Unknown tokens map to the [UNK] id."""
        if isinstance(tokens, str):
            found = self._tok.token_to_id(tokens)
            return self.unk_token_id if found is None else found
        return [self.convert_tokens_to_ids(t) for t in tokens]

    @overload
    def convert_ids_to_tokens(self, ids: int) -> str: ...
    @overload
    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]: ...
    @overload
    def convert_ids_to_tokens(self, ids: torch.Tensor) -> str | list[str]: ...  # a 0-d tensor: one token
    def convert_ids_to_tokens(self, ids: int | Sequence[int] | torch.Tensor) -> str | list[str]:
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        if isinstance(ids, int):
            token = self._tok.id_to_token(ids)
            if token is None:
                raise ValueError(f"token id {ids} is outside the vocabulary (size {self.vocab_size})")
            return token
        return [self.convert_ids_to_tokens(int(i)) for i in ids]

    def decode(self, ids: Sequence[int] | torch.Tensor, skip_special_tokens: bool = True) -> str:
        """Text for `ids`: "##" pieces joined, spaces before punctuation cleaned up."""
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_filled(
        self, ids: Sequence[int], position: int, candidates: Sequence[int], skip_special_tokens: bool = True
    ) -> list[str]:
        """`decode(ids with ids[position] = c)` for each candidate c, decoding the rest of `ids` once.

        WordPiece's decoder turns each token into a piece of its own: "##" dropped from a continuation,
        a space before any other token but the first, then that piece's space before punctuation
        cleaned up (tokenizers' decoders::wordpiece works token by token). So a filled sequence is
        the text before `position`, the candidate's piece and the text after it. A special candidate
        that skip_special_tokens drops shifts which token is first: that one is decoded whole.
        """
        ids = list(ids)
        skipped = set(self.all_special_ids) if skip_special_tokens else set()
        head = self.decode(ids[:position], skip_special_tokens)
        first = all(t in skipped for t in ids[:position])  # the candidate opens the text
        tail = [self._tok.id_to_token(t) for t in ids[position + 1 :] if t not in skipped]
        after = self._tok.decoder.decode(["x"] + tail)[1:]  # pieces as they are after a first token
        out = []
        for c in candidates:
            if c in skipped:
                out.append(self.decode(ids[:position] + [c] + ids[position + 1 :], skip_special_tokens))
                continue
            token = self.convert_ids_to_tokens(c)
            piece = self._tok.decoder.decode([token]) if first else self._tok.decoder.decode(["x", token])[1:]
            out.append(head + piece + after)
        return out

    # ------------------------------------------------------------------ encoding

    def encode(
        self, text: str, text_pair: str | None = None, max_length: int | None = None, truncation: bool = False
    ) -> dict[str, list[int]]:
        """One text (or pair) -> dict of input_ids, token_type_ids, attention_mask (lists, unpadded)."""
        max_length = self._resolve_max_length(max_length, pair=text_pair is not None)
        pair = None if text_pair is None else _check_text(text_pair, "text_pair")
        tokenizer = self._tokenizer_for(max_length, truncation)
        enc = encode_one(tokenizer, _check_text(text, "text"), pair)
        if not truncation:
            _check_length(enc, max_length, where="input")
        return {"input_ids": enc.ids, "token_type_ids": enc.type_ids, "attention_mask": enc.attention_mask}

    def token_ids(self, text: str) -> list[int]:
        """WordPiece ids of `text`, without [CLS]/[SEP] and untruncated: one side of `pair_from_ids`."""
        return encode_one(self._tok, _check_text(text, "text"), add_special_tokens=False).ids

    def pair_from_ids(
        self, a: Sequence[int], b: Sequence[int], max_length: int | None = None, direction: str = "right"
    ) -> dict[str, list[int]]:
        """`encode(text, text_pair)` from the two texts' `token_ids`: [CLS] a [SEP] b [SEP] and its token types,
        cut to `max_length` (None: uncut) as the tokenizer's longest_first truncation cuts a pair, from the
        end ("right") or the start ("left") of each text. A text paired with many others (a re-ranker's
        query) is then tokenized once, not once per pair."""
        if max_length is not None:
            keep_a, keep_b = longest_first(len(a), len(b), max_length - SPECIAL_TOKENS_IN_A_PAIR)
            a, b = _kept(a, keep_a, direction), _kept(b, keep_b, direction)
        ids, types = with_special_tokens(a, b, self.cls_token_id, self.sep_token_id)
        return {"input_ids": ids, "token_type_ids": types}

    def __call__(
        self,
        texts: str | Sequence[str],
        text_pairs: str | Sequence[str] | None = None,
        max_length: int | None = None,
        truncation: bool = False,
        padding: bool = True,
        return_tensors: str | None = "pt",
    ) -> dict:
        """Batch encode (in parallel, in Rust); padded to the longest in the batch with [PAD] and mask 0.

        Returns LongTensors (B, T) with return_tensors="pt", else lists of lists.
        """
        if return_tensors not in ("pt", None):
            raise ValueError(f"return_tensors must be 'pt' or None, got {return_tensors!r}")
        inputs = self._batch_inputs(texts, text_pairs)
        max_length = self._resolve_max_length(max_length, pair=text_pairs is not None)
        tokenizer = self._tokenizer_for(max_length, truncation)
        # encode_batch_fast (tokenizers >= 0.20) skips the offsets we never use.
        encodings = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)(inputs)
        if not truncation:
            for i, enc in enumerate(encodings):
                _check_length(enc, max_length, where=f"text {i}")
        if padding:
            longest = max(len(enc.ids) for enc in encodings)
            for enc in encodings:
                enc.pad(longest, pad_id=self.pad_token_id, pad_type_id=0, pad_token=self.pad_token)
        out = {
            "input_ids": [enc.ids for enc in encodings],
            "token_type_ids": [enc.type_ids for enc in encodings],
            "attention_mask": [enc.attention_mask for enc in encodings],
        }
        if return_tensors is None:
            return out
        if len({len(row) for row in out["input_ids"]}) > 1:
            raise ValueError("texts have different lengths; use padding=True or return_tensors=None")
        return {k: torch.tensor(v, dtype=torch.long) for k, v in out.items()}

    def _batch_inputs(self, texts, text_pairs) -> list:
        texts = [texts] if isinstance(texts, str) else list(texts)
        if not texts:
            raise ValueError("texts is empty; need at least one text")
        texts = [_check_text(t, f"texts[{i}]") for i, t in enumerate(texts)]
        if text_pairs is None:
            return texts
        text_pairs = [text_pairs] if isinstance(text_pairs, str) else list(text_pairs)
        if len(text_pairs) != len(texts):
            raise ValueError(f"got {len(texts)} texts but {len(text_pairs)} text_pairs; they must match")
        return [(a, _check_text(b, f"text_pairs[{i}]")) for i, (a, b) in enumerate(zip(texts, text_pairs))]

    def _resolve_max_length(self, max_length: int | None, pair: bool) -> int:
        if max_length is None:
            return self.model_max_length
        # Room for the special tokens and one token of each text; below that the Rust
        # truncation silently returns the input untruncated.
        least = SPECIAL_TOKENS_IN_A_PAIR + 2 if pair else SPECIAL_TOKENS_IN_ONE_TEXT + 1
        if not isinstance(max_length, int) or max_length < least:
            raise ValueError(f"max_length must be an int >= {least}, got {max_length!r}")
        return max_length

    def _tokenizer_for(self, max_length: int, truncation: bool) -> Tokenizer:
        if not truncation:
            return self._tok
        with self._lock:
            if max_length not in self._truncating:
                copy = Tokenizer.from_str(self._tok.to_str())
                copy.enable_truncation(max_length, strategy="longest_first")  # as transformers' default
                self._truncating[max_length] = copy
            return self._truncating[max_length]


def train_vocab(
    files: Iterable[str | os.PathLike],
    out_dir: str | os.PathLike,
    vocab_size: int,
    lowercase: bool = True,
    min_frequency: int = 2,
) -> BertTokenizer:
    """Train a WordPiece vocabulary on `files` and save it to `out_dir` (created if missing)."""
    tokenizer = BertTokenizer.train(files, vocab_size=vocab_size, lowercase=lowercase, min_frequency=min_frequency)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out_dir)
    return tokenizer


# ---------------------------------------------------------------------- file helpers


def _read_vocab_file(path: Path) -> dict[str, int]:
    if not path.is_file():
        raise FileNotFoundError(f"vocabulary file not found: {path}")
    with open(path, encoding="utf-8") as f:
        return _vocab_from_list([line.rstrip("\r\n") for line in f])


def _vocab_from_list(tokens: list[str]) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        if not isinstance(token, str) or not token:
            raise ValueError(f"vocabulary entry {i} must be a non-empty string, got {token!r}")
        if token in vocab:
            raise ValueError(f"vocabulary token {token!r} appears twice (ids {vocab[token]} and {i})")
        vocab[token] = i
    return vocab


def _read_config(path: Path) -> dict:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _model_max_length(config: dict) -> int:
    value = config.get("model_max_length", DEFAULT_MODEL_MAX_LENGTH)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, int) and value >= _UNKNOWN_MAX_LENGTH:
        return DEFAULT_MODEL_MAX_LENGTH
    return value


def _special_tokens_from_config(config: dict) -> dict[str, str]:
    """transformers writes special tokens as strings, or as AddedToken dicts with a "content" key."""
    found = {}
    for role in DEFAULT_SPECIAL_TOKENS:
        value = config.get(f"{role}_token")
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            found[role] = value
    return found


def _write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def _required_id(tokenizer: Tokenizer, token: str) -> int:
    token_id = tokenizer.token_to_id(token)
    if token_id is None:
        raise ValueError(f"special token {token!r} is not in the vocabulary")
    return token_id


def _check_text(text, name: str) -> str:
    if not isinstance(text, str):
        raise ValueError(f"{name} must be a str, got {type(text).__name__}")
    if not text.isascii() and (at := lone_surrogate_at(text)) is not None:
        # The Rust tokenizer takes UTF-8, which cannot hold a lone surrogate (a JSON "\ud800").
        raise ValueError(f"{name} is not valid Unicode: lone surrogate {text[at]!r} at character {at}")
    return text


def encode_one(tokenizer: Tokenizer, text: str, pair: str | None = None, add_special_tokens: bool = True) -> Encoding:
    """`tokenizer.encode(text, pair)`, with the interpreter lock let go while Rust works: tokenizers'
    `encode` keeps it for the whole call (half a second on a 480 KB text, every other thread and the
    server's event loop stalled meanwhile), `encode_batch` lets it go. The same Encoding, overflowing
    windows included; a microsecond more per call."""
    return tokenizer.encode_batch([text if pair is None else (text, pair)], add_special_tokens=add_special_tokens)[0]


def with_special_tokens(
    a: Sequence[int], b: Sequence[int] | None, cls_id: int, sep_id: int
) -> tuple[list[int], list[int]]:
    """(input_ids, token_type_ids) of one text's ids (`b` None) or a pair's, laid out as the tokenizer
    lays out a text it encodes (ONE_TEXT, A_PAIR): "[CLS] a [SEP]" or "[CLS] a [SEP] b [SEP]"."""
    special, texts = {"cls": cls_id, "sep": sep_id}, {"a": a, "b": () if b is None else b}
    ids: list[int] = []
    types: list[int] = []
    for piece, token_type in ONE_TEXT if b is None else A_PAIR:
        part = texts[piece] if piece in texts else (special[piece],)
        ids += part
        types += [token_type] * len(part)
    return ids, types


# -- tokenizers that truncate, and the windows they cut ---------------------------------------------
# The QA and token-classification routes (app/) and SQuAD training windows (model/data) cut the same way.

COPIES_PER_TOKENIZER = 8  # the options come from requests (stride, max_seq_len): keep the recent few
_copies: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # BertTokenizer -> {options: copy}, LRU
_copies_lock = threading.Lock()


def truncating(
    tok: BertTokenizer, max_length: int, stride: int = 0, strategy: str = "longest_first", direction: str = "right"
) -> Tokenizer:
    """A copy of the tokenizer that truncates so (the Rust tokenizer's truncation is mutable state
    shared by threads: never set it on the shared one). The last few are kept for reuse."""
    with _copies_lock:
        copies = _copies.setdefault(tok, OrderedDict())
        key = (max_length, stride, strategy, direction)
        if key in copies:
            copies.move_to_end(key)
        else:
            copy = Tokenizer.from_str(tok.backend_tokenizer.to_str())
            copy.enable_truncation(max_length, stride=stride, strategy=strategy, direction=direction)
            copies[key] = copy
            if len(copies) > COPIES_PER_TOKENIZER:
                copies.popitem(last=False)
        return copies[key]


def longest_first(n1: int, n2: int, room: int) -> tuple[int, int]:
    """How many tokens of a pair's two texts (n1, n2 long) the tokenizer's longest_first truncation keeps
    when `room` tokens are left besides the special ones: the shorter text whole if the longer can take
    the rest, else half the room each (the odd token to the longer; to the second when equal). Mirrors
    huggingface/tokenizers `truncate_encodings` (tokenizers/src/utils/truncation.rs)."""
    if n1 + n2 <= room:
        return n1, n2
    short, long = sorted((n1, n2))
    long = short if short > room else max(short, room - short)
    if short + long > room:
        short, long = room // 2, room // 2 + room % 2
    return (long, short) if n1 > n2 else (short, long)


def _kept(ids: Sequence[int], n: int, direction: str) -> list[int]:
    """The `n` tokens truncation keeps: the first ("right": the end is cut) or the last ("left")."""
    if direction not in ("right", "left"):
        raise ValueError(f"direction must be 'right' or 'left', got {direction!r}")
    return list(ids[:n]) if direction == "right" else list(ids[len(ids) - n :])


def window_count(n: int, room: int, stride: int) -> int:
    """How many windows the tokenizer cuts `n` tokens into when a window holds `room` of them and
    each next one repeats the last `stride` of the one before."""
    return 1 if n <= room else 1 + -(-(n - room) // (room - stride))


def lone_surrogate_at(text: str) -> int | None:
    """The index of the first lone UTF-16 surrogate (U+D800..U+DFFF) in `text`, or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return e.start
    return None


def _check_length(enc: Encoding, max_length: int, where: str) -> None:
    if len(enc.ids) > max_length:
        raise ValueError(
            f"{where} is {len(enc.ids)} tokens long, more than max_length {max_length}; "
            "pass truncation=True or shorten it"
        )
