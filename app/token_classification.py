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
What is ours: an input longer than the model is a 422 unless "truncate": true (transformers
truncates silently); the limits and errors of every inference route.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import numpy as np
from tokenizers import Encoding, Tokenizer

from model.tokenizer import BertTokenizer

from .errors import ServiceError
from .pipelines import Row, _infer
from .schemas import TokenClassificationRequest
from .service import Service
from .store import LoadedModel

_copies: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # BertTokenizer -> {options: copy}
_copies_lock = threading.Lock()


def truncating(tok: BertTokenizer, max_length: int, stride: int = 0, strategy: str = "longest_first") -> Tokenizer:
    """A copy of the tokenizer that truncates so (the Rust tokenizer's truncation is mutable state
    shared by threads: never set it on the shared one)."""
    with _copies_lock:
        copies = _copies.setdefault(tok, {})
        key = (max_length, stride, strategy)
        if key not in copies:
            copy = Tokenizer.from_str(tok.backend_tokenizer.to_str())
            copy.enable_truncation(max_length, stride=stride, strategy=strategy)
            copies[key] = copy
        return copies[key]


async def token_classification(svc: Service, req: TokenClassificationRequest) -> Any:
    encodings: list[Encoding] = []  # filled while preparing: the offsets the answer needs
    outcome = await _infer(svc, "token_classify", req.model, req.inputs, _prepare, req.truncate, encodings)
    texts = [req.inputs] if outcome.single else req.inputs
    out = await svc.off_loop(_answer, outcome.lm, texts, encodings, outcome.results, req.aggregation_strategy,
                             set(req.ignore_labels))
    return outcome.answer(out)


def _prepare(lm: LoadedModel, texts: list[str], truncate: bool, encodings: list) -> tuple[list[Row], dict]:
    tok = truncating(lm.tokenizer, lm.max_length) if truncate else lm.tokenizer.backend_tokenizer
    for i, text in enumerate(texts):
        enc = tok.encode(text)
        if len(enc.ids) > lm.max_length:
            raise ServiceError("validation", f"input {i} is {len(enc.ids)} tokens long, more than the "
                                             f"{lm.max_length} model '{lm.name}' takes; shorten it or send "
                                             "\"truncate\": true")
        encodings.append(enc)
    return [(enc.ids, enc.type_ids) for enc in encodings], {}


def _answer(lm: LoadedModel, texts: list[str], encodings: list[Encoding], results: list, strategy: str,
            ignore: set[str]) -> list[list[dict]]:
    labels = lm.config.id2label or {}
    out = []
    for text, enc, probs in zip(texts, encodings, results):
        tokens = _tokens(lm, text, enc, np.asarray(probs, dtype=np.float32))
        entities = _aggregate(lm, tokens, strategy, labels)
        out.append([e for e in entities if e.get("entity", e.get("entity_group")) not in ignore])
    return out


def _tokens(lm: LoadedModel, text: str, enc: Encoding, scores: np.ndarray) -> list[dict]:
    """transformers' gather_pre_entities: the non-special tokens with their scores and offsets."""
    unk = lm.tokenizer.backend_tokenizer.token_to_id(lm.tokenizer.unk_token)
    tokens = []
    for index, (token_id, word, (start, end), special) in enumerate(
            zip(enc.ids, enc.tokens, enc.offsets, enc.special_tokens_mask)):
        if special:
            continue
        ref = text[start:end]
        is_subword = len(word) != len(ref)
        if token_id == unk:
            word, is_subword = ref, False
        tokens.append({"word": word, "scores": scores[index], "start": start, "end": end, "index": index,
                       "is_subword": is_subword})
    return tokens


def _label(labels: dict, i: int) -> str:
    return labels.get(int(i), f"LABEL_{int(i)}")


def _aggregate(lm: LoadedModel, tokens: list[dict], strategy: str, labels: dict) -> list[dict]:
    if strategy in ("none", "simple"):
        entities = [{"entity": _label(labels, t["scores"].argmax()), "score": float(t["scores"].max()),
                     "index": t["index"], "word": t["word"], "start": t["start"], "end": t["end"]} for t in tokens]
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
    return {"entity": _label(labels, best), "score": float(scores[best]), "word": _join(lm, tokens),
            "start": tokens[0]["start"], "end": tokens[-1]["end"]}


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
    return [{"entity_group": group[0]["entity"].split("-", 1)[-1],
             "score": float(np.nanmean([e["score"] for e in group])),
             "word": _join(lm, group), "start": group[0]["start"], "end": group[-1]["end"]} for group in groups]
