"""Request -> tokens -> engine job -> response, for each task.

Tokenising and decoding run in the service's thread pool; the forward pass in the engine's
inference thread; only awaiting happens on the event loop. fill-mask answers in the shape of
transformers' FillMaskPipeline (postprocess: scores from a full-vocabulary softmax, `sequence`
decoded with special tokens skipped only when the input has a single mask).
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np

from .engine import Job
from .errors import ServiceError
from .schemas import (ClassifyRequest, EmbeddingsRequest, FillMaskRequest, NspRequest, OpenAIEmbeddingsRequest,
                      TextPair)
from .service import Service
from .store import LoadedModel

Row = tuple[list[int], list[int]]  # (input_ids, token_type_ids)
_UNLIMITED = 10**9


def encode(lm: LoadedModel, items: list[str | TextPair], truncate: bool) -> list[Row]:
    """Tokenise texts or pairs; too long for the model is a 422 unless `truncate`."""
    rows = []
    for i, item in enumerate(items):
        a, b = (item.text_a, item.text_b) if isinstance(item, TextPair) else (item, None)
        if truncate:
            enc = lm.tokenizer.encode(a, b, max_length=lm.max_length, truncation=True)
        else:
            enc = lm.tokenizer.encode(a, b, max_length=_UNLIMITED)
            n = len(enc["input_ids"])
            if n > lm.max_length:
                raise ServiceError("validation", f"input {i} is {n} tokens long, more than the {lm.max_length} "
                                                 f"model '{lm.name}' takes; shorten it or send \"truncate\": true")
        rows.append((enc["input_ids"], enc["token_type_ids"]))
    return rows


def as_list(inputs) -> tuple[list, bool]:
    """(inputs as a list, whether the request sent a single input)."""
    return (inputs, False) if isinstance(inputs, list) else ([inputs], True)


# -- fill-mask ---------------------------------------------------------------------------------

async def fill_mask(svc: Service, req: FillMaskRequest) -> Any:
    with svc.incoming():
        lm = await svc.model(req.model, "mlm", "/fill-mask")
        texts, single = as_list(req.inputs)
        svc.check_count(len(texts))
        rows, target_ids = await svc.off_loop(_prepare_fill_mask, lm, texts, req.targets, req.truncate)
    results = await svc.run(Job("mlm", lm, rows, {"top_k": req.top_k, "target_ids": target_ids}))
    out = await svc.off_loop(_format_fill_mask, lm, rows, results)
    return out[0] if single else out


def _prepare_fill_mask(lm: LoadedModel, texts: list[str], targets: list[str] | None, truncate: bool):
    rows = encode(lm, texts, truncate)
    mask = lm.mask_token_id
    for i, (ids, _) in enumerate(rows):
        if mask not in ids:
            raise ServiceError("validation", f"input {i} has no {lm.tokenizer.mask_token} token; fill-mask "
                                             "needs at least one")
    return rows, (_target_ids(lm, targets) if targets is not None else None)


def _target_ids(lm: LoadedModel, targets: list[str]) -> list[int]:
    """As transformers: a vocabulary token is itself, another word its first WordPiece."""
    vocab = lm.tokenizer.get_vocab()
    ids = []
    for target in targets:
        if target in vocab:
            ids.append(vocab[target])
        elif pieces := lm.tokenizer.tokenize(target):
            ids.append(lm.tokenizer.convert_tokens_to_ids(pieces[0]))
    if not ids:
        raise ServiceError("validation", "none of the targets is a token of the model's vocabulary")
    return sorted(set(ids))


def _format_fill_mask(lm: LoadedModel, rows: list[Row], results: list) -> list:
    tok, out = lm.tokenizer, []
    for (ids, _), per_mask in zip(rows, results):
        positions = [t for t, x in enumerate(ids) if x == lm.mask_token_id]
        single = len(positions) == 1
        answers = []
        for pos, (scores, token_ids) in zip(positions, per_mask):
            candidates = []
            for score, token in zip(scores, token_ids):
                filled = list(ids)
                filled[pos] = token
                candidates.append({"score": score, "token": token,
                                   "token_str": tok.decode([token], skip_special_tokens=False),
                                   "sequence": tok.decode(filled, skip_special_tokens=single)})
            answers.append(candidates)
        out.append(answers[0] if single else answers)
    return out


# -- nsp ---------------------------------------------------------------------------------------

async def nsp(svc: Service, req: NspRequest) -> Any:
    with svc.incoming():
        lm = await svc.model(req.model, "nsp", "/nsp")
        pairs, single = as_list(req.inputs)
        svc.check_count(len(pairs))
        rows = await svc.off_loop(encode, lm, pairs, req.truncate)
    scores = await svc.run(Job("nsp", lm, rows))
    out = [{"is_next": s >= 0.5, "score": s} for s in scores]
    return out[0] if single else out


# -- embeddings --------------------------------------------------------------------------------

async def embed(svc: Service, lm: LoadedModel, texts: list[str], *, pooling: str, normalize: bool,
                truncate: bool) -> tuple[list[list[float]], int]:
    """(one vector per text, tokens used)."""
    with svc.incoming():
        svc.check_count(len(texts))
        rows = await svc.off_loop(encode, lm, texts, truncate)
    vectors = await svc.run(Job("encode", lm, rows, {"pooling": pooling, "normalize": normalize}))
    return vectors, sum(len(ids) for ids, _ in rows)


async def embeddings(svc: Service, req: EmbeddingsRequest) -> Any:
    lm = await svc.model(req.model)
    texts, single = as_list(req.inputs)
    vectors, _ = await embed(svc, lm, texts, pooling=req.pooling, normalize=req.normalize, truncate=req.truncate)
    return vectors[0] if single else vectors


async def openai_embeddings(svc: Service, req: OpenAIEmbeddingsRequest) -> dict:
    lm = await svc.model(req.model)
    if req.dimensions is not None and req.dimensions != lm.config.hidden_size:
        raise ServiceError("validation", f"model '{lm.name}' makes {lm.config.hidden_size}-dimensional "
                                         f"embeddings, not {req.dimensions}")
    texts, _ = as_list(req.input)
    vectors, tokens = await embed(svc, lm, texts, pooling="mean", normalize=True, truncate=False)
    if req.encoding_format == "base64":
        vectors = [base64.b64encode(np.asarray(v, dtype="<f4").tobytes()).decode() for v in vectors]
    return {"object": "list", "model": lm.name,
            "data": [{"object": "embedding", "embedding": v, "index": i} for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


# -- classify ----------------------------------------------------------------------------------

async def classify(svc: Service, req: ClassifyRequest) -> Any:
    with svc.incoming():
        lm = await svc.model(req.model, "classifier", "/classify")
        items, single = as_list(req.inputs)
        svc.check_count(len(items))
        rows = await svc.off_loop(encode, lm, items, req.truncate)
    scores = await svc.run(Job("classify", lm, rows))
    id2label = lm.config.id2label or {}
    labels = [id2label.get(i, f"LABEL_{i}") for i in range(len(scores[0]))]
    out = []
    for row in scores:
        best = max(range(len(row)), key=row.__getitem__)
        out.append({"label": labels[best], "score": row[best], "scores": dict(zip(labels, row))})
    return out[0] if single else out
