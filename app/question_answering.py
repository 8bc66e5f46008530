"""POST /question-answering: a BertForQuestionAnswering's answer spans, answered as transformers
4.x's question-answering pipeline answered (transformers 5 removed that pipeline; its clients remain).

What is followed, from transformers 4.x pipelines/question_answering.py (QuestionAnsweringPipeline):
- windows: "[CLS] question [SEP] context [SEP]", at most max_seq_len tokens each (default the
  model's maximum, at most 384), the context cut ("only_second") into windows that share
  doc_stride tokens (default max_seq_len // 2, at most 128), as the fast tokenizer's overflowing
  tokens; each window is one row of a forward pass;
- select_starts_ends: per window, every token that is not context ([CLS] excepted) gets logit
  -10000 before a softmax of the start and of the end logits; P(start=[CLS]) x P(end=[CLS]) is the
  empty answer's score (the lowest over the windows); then [CLS] is set to 0;
- decode_spans: the (start, end) matrix of P(start) x P(end), upper-triangular and cut at
  max_answer_len tokens, its top_k cells per window (both ends on allowed tokens);
- answers from every window ranked by score (a stable sort), the empty one added with
  handle_impossible_answer, top_k kept; one answer is answered alone, more as a list;
- character offsets from the window's Encoding: with align_to_words, widened to the words holding
  the start and end tokens (token_to_word, word_to_chars), else the tokens' offsets.
What is ours: the question and context come as two strings (or two lists of the same length, one
answer per pair); a question that leaves no room for the context, or a doc_stride that does not fit
in a window, is a 422 naming the sizes; BERT_MAX_REQUEST_TOKENS counts every window's tokens, from
the question's and context's token counts before any window is made (a small doc_stride makes many).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from tokenizers import Encoding

from .errors import ServiceError
from .pipelines import Row, _infer, truncating, window_count
from .schemas import QuestionAnsweringRequest
from .service import Service
from .store import LoadedModel

SPECIAL_TOKENS_IN_A_PAIR = 3  # [CLS] question [SEP] context [SEP]


async def question_answering(svc: Service, req: QuestionAnsweringRequest) -> Any:
    single = isinstance(req.question, str)
    pairs = list(zip([req.question], [req.context]) if single else zip(req.question, req.context))
    windows: list[list[Encoding]] = []  # filled while preparing: per pair, its windows' encodings
    outcome = await _infer(svc, "qa", req.model, pairs, _prepare, req.max_seq_len, req.doc_stride,
                           svc.check_tokens, windows)
    out = await svc.off_loop(_answer, pairs, windows, outcome.results, req)
    return out[0] if single else out


def _prepare(lm: LoadedModel, pairs: list[tuple[str, str]], max_seq_len: int | None, doc_stride: int | None,
             check_tokens: Callable[[int], None], windows: list) -> tuple[list[Row], dict]:
    if max_seq_len is None:
        max_seq_len = min(lm.max_length, 384)
    elif max_seq_len > lm.max_length:
        raise ServiceError("validation", f"max_seq_len is {max_seq_len}, more than the {lm.max_length} tokens "
                                         f"model '{lm.name}' takes")
    if doc_stride is None:
        doc_stride = min(max_seq_len // 2, 128)
    tok = truncating(lm.tokenizer, max_seq_len, stride=doc_stride, strategy="only_second")
    rows, tokens = [], 0
    for i, (question, context) in enumerate(pairs):
        tokens += _check_fits(lm, i, question, context, max_seq_len, doc_stride)
        check_tokens(tokens)  # before the windows are made: a small stride makes very many
        enc = tok.encode(question, context)
        windows.append([enc, *enc.overflowing])
        rows += [(w.ids, w.type_ids) for w in windows[-1]]
    return rows, {}


def _check_fits(lm: LoadedModel, i: int, question: str, context: str, max_seq_len: int, doc_stride: int) -> int:
    """What the Rust tokenizer would fail on (or panic over), as a 422 that names the sizes; else
    how many tokens the pair's windows will hold, counted before they are made."""
    for name, text in (("question", question), ("context", context)):
        if not text.strip():
            raise ServiceError("validation", f"{name} {i} is empty")
    backend = lm.tokenizer.backend_tokenizer
    q = len(backend.encode(question, add_special_tokens=False).ids)
    c = len(backend.encode(context, add_special_tokens=False).ids)
    if q + c + SPECIAL_TOKENS_IN_A_PAIR <= max_seq_len:
        return q + c + SPECIAL_TOKENS_IN_A_PAIR  # one window: nothing to cut
    room = max_seq_len - q - SPECIAL_TOKENS_IN_A_PAIR
    if room < 1:
        raise ServiceError("validation", f"question {i} is {q} tokens long: with [CLS] and two [SEP] it leaves no "
                                         f"room for the context in a window of max_seq_len {max_seq_len} tokens")
    if doc_stride >= room:
        raise ServiceError("validation", f"doc_stride {doc_stride} must be less than the {room} context tokens "
                                         f"that fit in a window beside question {i} (max_seq_len {max_seq_len})")
    # As the tokenizer cuts: the first window holds `room` context tokens, each next one the last
    # doc_stride tokens of the one before and up to room - doc_stride new ones.
    windows = window_count(c, room, doc_stride)
    return windows * (q + SPECIAL_TOKENS_IN_A_PAIR) + c + (windows - 1) * doc_stride


