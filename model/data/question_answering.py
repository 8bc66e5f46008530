"""Extractive question answering data: SQuAD v1.1 / v2.0 JSON, checked, and cut into training windows.

    {"version": "v2.0", "data": [{"title": ..., "paragraphs": [{"context": "...", "qas": [
        {"id": "q1", "question": "...", "answers": [{"text": "...", "answer_start": 12}],
         "is_impossible": false}]}]}]}

The file may be .gz/.bz2. Checks (each a ValueError naming the file and the question id): ids unique,
question and context not empty, every answer's text found in the context at its answer_start, an
answerable question has an answer and an impossible one (v2.0 `is_impossible`) has none.

Encoding follows transformers' run_qa.py `prepare_train_features`, with the old SQuAD scripts' limit
on the question: "[CLS] question [SEP] context [SEP]", the question (leading spaces dropped, as
run_qa does) cut to `max_query_length` tokens, the context cut by the fast tokenizer ("only_second",
overflowing tokens) into windows of `max_seq_len` that share `doc_stride` tokens. Each window's
start/end positions are the tokens holding the first answer's first and last characters, or 0/0
([CLS]) when the answer is not wholly inside the window or the question is impossible. One mend to
run_qa's search: it stops at the window's last context token (run_qa's runs on past [SEP], whose
offsets are (0, 0), when the answer starts on that token). Each window keeps its example's index and
the character offsets of its context tokens (None elsewhere) for evaluation (model/qa_spans.py).

References: Rajpurkar et al. 2016 (SQuAD), 2018 (SQuAD 2.0); Devlin et al. 2018 section 4.2-4.3;
huggingface/transformers examples/pytorch/question-answering/run_qa.py.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import torch

from model.data.batches import RowBatches, padded_inputs
from model.data.finetune import _open_text, split_holdout
from model.qa_spans import MAX_ANSWER_LEN, best_answer
from model.scores import squad_scores
from model.tokenizer import SPECIAL_TOKENS_IN_A_PAIR, truncating

MAX_QUERY_LENGTH, DOC_STRIDE = 64, 128


@dataclass
class QAExample:
    """One question on one context, with its gold answers (texts and character starts)."""

    id: str
    question: str
    context: str
    answers: list[str] = field(default_factory=list)
    answer_starts: list[int] = field(default_factory=list)
    is_impossible: bool = False


@dataclass
class QAWindow:
    """One training/evaluation row: a window of an example's context beside its question."""

    input_ids: list[int]
    token_type_ids: list[int]
    start_position: int  # 0 ([CLS]) when the answer is not wholly here
    end_position: int
    example: int  # index of the example in the list that was encoded
    offsets: list[tuple[int, int] | None]  # per token: its characters in the context, None off the context


@dataclass
class QAData:
    """Train and eval questions."""

    train: list[QAExample]
    eval: list[QAExample]

    @property
    def has_impossible(self) -> bool:
        return any(e.is_impossible for e in self.train + self.eval)


# ---------------------------------------------------------------------------- reading


