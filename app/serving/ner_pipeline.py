"""POST /token-classification: a BertForTokenClassification's labels per token, answered as
transformers' token-classification ("ner") pipeline answers.

What is followed, from transformers' pipelines/token_classification.py (TokenClassificationPipeline):
- scores: softmax over the labels per token; special tokens ([CLS], [SEP]) are never entities;
- each token's `word` is its WordPiece (the input's own characters for [UNK]), `start`/`end` its
  character offsets from the fast tokenizer's offset mapping; a token is a sub-word when its text
  differs in length from those characters (the "##" prefix);
- aggregation_strategy none: one entry per token with `entity`, `score`, `index`; simple: adjacent
  tokens grouped (a new group at each B- tag or change of entity type) with the mean score;
  first/average/max: each word (a token and its sub-words) gets one label first (its first token's,
  its tokens' mean scores', its best-scored token's), then words are grouped as simple; a group's
  `word` is its tokens joined by the WordPiece decoder;
- entries labelled as in `ignore_labels` (default ["O"]) are left out.
- `stride`: each text read whole, in windows of the model's length that share `stride` tokens
  (the fast tokenizer's overflowing tokens); every window's entities, then of those that overlap
  the longer (at equal length the better-scored) kept; not with aggregation_strategy none.
What is ours: without `stride`, an input longer than the model is a 422 unless "truncate": true
(transformers truncates silently); with it, the windows' tokens are counted against
BERT_MAX_REQUEST_TOKENS before they are made; the limits and errors of every inference route.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from tokenizers import Encoding

from app.errors import ServiceError
from app.schemas.token_tasks import TokenClassificationRequest
from app.serving.pipelines import Row, _infer
from app.serving.service import Service
from app.serving.stored_models import LoadedModel
from model.tokenizer import SPECIAL_TOKENS_IN_ONE_TEXT, encode_one, truncating, window_count


async def token_classification(svc: Service, req: TokenClassificationRequest) -> Any:
    windows: list[list[Encoding]] = []  # filled while preparing: per text, its windows' offsets
    outcome = await _infer(
        svc,
        "token_classify",
        req.model,
        req.inputs,
        _prepare,
        req.truncate,
        req.stride,
        req.aggregation_strategy,
        svc.check_request_tokens,  # the bound; _infer charges the rows once
        windows,
    )
    texts = [req.inputs] if outcome.single else req.inputs
    out = await svc.off_loop(
        _answer, outcome.lm, texts, windows, outcome.results, req.aggregation_strategy, set(req.ignore_labels)
    )
    return outcome.answer(out)


def _prepare(
    lm: LoadedModel,
    texts: list[str],
    truncate: bool,
    stride: int | None,
    strategy: str,
    check_tokens: Callable[[int], None],
    windows: list,
) -> tuple[list[Row], dict]:
    if stride is not None:
        return _prepare_windows(lm, texts, stride, strategy, check_tokens, windows)
    tok = truncating(lm.tokenizer, lm.max_length) if truncate else lm.tokenizer.backend_tokenizer
    for i, text in enumerate(texts):
        enc = encode_one(tok, text)
        if len(enc.ids) > lm.max_length:
            raise ServiceError(
                "validation",
                f"input {i} is {len(enc.ids)} tokens long, more than the "
                f"{lm.max_length} model '{lm.name}' takes; shorten it or send "
                '"truncate": true',
            )
        windows.append([enc])
    return [(w[0].ids, w[0].type_ids) for w in windows], {}


def _prepare_windows(
    lm: LoadedModel, texts: list[str], stride: int, strategy: str, check_tokens: Callable[[int], None], windows: list
) -> tuple[list[Row], dict]:
    """transformers' `stride`: each text in windows of the model's length sharing `stride` tokens;
    their tokens counted (and checked) before any window is made."""
    room = lm.max_length - SPECIAL_TOKENS_IN_ONE_TEXT
    if strategy == "none":
        raise ServiceError(
            "validation",
            "stride reads the whole text in windows, and their entities are merged "
            "by character span: choose an aggregation_strategy other than none",
        )
    if stride >= room:
        raise ServiceError(
            "validation",
            f"stride {stride} must be less than the {room} tokens a window of model "
            f"'{lm.name}' holds beside [CLS] and [SEP]",
        )
    tokens = 0
    for text in texts:
        n = len(lm.tokenizer.token_ids(text))
        count = window_count(n, room, stride)
        tokens += count * SPECIAL_TOKENS_IN_ONE_TEXT + n + (count - 1) * stride
        check_tokens(tokens)
    tok = truncating(lm.tokenizer, lm.max_length, stride=stride)
    rows = []
    for text in texts:
        enc = encode_one(tok, text)
        windows.append([enc, *enc.overflowing])
        rows += [(w.ids, w.type_ids) for w in windows[-1]]
    return rows, {}


def _answer(
    lm: LoadedModel, texts: list[str], windows: list[list[Encoding]], results: list, strategy: str, ignore: set[str]
) -> list[list[dict]]:
    labels = lm.config.id2label or {}
    out, row = [], 0
    for text, encodings in zip(texts, windows):
        entities = []
        for enc, probs in zip(encodings, results[row : row + len(encodings)]):
            tokens = _tokens(lm, text, enc, np.asarray(probs, dtype=np.float32))
            entities += [
                e
                for e in _aggregate(lm, tokens, strategy, labels)
                if e.get("entity", e.get("entity_group")) not in ignore
            ]
        row += len(encodings)
        out.append(_merge_overlaps(entities) if len(encodings) > 1 else entities)
    return out


def _merge_overlaps(entities: list[dict]) -> list[dict]:
    """transformers' aggregate_overlapping_entities: of entities whose spans overlap (windows share
    tokens), the longer is kept, the better-scored at equal length."""
    if not entities:
        return entities
    entities = sorted(entities, key=lambda e: e["start"])
    merged, previous = [], entities[0]
    for entity in entities:
        if previous["start"] <= entity["start"] < previous["end"]:
            length, previous_length = entity["end"] - entity["start"], previous["end"] - previous["start"]
            if length > previous_length or length == previous_length and entity["score"] > previous["score"]:
                previous = entity
        else:
            merged.append(previous)
            previous = entity
    merged.append(previous)
    return merged


def _tokens(lm: LoadedModel, text: str, enc: Encoding, scores: np.ndarray) -> list[dict]:
    """transformers' gather_pre_entities: the non-special tokens with their scores and offsets."""
    unk = lm.tokenizer.backend_tokenizer.token_to_id(lm.tokenizer.unk_token)
    tokens = []
    for index, (token_id, word, (start, end), special) in enumerate(
        zip(enc.ids, enc.tokens, enc.offsets, enc.special_tokens_mask)
    ):
        if special:
            continue
        ref = text[start:end]
        is_subword = len(word) != len(ref)
        if token_id == unk:
            word, is_subword = ref, False
        tokens.append(
            {
                "word": word,
                "scores": scores[index],
                "start": start,
                "end": end,
                "index": index,
                "is_subword": is_subword,
            }
        )
    return tokens


