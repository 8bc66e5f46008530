"""Answer spans from a question-answering head's start and end logits, one window at a time, and the
best answer of an example over all its windows.

Both the /question-answering route (app/serving/qa_pipeline.py) and SQuAD evaluation
(model/training/evaluation.py) pick spans with `window_spans`, which is transformers 4.x's
QuestionAnsweringPipeline `select_starts_ends` + `decode_spans`:
- every token outside the context ([CLS] excepted) gets logit -10000 before a softmax of the start
  and of the end logits; P(start=[CLS]) x P(end=[CLS]) is the empty answer's score (kept as the
  lowest over an example's windows); then [CLS] is set to 0;
- the (start, end) matrix of P(start) x P(end), upper-triangular (end >= start) and cut at
  max_answer_len tokens, gives the top_k cells whose both ends are context tokens.
`best_answer` is evaluation's use of it: the best span over the windows (top_k 1), or "" when the
empty answer scores higher and the data has impossible questions (SQuAD v2.0); its text is the
context between the start token's first and the end token's last character (run_qa.py's offsets).

References: huggingface/transformers 4.x pipelines/question_answering.py; examples/pytorch/
question-answering/utils_qa.py (postprocess_qa_predictions: offsets, max_answer_length 30).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

MAX_ANSWER_LEN = 30  # tokens; run_qa.py's and the pipeline's default
NO_NULL = 1000000.0  # the empty answer's score before any window lowered it


def window_spans(
    start: np.ndarray,
    end: np.ndarray,
    context: np.ndarray,
    *,
    max_answer_len: int = MAX_ANSWER_LEN,
    top_k: int = 1,
    null: float = NO_NULL,
    handle_impossible: bool = False,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """(starts, ends, scores, null) of one window's top_k spans; `context` (T,) is True on context tokens,
    `null` the empty answer's score so far (lowered to this window's when `handle_impossible`)."""
    allowed = np.array(context, dtype=bool)
    allowed[0] = True  # [CLS]: the empty answer
    start = _softmax(np.where(allowed, start, -10000.0))
    end = _softmax(np.where(allowed, end, -10000.0))
    if handle_impossible:
        null = min(null, (start[0] * end[0]).item())
    start[0] = end[0] = 0.0
    candidates = np.tril(np.triu(np.outer(start, end)), max_answer_len - 1)  # (T, T): end >= start
    flat = candidates.flatten()
    if top_k == 1:
        best = np.array([np.argmax(flat)])
    elif len(flat) < top_k:
        best = np.argsort(-flat)
    else:
        best = np.argpartition(-flat, top_k)[:top_k]
        best = best[np.argsort(-flat[best])]
    starts, ends = np.unravel_index(best, candidates.shape)
    keep = allowed[starts] & allowed[ends]
    starts, ends = starts[keep], ends[keep]
    return starts, ends, candidates[starts, ends], null


def _softmax(x: np.ndarray) -> np.ndarray:
    x = np.exp(x - x.max())
    return x / x.sum()


def best_answer(
    context: str,
    windows: Sequence[tuple[np.ndarray, np.ndarray, Sequence]],
    *,
    max_answer_len: int = MAX_ANSWER_LEN,
    allow_impossible: bool = False,
) -> str:
    """The answer text of one example from its windows' (start logits, end logits, offsets), where
    offsets[t] is token t's (first, end) character in `context`, or None off the context."""
    best, best_text, null = -1.0, "", NO_NULL
    for start, end, offsets in windows:
        n = len(offsets)  # the window's own tokens; the logits may run on over padding
        mask = np.array([o is not None for o in offsets], dtype=bool)
        starts, ends, scores, null = window_spans(
            np.asarray(start[:n], dtype=np.float32),
            np.asarray(end[:n], dtype=np.float32),
            mask,
            max_answer_len=max_answer_len,
            null=null,
            handle_impossible=allow_impossible,
        )
        if len(scores) and scores[0] > best:
            best = float(scores[0])
            best_text = context[offsets[starts[0]][0] : offsets[ends[0]][1]]
    return "" if allow_impossible and null > best else best_text