def read_squad(path: str | os.PathLike) -> list[QAExample]:
    """The questions of a SQuAD v1.1 or v2.0 JSON file (optionally .gz/.bz2), checked."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"data file not found: {path}")
    with _open_text(path) as f:
        try:
            doc = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: not JSON: {e}") from None
        except RecursionError:  # json's decoder recurses once per nested array or object
            raise ValueError(f"{path}: not JSON for this reader: nested too deeply") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("data"), list):
        raise ValueError(f"{path}: not SQuAD JSON: expected an object with a 'data' list of articles")
    examples, seen = [], set()
    for a, article in enumerate(doc["data"]):
        for p, paragraph in enumerate(_list(path, article, "paragraphs", f"data[{a}]")):
            where = f"data[{a}].paragraphs[{p}]"
            context = paragraph.get("context") if isinstance(paragraph, dict) else None
            if not isinstance(context, str) or not context.strip():
                raise ValueError(f"{path}, {where}: 'context' is empty or not text")
            for q, qa in enumerate(_list(path, paragraph, "qas", where)):
                example = _example(path, qa, context, f"{where}.qas[{q}]")
                if example.id in seen:
                    raise ValueError(f"{path}: question id {example.id!r} appears more than once")
                seen.add(example.id)
                examples.append(example)
    if not examples:
        raise ValueError(f"{path} has no questions")
    return examples


def _list(path: Path, parent, key: str, where: str) -> list:
    value = parent.get(key) if isinstance(parent, dict) else None
    if not isinstance(value, list):
        raise ValueError(f"{path}, {where}: {key!r} must be a list")
    return value


def _example(path: Path, qa, context: str, where: str) -> QAExample:
    if not isinstance(qa, dict) or not isinstance(qa.get("id"), (str, int)) or str(qa["id"]) == "":
        raise ValueError(f"{path}, {where}: a question needs an 'id'")
    qid = str(qa["id"])
    question = qa.get("question")
    if not isinstance(question, str) or not question.strip():
        raise ValueError(f"{path}: question {qid!r}: 'question' is empty or not text")
    impossible = bool(qa.get("is_impossible", False))
    texts, starts = [], []
    for i, answer in enumerate(_list(path, qa, "answers", f"question {qid!r}")):
        text, start = (answer.get(k) if isinstance(answer, dict) else None for k in ("text", "answer_start"))
        if not isinstance(text, str) or not text or not isinstance(start, int) or isinstance(start, bool):
            raise ValueError(
                f"{path}: question {qid!r}: answers[{i}] needs a non-empty 'text' and an "
                f"integer 'answer_start', got {answer!r}"
            )
        found = context[start : start + len(text)] if start >= 0 else ""
        if found != text:
            raise ValueError(
                f"{path}: question {qid!r}: answers[{i}] {text!r} is not at answer_start {start} "
                f"of the context (found {found!r})"
            )
        texts.append(text)
        starts.append(start)
    if impossible and texts:
        raise ValueError(f"{path}: question {qid!r} is_impossible but has {len(texts)} answer(s)")
    if not impossible and not texts:
        raise ValueError(f"{path}: question {qid!r} has no answers (and is not is_impossible)")
    return QAExample(qid, question, context, texts, starts, impossible)


def load_qa_data(
    train_path: str | os.PathLike,
    eval_path: str | os.PathLike | None = None,
    *,
    eval_fraction: float = 0.1,
    seed: int = 0,
) -> QAData:
    """Read SQuAD questions; without `eval_path`, hold out `eval_fraction` of the train questions."""
    train = read_squad(train_path)
    if eval_path is not None:
        return QAData(train, read_squad(eval_path))
    train_idx, eval_idx = split_holdout(len(train), eval_fraction, seed)
    return QAData([train[i] for i in train_idx], [train[i] for i in eval_idx])


# ---------------------------------------------------------------------------- windows


class WindowMisfit(ValueError):
    """A question leaves no context tokens in a window (`no_room`), or doc_stride is not less than the
    context tokens a window holds, so the windows would not move along the context."""

    def __init__(self, room: int, doc_stride: int):
        super().__init__(f"doc_stride {doc_stride} must be at least 0 and less than the {room} context tokens")
        self.room, self.doc_stride = room, doc_stride

    @property
    def no_room(self) -> bool:
        return self.room < 1


def context_room(max_seq_len: int, question_tokens: int) -> int:
    """The context tokens a window of `max_seq_len` holds beside a question: "[CLS] question [SEP] context [SEP]"."""
    return max_seq_len - question_tokens - SPECIAL_TOKENS_IN_A_PAIR


def check_window(max_seq_len: int, question_tokens: int, doc_stride: int = 0) -> int:
    """The window check that SQuAD training, POST /jobs and /question-answering share: the context
    tokens a window holds beside the question, at least one and more than the `doc_stride` tokens
    windows share (or a WindowMisfit, which each caller words for its own user)."""
    room = context_room(max_seq_len, question_tokens)
    if room < 1 or not 0 <= doc_stride < room:
        raise WindowMisfit(room, doc_stride)
    return room


# ---------------------------------------------------------------------------- encoding


def default_doc_stride(max_seq_len: int, max_query_length: int = MAX_QUERY_LENGTH) -> int:
    """128 (run_qa.py's), or less in short windows: half the context tokens beside the longest question."""
    return max(0, min(DOC_STRIDE, context_room(max_seq_len, max_query_length) // 2))


def encode_squad(
    examples: list[QAExample],
    tokenizer,
    *,
    max_seq_len: int = 384,
    doc_stride: int | None = None,
    max_query_length: int = MAX_QUERY_LENGTH,
) -> list[QAWindow]:
    """Windows of every example, in order, with start/end positions (see the module docstring).
    `doc_stride` None: default_doc_stride."""
    if max_query_length < 1:
        raise ValueError(f"max_query_length must be >= 1, got {max_query_length!r}")
    if doc_stride is None:
        doc_stride = default_doc_stride(max_seq_len, max_query_length)
    questions = cut_questions(tokenizer, [e.question.lstrip() for e in examples], max_query_length)
    for example, (_, n) in zip(examples, questions):
        _check_room(example.id, n, max_seq_len, doc_stride)  # before the tokenizer fails on it
    windows_of = truncating(tokenizer, max_seq_len, stride=doc_stride, strategy="only_second")
    encodings = windows_of.encode_batch([(q, e.context) for (q, _), e in zip(questions, examples)])
    windows = []
    for index, (example, enc) in enumerate(zip(examples, encodings)):
        for w in (enc, *enc.overflowing):
            windows.append(_window(index, example, w))
    return windows


def _check_room(qid: str, q: int, max_seq_len: int, doc_stride: int) -> None:
    """check_window for question `qid` of `q` tokens, as the ValueError that names it."""
    try:
        check_window(max_seq_len, q, doc_stride)
    except WindowMisfit as e:
        raise ValueError(
            f"question {qid!r}: doc_stride {doc_stride} must be at least 0 and less than the {e.room} "
            f"context tokens that fit beside its {q} tokens in a window of max_seq_len {max_seq_len}"
        ) from None


def cut_questions(tokenizer, questions: list[str], max_tokens: int) -> list[tuple[str, int]]:
    """Each question's text up to the end of its `max_tokens`-th token, and its token count. WordPiece
    matches the longest prefix first, so the cut text tokenises to exactly those tokens."""
    out = []
    for question, enc in zip(questions, tokenizer.backend_tokenizer.encode_batch(questions, add_special_tokens=False)):
        if len(enc.ids) <= max_tokens:
            out.append((question, len(enc.ids)))
        else:
            out.append((question[: enc.offsets[max_tokens - 1][1]], max_tokens))
    return out


def _window(index: int, example: QAExample, enc) -> QAWindow:
    context = [sid == 1 for sid in enc.sequence_ids]
    offsets = [tuple(o) if c else None for o, c in zip(enc.offsets, context)]
    start, end = 0, 0
    if not example.is_impossible:
        first_char = example.answer_starts[0]
        start, end = answer_tokens(offsets, first_char, first_char + len(example.answers[0]))
    return QAWindow(list(enc.ids), list(enc.type_ids), start, end, index, offsets)


def answer_tokens(offsets: list[tuple[int, int] | None], start_char: int, end_char: int) -> tuple[int, int]:
    """run_qa.py's (start token, end token) of the characters [start_char, end_char) in one window,
    or (0, 0) when they are not wholly inside its context."""
    tokens = [t for t, o in enumerate(offsets) if o is not None]
    if not tokens:  # a context of characters the tokenizer drops
        return 0, 0
    first, last = tokens[0], tokens[-1]
    spans = cast("list[tuple[int, int]]", offsets)  # the context is contiguous: [first, last] all have offsets
    if not (spans[first][0] <= start_char and spans[last][1] >= end_char):
        return 0, 0
    start = first
    while start <= last and spans[start][0] <= start_char:
        start += 1
    end = last
    while end >= first and spans[end][1] >= end_char:
        end -= 1
    return start - 1, end + 1


# ---------------------------------------------------------------------------- batches


class QABatches(RowBatches):
    """Windows of SQuAD questions (encode_squad) as batches: input_ids, token_type_ids, attention_mask
    (B, T) and start_positions, end_positions (B,).

    As evaluation data (shuffle=False) it scores a model's start and end logits per row (`score`):
    each question's answer is the best span over its windows (model/qa_spans.py best_answer), ""
    when the empty answer wins and `allow_impossible` (SQuAD v2.0 data), scored by EM and F1.
    """

    def __init__(
        self,
        examples: list[QAExample],
        tokenizer,
        *,
        batch_size: int = 32,
        max_seq_len: int = 384,
        doc_stride: int | None = None,
        max_query_length: int = MAX_QUERY_LENGTH,
        max_answer_len: int = MAX_ANSWER_LEN,
        allow_impossible: bool | None = None,
        seed: int = 0,
        shuffle: bool = True,
    ):
        windows = encode_squad(
            examples, tokenizer, max_seq_len=max_seq_len, doc_stride=doc_stride, max_query_length=max_query_length
        )
        super().__init__(windows, batch_size, seed, shuffle)
        self.examples, self.pad_id, self.max_answer_len = examples, tokenizer.pad_token_id, max_answer_len
        self.allow_impossible = any(e.is_impossible for e in examples) if allow_impossible is None else allow_impossible

    def collate(self, rows: list[QAWindow]) -> dict[str, torch.Tensor]:
        batch = padded_inputs([r.input_ids for r in rows], [r.token_type_ids for r in rows], self.pad_id)
        batch["start_positions"] = torch.tensor([r.start_position for r in rows], dtype=torch.long)
        batch["end_positions"] = torch.tensor([r.end_position for r in rows], dtype=torch.long)
        return batch

    def predictions(self, logits: list[tuple]) -> dict[str, str]:
        """id -> answer text of every question whose windows are all among the first len(logits) rows,
        from each row's (start logits, end logits)."""
        per_example: dict[int, list] = {}
        for row, (start, end) in zip(self.rows, logits):
            per_example.setdefault(row.example, []).append((start, end, row.offsets))
        done = list(per_example)[:-1] if len(logits) < len(self.rows) else list(per_example)
        return {
            self.examples[i].id: best_answer(
                self.examples[i].context,
                per_example[i],
                max_answer_len=self.max_answer_len,
                allow_impossible=self.allow_impossible,
            )
            for i in done
        }

    def score(self, logits: list[tuple]) -> dict[str, float]:
        """exact_match and f1 over the questions `predictions` answers."""
        predictions = self.predictions(logits)
        golds = {e.id: e.answers for e in self.examples if e.id in predictions}
        return {**squad_scores(predictions, golds), "questions": len(golds)}