def _answer(pairs: list[tuple[str, str]], windows: list[list[Encoding]], results: list,
            req: QuestionAnsweringRequest) -> list:
    out, row = [], 0
    for (_, context), encodings in zip(pairs, windows):
        logits = results[row:row + len(encodings)]
        row += len(encodings)
        answers, null = [], 1000000.0  # the empty answer's score: the lowest over the windows
        for enc, (start, end) in zip(encodings, logits):
            starts, ends, scores, null = _spans(enc, np.asarray(start, dtype=np.float32),
                                                np.asarray(end, dtype=np.float32), null, req)
            for s, e, score in zip(starts, ends, scores):
                first, last = _chars(enc, int(s), int(e), req.align_to_words)
                answers.append({"score": score.item(), "start": first, "end": last, "answer": context[first:last]})
        if req.handle_impossible_answer:
            answers.append({"score": null, "start": 0, "end": 0, "answer": ""})
        answers = sorted(answers, key=lambda a: a["score"], reverse=True)[:req.top_k]
        out.append(answers[0] if len(answers) == 1 else answers)
    return out


def _spans(enc: Encoding, start: np.ndarray, end: np.ndarray, null: float,
           req: QuestionAnsweringRequest) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """transformers' select_starts_ends and decode_spans for one window."""
    allowed = np.array([sid == 1 for sid in enc.sequence_ids], dtype=bool)  # context tokens
    allowed[0] = True  # [CLS]: the empty answer
    start = _softmax(np.where(allowed, start, -10000.0))
    end = _softmax(np.where(allowed, end, -10000.0))
    if req.handle_impossible_answer:
        null = min(null, (start[0] * end[0]).item())
    start[0] = end[0] = 0.0
    candidates = np.tril(np.triu(np.outer(start, end)), req.max_answer_len - 1)  # (T, T): end >= start
    flat = candidates.flatten()
    if req.top_k == 1:
        best = np.array([np.argmax(flat)])
    elif len(flat) < req.top_k:
        best = np.argsort(-flat)
    else:
        best = np.argpartition(-flat, req.top_k)[:req.top_k]
        best = best[np.argsort(-flat[best])]
    starts, ends = np.unravel_index(best, candidates.shape)
    keep = allowed[starts] & allowed[ends]
    starts, ends = starts[keep], ends[keep]
    return starts, ends, candidates[starts, ends], null


def _softmax(x: np.ndarray) -> np.ndarray:
    x = np.exp(x - x.max())
    return x / x.sum()


def _chars(enc: Encoding, s: int, e: int, align_to_words: bool) -> tuple[int, int]:
    """transformers' get_indices: the answer's character span in the context."""
    if align_to_words:
        words = enc.token_to_word(s), enc.token_to_word(e)
        if None not in words:  # [CLS] is in no word: its offsets, as transformers falls back to
            return (enc.word_to_chars(words[0], sequence_index=1)[0],
                    enc.word_to_chars(words[1], sequence_index=1)[1])
    return enc.offsets[s][0], enc.offsets[e][1]