def _label(labels: dict, i: int) -> str:
    return labels.get(int(i), f"LABEL_{int(i)}")


def _aggregate(lm: LoadedModel, tokens: list[dict], strategy: str, labels: dict) -> list[dict]:
    if strategy in ("none", "simple"):
        entities = [
            {
                "entity": _label(labels, t["scores"].argmax()),
                "score": float(t["scores"].max()),
                "index": t["index"],
                "word": t["word"],
                "start": t["start"],
                "end": t["end"],
            }
            for t in tokens
        ]
    else:
        entities = [_word(lm, group, strategy, labels) for group in _words(tokens)]
    return entities if strategy == "none" else _group(lm, entities)


def _words(tokens: list[dict]) -> list[list[dict]]:
    """Tokens split into words: a word is a token and the sub-words that follow it."""
    words: list[list[dict]] = []
    for token in tokens:
        if words and token["is_subword"]:
            words[-1].append(token)
        else:
            words.append([token])
    return words


def _word(lm: LoadedModel, tokens: list[dict], strategy: str, labels: dict) -> dict:
    """transformers' aggregate_word: one label for the whole word."""
    if strategy == "first":
        scores = tokens[0]["scores"]
    elif strategy == "max":
        scores = max(tokens, key=lambda t: t["scores"].max())["scores"]
    else:  # average
        scores = np.nanmean(np.stack([t["scores"] for t in tokens]), axis=0)
    best = scores.argmax()
    return {
        "entity": _label(labels, best),
        "score": float(scores[best]),
        "word": _join(lm, tokens),
        "start": tokens[0]["start"],
        "end": tokens[-1]["end"],
    }


def _join(lm: LoadedModel, tokens: list[dict]) -> str:
    """transformers' convert_tokens_to_string: the WordPiece decoder over the tokens."""
    return lm.tokenizer.backend_tokenizer.decoder.decode([t["word"] for t in tokens])


def _tag(label: str) -> tuple[str, str]:
    """(B or I, entity type): "B-PER" -> (B, PER); a label without a prefix counts as I."""
    if label.startswith(("B-", "I-")):
        return label[0], label[2:]
    return "I", label


def _group(lm: LoadedModel, entities: list[dict]) -> list[dict]:
    """transformers' group_entities: adjacent entries of one type form a group; B- starts a new one."""
    groups: list[list[dict]] = []
    for entity in entities:
        bi, tag = _tag(entity["entity"])
        if groups and bi != "B" and tag == _tag(groups[-1][-1]["entity"])[1]:
            groups[-1].append(entity)
        else:
            groups.append([entity])
    return [
        {
            "entity_group": group[0]["entity"].split("-", 1)[-1],
            "score": float(np.nanmean([e["score"] for e in group])),
            "word": _join(lm, group),
            "start": group[0]["start"],
            "end": group[-1]["end"],
        }
        for group in groups
    ]
