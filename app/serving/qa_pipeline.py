"""POST /question-answering: a BertForQuestionAnswering's answer spans, answered as transformers
4.x's question-answering pipeline answered (transformers 5 removed that pipeline; its clients remain).

What is followed, from transformers 4.x pipelines/question_answering.py (QuestionAnsweringPipeline):
- windows: "[CLS] question [SEP] context [SEP]", at most max_seq_len tokens each (default the
  model's maximum, at most 384), the context cut ("only_second") into windows that share
  doc_stride tokens (default max_seq_len // 2, at most 128), as the fast tokenizer's overflowing
  tokens; each window is one row of a forward pass;
- select_starts_ends and decode_spans: per window, model/qa_spans.py `window_spans` (shared with
  SQuAD evaluation): a softmax over the context and [CLS], the empty answer's score, the top_k
  spans of at most max_answer_len tokens;
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

from app.errors import ServiceError
from app.schemas.token_tasks import QuestionAnsweringRequest
from app.serving.pipelines import Row, _infer
from app.serving.service import Service
from app.serving.stored_models import LoadedModel
from model.data.question_answering import WindowMisfit, check_window
from model.qa_spans import NO_NULL, window_spans
from model.tokenizer import SPECIAL_TOKENS_IN_A_PAIR, encode_one, truncating, window_count


async def question_answering(svc: Service, req: QuestionAnsweringRequest) -> Any:
    single = isinstance(req.question, str)
    pairs = list(zip([req.question], [req.context]) if single else zip(req.question, req.context))
    windows: list[list[Encoding]] = []  # filled while preparing: per pair, its windows' encodings
    outcome = await _infer(  # (the bound as the windows are counted; _infer charges the rows once)
        svc, "qa", req.model, pairs, _prepare, req.max_seq_len, req.doc_stride, svc.check_request_tokens, windows
    )
    out = await svc.off_loop(_answer, pairs, windows, outcome.results, req)
    return out[0] if single else out


def _prepare(
    lm: LoadedModel,
    pairs: list[tuple[str, str]],
    max_seq_len: int | None,
    doc_stride: int | None,
    check_tokens: Callable[[int], None],
    windows: list,
) -> tuple[list[Row], dict]:
    if max_seq_len is None:
        max_seq_len = min(lm.max_length, 384)
    elif max_seq_len > lm.max_length:
        raise ServiceError(
            "validation", f"max_seq_len is {max_seq_len}, more than the {lm.max_length} tokens model '{lm.name}' takes"
        )
    if doc_stride is None:
        doc_stride = min(max_seq_len // 2, 128)
    tok = truncating(lm.tokenizer, max_seq_len, stride=doc_stride, strategy="only_second")
    rows, tokens = [], 0
    for i, (question, context) in enumerate(pairs):
        tokens += _check_fits(lm, i, question, context, max_seq_len, doc_stride)
        check_tokens(tokens)  # before the windows are made: a small stride makes very many
        enc = encode_one(tok, question, context)
        windows.append([enc, *enc.overflowing])
        rows += [(w.ids, w.type_ids) for w in windows[-1]]
    return rows, {}


def _check_fits(lm: LoadedModel, i: int, question: str, context: str, max_seq_len: int, doc_stride: int) -> int:
    """What the Rust tokenizer would fail on (or panic over), as a 422 that names the sizes; else
    how many tokens the pair's windows will hold, counted before they are made."""
    for name, text in (("question", question), ("context", context)):
        if not text.strip():
            raise ServiceError("validation", f"{name} {i} is empty")
    q, c = len(lm.tokenizer.token_ids(question)), len(lm.tokenizer.token_ids(context))
    if q + c + SPECIAL_TOKENS_IN_A_PAIR <= max_seq_len:
        return q + c + SPECIAL_TOKENS_IN_A_PAIR  # one window: nothing to cut
    try:
        room = check_window(max_seq_len, q, doc_stride)
    except WindowMisfit as e:
        if e.no_room:
            raise ServiceError(
                "validation",
                f"question {i} is {q} tokens long: with [CLS] and two [SEP] it leaves no "
                f"room for the context in a window of max_seq_len {max_seq_len} tokens",
            ) from None
        raise ServiceError(
            "validation",
            f"doc_stride {doc_stride} must be less than the {e.room} context tokens "
            f"that fit in a window beside question {i} (max_seq_len {max_seq_len})",
        ) from None
    # As the tokenizer cuts: the first window holds `room` context tokens, each next one the last
    # doc_stride tokens of the one before and up to room - doc_stride new ones.
    windows = window_count(c, room, doc_stride)
    return windows * (q + SPECIAL_TOKENS_IN_A_PAIR) + c + (windows - 1) * doc_stride


def _answer(
    pairs: list[tuple[str, str]], windows: list[list[Encoding]], results: list, req: QuestionAnsweringRequest
) -> list:
    out, row = [], 0
    for (_, context), encodings in zip(pairs, windows):
        logits = results[row : row + len(encodings)]
        row += len(encodings)
        answers, null = [], NO_NULL  # the empty answer's score: the lowest over the windows
        for enc, (start, end) in zip(encodings, logits):
            context_mask = np.array([sid == 1 for sid in enc.sequence_ids], dtype=bool)
            starts, ends, scores, null = window_spans(
                np.asarray(start, dtype=np.float32),
                np.asarray(end, dtype=np.float32),
                context_mask,
                max_answer_len=req.max_answer_len,
                top_k=req.top_k,
                null=null,
                handle_impossible=req.handle_impossible_answer,
            )
            for s, e, score in zip(starts, ends, scores):
                first, last = _chars(enc, int(s), int(e), req.align_to_words)
                answers.append({"score": score.item(), "start": first, "end": last, "answer": context[first:last]})
        if req.handle_impossible_answer:
            answers.append({"score": null, "start": 0, "end": 0, "answer": ""})
        answers = sorted(answers, key=lambda a: a["score"], reverse=True)[: req.top_k]
        out.append(answers[0] if len(answers) == 1 else answers)
    return out


def _chars(enc: Encoding, s: int, e: int, align_to_words: bool) -> tuple[int, int]:
    """transformers' get_indices: the answer's character span in the context."""
    if align_to_words:
        words = enc.token_to_word(s), enc.token_to_word(e)
        # [CLS] is in no word: its offsets, as transformers falls back to
        if words[0] is not None and words[1] is not None:
            first = enc.word_to_chars(words[0], sequence_index=1)
            last = enc.word_to_chars(words[1], sequence_index=1)
            assert first is not None and last is not None  # a word of the context has characters
            return first[0], last[1]
    return enc.offsets[s][0], enc.offsets[e][1]
