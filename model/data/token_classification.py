"""Token-classification data (NER and the like): tagged sentences from CoNLL columns or JSONL, IOB2 checks,
a tag map, and WordPiece encoding with one label per word.

Two file formats:

    CoNLL (.conll, .iob, .iob2, .bio, .txt, .tsv)    JSONL (.jsonl, .ndjson)
    EU B-ORG                                         {"tokens": ["EU", "rejects"], "tags": ["B-ORG", "O"]}
    rejects O
                                                     one sentence per line
    -DOCSTART- lines are skipped; a blank line ends a sentence; the tag is the last column, the token
    the first, any columns between (CoNLL-2003's POS and chunk tags) are ignored; every token line of a
    file has the same number of columns (tab-separated when the line has a tab, else space-separated).

Either may be .gz/.bz2. Tags are IOB2 ("O", "B-X", "I-X"; an "I-X" follows "B-X" or "I-X"); IOB1 files,
where an entity may open with I-, have to be converted first. The tag map is sorted (as transformers'
run_ner builds it) unless a label list is given.

Labels are aligned as transformers' token-classification examples align them (`word_ids()`): the first
WordPiece of each word carries the word's tag id, the other pieces and [CLS]/[SEP] carry -100. A sentence
longer than `max_seq_len` is cut at word boundaries into consecutive parts; each encoded example records
its sentence, `part` and `parts`, and the index of its first word, so predictions can be stitched back.
A single word with more pieces than fit is cut to fit (its label sits on its first piece, which survives).

References: Tjong Kim Sang & De Meulder 2003 (CoNLL-2003); Ramshaw & Marcus 1995 (IOB);
huggingface/transformers examples/pytorch/token-classification/run_ner.py (tokenize_and_align_labels).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from datadir.files import iter_jsonl_objects
from model.data.batches import RowBatches, pad, padded_inputs
from model.data.finetune import _open_text, split_holdout
from model.data.pretraining import IGNORE_INDEX
from model.scores import tagging_scores
from model.tokenizer import SPECIAL_TOKENS_IN_ONE_TEXT, with_special_tokens

DOCSTART = "-DOCSTART-"
CONLL_SUFFIXES = (".conll", ".iob", ".iob2", ".bio", ".txt", ".tsv")
JSONL_SUFFIXES = (".jsonl", ".ndjson")
_TAG = re.compile(r"[BI]-\S+")  # fullmatch: `$` would let a final newline in


@dataclass
class TaggedSentence:
    """Words and their tags, with where they came from (for error messages)."""

    tokens: list[str]
    tags: list[str]
    path: str
    line: int  # the sentence's first line
    token_lines: list[int] | None = None  # CoNLL: the line of each token; JSONL: None (one line)

    def where(self, i: int) -> str:
        """Where token `i` is: "file, line N" (CoNLL) or "file, line N, tags[i]" (JSONL)."""
        if self.token_lines is not None:
            return f"{self.path}, line {self.token_lines[i]}"
        return f"{self.path}, line {self.line}, tags[{i}]"


@dataclass
class TokenClassificationExample:
    """One encoded part of a sentence: input_ids with [CLS]/[SEP], labels (-100 but on first pieces),
    word_ids (the index in the whole sentence of each token's word; None on [CLS]/[SEP])."""

    input_ids: list[int]
    labels: list[int]
    word_ids: list[int | None]
    sentence: int  # index of the sentence in the list that was encoded
    part: int  # 0-based part of that sentence
    parts: int  # how many parts the sentence was cut into
    first_word: int  # index in the sentence of this part's first word


@dataclass
class TokenClassificationData:
    """Train and eval sentences plus the tag map to store in the model config."""

    train: list[TaggedSentence]
    eval: list[TaggedSentence]
    id2label: dict[int, str]
    label2id: dict[str, int]

    @property
    def num_labels(self) -> int:
        return len(self.id2label)

    def config_updates(self) -> dict:
        """Fields to set on BertConfig before building BertForTokenClassification."""
        return {"id2label": dict(self.id2label), "label2id": dict(self.label2id)}


# ---------------------------------------------------------------------------- reading


def tagged_format(path: Path) -> str:
    name = path.name.lower()
    for ext in (".bz2", ".gz"):
        name = name.removesuffix(ext)
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(CONLL_SUFFIXES):
        return "conll"
    raise ValueError(
        f"cannot tell the format of {path}: expected CoNLL columns "
        f"({', '.join(CONLL_SUFFIXES)}) or JSONL ({', '.join(JSONL_SUFFIXES)})"
    )


def read_tagged(path: str | os.PathLike) -> list[TaggedSentence]:
    """Sentences of a CoNLL or JSONL file (optionally .gz/.bz2), tags checked as IOB2."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"data file not found: {path}")
    fmt = tagged_format(path)
    with _open_text(path) as f:
        sentences = list(_iter_conll(f, path) if fmt == "conll" else _iter_jsonl(f, path))
    if not sentences:
        raise ValueError(f"{path} has no sentences")
    for sentence in sentences:
        check_iob2(sentence)
    return sentences


def _iter_conll(lines, path: Path):
    tokens: list[str] = []
    tags: list[str] = []
    token_lines: list[int] = []
    columns: tuple[int, int] | None = None  # (count, line that set it)
    for lineno, raw in enumerate(lines, start=1):
        line = raw.rstrip()
        if not line:
            if tokens:
                yield TaggedSentence(tokens, tags, str(path), token_lines[0], token_lines)
            tokens, tags, token_lines = [], [], []
            continue
        cols = [c.strip() for c in (line.split("\t") if "\t" in line else re.split(" +", line))]
        if cols[0] == DOCSTART:
            continue
        if len(cols) < 2:
            raise ValueError(f"{path}, line {lineno}: 1 column, expected a token and a tag: {line!r}")
        columns = columns or (len(cols), lineno)
        if len(cols) != columns[0]:
            raise ValueError(
                f"{path}, line {lineno}: {len(cols)} columns, expected {columns[0]} as on line {columns[1]}: {line!r}"
            )
        if not cols[0]:
            raise ValueError(f"{path}, line {lineno}: empty token: {line!r}")
        tokens.append(cols[0])
        tags.append(cols[-1])
        token_lines.append(lineno)
    if tokens:
        yield TaggedSentence(tokens, tags, str(path), token_lines[0], token_lines)


def _iter_jsonl(lines, path: Path):
    for lineno, record in iter_jsonl_objects(lines, path):
        tokens, tags = (_string_list(path, lineno, record, key) for key in ("tokens", "tags"))
        if not tokens:
            raise ValueError(f"{path}, line {lineno}: 'tokens' is empty")
        if len(tokens) != len(tags):
            raise ValueError(f"{path}, line {lineno}: {len(tokens)} tokens but {len(tags)} tags")
        for i, token in enumerate(tokens):
            if not token.strip():
                raise ValueError(f"{path}, line {lineno}: empty token: tokens[{i}] is {token!r}")
        yield TaggedSentence(tokens, tags, str(path), lineno)


def _string_list(path: Path, lineno: int, record: dict, key: str) -> list[str]:
    value = record.get(key)
    if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
        raise ValueError(f"{path}, line {lineno}: {key!r} must be a list of strings, got {value!r}")
    return value


def check_iob2(sentence: TaggedSentence) -> None:
    """Every tag is O, B-X or I-X, and every I-X follows B-X or I-X."""
    previous = "O"
    for i, tag in enumerate(sentence.tags):
        if tag != "O" and not _TAG.fullmatch(tag):
            raise ValueError(f"{sentence.where(i)}: tag {tag!r} is not O, B-<type> or I-<type>")
        if tag.startswith("I-") and previous[2:] != tag[2:]:
            raise ValueError(
                f"{sentence.where(i)}: tag {tag!r} follows {previous!r}, not B-{tag[2:]} or "
                f"I-{tag[2:]} (IOB2: an entity opens with B-; convert IOB1 files first)"
            )
        previous = tag


# ---------------------------------------------------------------------------- tag map and loading


def build_tag_map(
    sentences: list[TaggedSentence], labels: list[str] | None = None
) -> tuple[dict[int, str], dict[str, int]]:
    """id2label, label2id: `labels` in the order given, else the distinct tags sorted. Every tag in
    `sentences` must be in the map."""
    if labels is None:
        labels = sorted({tag for s in sentences for tag in s.tags})
    else:
        labels = [str(x) for x in labels]
        duplicates = sorted({x for x in labels if labels.count(x) > 1})
        if duplicates:
            raise ValueError(f"labels {duplicates} are given more than once")
        bad = [x for x in labels if x != "O" and not _TAG.fullmatch(x)]
        if bad:
            raise ValueError(f"labels {bad} are not O, B-<type> or I-<type>")
    label2id = {label: i for i, label in enumerate(labels)}
    check_tags_known(sentences, label2id)
    return dict(enumerate(labels)), label2id


def check_tags_known(sentences: list[TaggedSentence], label2id: dict[str, int]) -> None:
    for sentence in sentences:
        for i, tag in enumerate(sentence.tags):
            if tag not in label2id:
                raise ValueError(f"{sentence.where(i)}: unknown tag {tag!r} (known tags: {sorted(label2id)})")


def load_token_classification_data(
    train_path: str | os.PathLike,
    eval_path: str | os.PathLike | None = None,
    *,
    labels: list[str] | None = None,
    eval_fraction: float = 0.1,
    seed: int = 0,
) -> TokenClassificationData:
    """Read tagged sentences; without `eval_path`, hold out `eval_fraction` of the train sentences.
    The tag map comes from the train file (or `labels`); an eval tag outside it is an error."""
    train = read_tagged(train_path)
    id2label, label2id = build_tag_map(train, labels)
    if eval_path is not None:
        evals = read_tagged(eval_path)
        check_tags_known(evals, label2id)
    else:
        train_idx, eval_idx = split_holdout(len(train), eval_fraction, seed)
        train, evals = [train[i] for i in train_idx], [train[i] for i in eval_idx]
    return TokenClassificationData(train, evals, id2label, label2id)


# ---------------------------------------------------------------------------- encoding


def encode_tagged(
    sentences: list[TaggedSentence], tokenizer, label2id: dict[str, int], max_seq_len: int = 128
) -> list[TokenClassificationExample]:
    """Encode with `tokenizer` (our BertTokenizer), one example per part of each sentence."""
    if not isinstance(max_seq_len, int) or max_seq_len < SPECIAL_TOKENS_IN_ONE_TEXT + 1:
        raise ValueError(
            f"max_seq_len must be an int >= {SPECIAL_TOKENS_IN_ONE_TEXT + 1} ([CLS], a token, [SEP]), got {max_seq_len!r}"
        )
    check_tags_known(sentences, label2id)
    backend = tokenizer.backend_tokenizer
    encodings = backend.encode_batch([s.tokens for s in sentences], is_pretokenized=True, add_special_tokens=False)
    examples = []
    for index, (sentence, enc) in enumerate(zip(sentences, encodings)):
        labels = [label2id[tag] for tag in sentence.tags]
        examples.extend(
            _sentence_parts(index, enc.ids, enc.word_ids, labels, tokenizer, max_seq_len - SPECIAL_TOKENS_IN_ONE_TEXT)
        )
    return examples


def _sentence_parts(
    index: int, ids: list[int], word_ids: list[int], labels: list[int], tokenizer, budget: int
) -> list[TokenClassificationExample]:
    """A sentence's pieces cut at word boundaries into parts of at most `budget` pieces, then framed."""
    spans = _word_spans(word_ids, len(labels))  # (first piece, end piece) per word
    cuts, start, used = [], 0, 0  # cuts: (first word, end word)
    for w, (a, b) in enumerate(spans):
        if used and used + (b - a) > budget:
            cuts.append((start, w))
            start, used = w, 0
        used += b - a
    cuts.append((start, len(spans)))
    parts = []
    for part, (w0, w1) in enumerate(cuts):
        lo, hi = spans[w0][0], spans[w1 - 1][1]
        hi = min(hi, lo + budget)  # a single word longer than the budget is cut (its first piece stays)
        piece_words = word_ids[lo:hi]
        part_labels = [
            labels[w] if j == lo or word_ids[j - 1] != w else IGNORE_INDEX for j, w in enumerate(piece_words, start=lo)
        ]
        parts.append(
            TokenClassificationExample(
                input_ids=with_special_tokens(ids[lo:hi], None, tokenizer.cls_token_id, tokenizer.sep_token_id)[0],
                labels=[IGNORE_INDEX, *part_labels, IGNORE_INDEX],
                word_ids=[None, *piece_words, None],
                sentence=index,
                part=part,
                parts=len(cuts),
                first_word=w0,
            )
        )
    return parts


def _word_spans(word_ids: list[int], n_words: int) -> list[tuple[int, int]]:
    """(first piece, end piece) of each word; a word that yields no pieces gets an empty span."""
    first: list[int | None] = [None] * n_words
    end = [0] * n_words  # read only where `first` is set
    for j, w in enumerate(word_ids):
        first[w] = j if first[w] is None else first[w]
        end[w] = j + 1
    spans, at = [], 0
    for w, start in enumerate(first):
        if start is None:
            spans.append((at, at))
        else:
            spans.append((start, end[w]))
            at = end[w]
    return spans


# ---------------------------------------------------------------------------- batches


class TokenClassificationBatches(RowBatches):
    """Encoded parts of tagged sentences (encode_tagged) as batches: input_ids, token_type_ids,
    attention_mask and labels (B, T), labels padded with -100.

    As evaluation data (shuffle=False) it scores a model's predicted tag ids per row (`score`):
    a sentence's parts are joined again, so an entity across a cut is one entity.
    """

    def __init__(
        self,
        sentences: list[TaggedSentence],
        tokenizer,
        label2id: dict[str, int],
        *,
        batch_size: int = 32,
        max_seq_len: int = 128,
        seed: int = 0,
        shuffle: bool = True,
    ):
        super().__init__(encode_tagged(sentences, tokenizer, label2id, max_seq_len), batch_size, seed, shuffle)
        self.pad_id = tokenizer.pad_token_id
        self.id2label = {i: label for label, i in label2id.items()}

    def collate(self, rows: list[TokenClassificationExample]) -> dict[str, torch.Tensor]:
        batch = padded_inputs([r.input_ids for r in rows], None, self.pad_id)
        batch["labels"] = pad([r.labels for r in rows], IGNORE_INDEX)
        return batch

    def score(self, predicted: list[list[int]]) -> dict[str, float]:
        """precision, recall, f1 (entities) and accuracy (words) of the predicted tag ids of the first
        len(predicted) rows, in order (a sentence only when all its parts are among them)."""
        gold: dict[int, list[str]] = {}
        pred: dict[int, list[str]] = {}
        sentence = []
        for row, ids in zip(self.rows, predicted):
            if row.part == 0:
                gold[row.sentence], pred[row.sentence] = [], []
            labelled = [t for t, label in enumerate(row.labels) if label != IGNORE_INDEX]
            gold[row.sentence] += [self.id2label[row.labels[t]] for t in labelled]
            pred[row.sentence] += [self.id2label[ids[t]] for t in labelled]
            if row.part == row.parts - 1:
                sentence.append(row.sentence)
        return tagging_scores([gold[s] for s in sentence], [pred[s] for s in sentence])
