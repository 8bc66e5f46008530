"""text-embeddings-inference (TEI) compatibility: /embed, /embed_sparse, /embed_all, /predict, /rerank, /similarity,
/tokenize and /decode answer as TEI's router does, computed by this service's own tasks (encode, sparse_encode,
token_encode and classify, batched by the engine).

What is followed, from huggingface/text-embeddings-inference:
- router/src/http/types.rs: the request and response shapes (app/schemas/tei.py). /embed and /tokenize
  answer a list per input even for one input; /predict answers one input's list or a batch's lists;
  a /predict list of two strings is one pair, not two texts.
- core/src/infer.rs `predict`: unless raw_scores, softmax over the labels, sigmoid for one label;
  router/src/http/server.rs `predict`: each input's labels sorted best first. Ours: `top_k` (the
  labels returned per input, by default every label up to BERT_MAX_LABEL_SCORES, else the best
  that many), scored and chosen in the inference thread (app/serving/forward.py).
- router/src/http/server.rs `rerank`: one (query, text) pair per text through a one-label
  classifier, sigmoid unless raw_scores, ranks sorted best first (a stable ascending sort reversed,
  so ties keep TEI's order); `text` only with return_text. A late-interaction (ColBERT) model ranks by
  MaxSim instead (app/serving/colbert_pipeline.py).
- router/src/http/server.rs `similarity`: the source sentence and the sentences embedded as one
  /embed batch (so they count together against the input limit), then the cosine similarity of the
  source's vector with each sentence's, in the sentences' order; `parameters` holds the options.
- router/src/http/server.rs `run`: POST / is /predict, /rerank or /embed by the model's type (here
  the model the body names, or BERT_DEFAULT_MODEL); /similarity for an encoder given
  {source_sentence, sentences}, which TEI does when started with TASK=sentence-similarity.
- router/src/http/server.rs `tokenize`: each token's id, special flag and character offsets from
  the tokenizer's Encoding; a special token's text is its own, with null offsets; any other's is
  the input's characters start:stop.
- router/src/http/server.rs `embed_sparse`: per input, its SPLADE vector's nonzero entries {index, value} by
  index (TEI's `--pooling splade`; here a model whose sentence-transformers files say SpladePooling, or any
  masked-LM model with "pooling": "splade"). Ours: `threshold` (entries at most it dropped), `top_k` (the k
  largest, largest first), `return_tokens` (each entry's vocabulary token), all chosen in the inference
  thread (app/serving/forward.py run_sparse_encode), so only the kept entries leave it. POST / of such a
  model is /embed_sparse, and the dense routes refuse it (app/serving/embed_pipeline.py).
- router/src/http/server.rs `embed_all`: per input, every token's last hidden state ([CLS] and [SEP]
  included), bounded by BERT_MAX_ANSWER_VALUES numbers; `decode`: the tokenizer's decode of each id list.
- truncation_direction: tokenizers' truncation direction, longest_first for pairs.
What is ours: errors keep this service's body and status (422 for an input too long, where TEI
answers 413), the request limits (BERT_MAX_INPUTS, BERT_MAX_REQUEST_TOKENS) and the API key apply
as on every inference route. Pooling is the model's sentence-transformers Pooling, as TEI reads
1_Pooling/config.json (model.sentence_modules; mean without one); /embed's `normalize` is TEI's (true
unless sent false, whether or not the model has a Normalize module). /embed takes the embedding options of
/embeddings (app/serving/embed_pipeline.py: dimensions, prompt_name or prompt, long_inputs); /similarity
and /tokenize take prompt_name.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from app.errors import ServiceError
from app.schemas.shared import TextPair
from app.schemas.tei import (
    DecodeRequest,
    EmbedAllRequest,
    EmbedRequest,
    EmbedSparseRequest,
    PredictRequest,
    RerankRequest,
    SimilarityParameters,
    SimilarityRequest,
    TokenizeRequest,
)
from app.serving import colbert_pipeline, embed_pipeline
from app.serving.embed_pipeline import EmbedPlan, prompt_text
from app.serving.pipelines import Row, _infer, as_list, encode, label_scores, scores_per_input, too_long
from app.serving.service import Service, check_dropped
from app.serving.stored_models import LoadedModel
from datadir import valid_name
from model.modeling import BertForSequenceClassification
from model.tokenizer import encode_one, truncating

# -- truncation --------------------------------------------------------------------------------


def _encode(lm: LoadedModel, items: list, truncate: bool | None, direction: str) -> list[Row]:
    """encode() with TEI's truncation options: null truncate is false; "Left" cuts the start."""
    if not truncate or direction.lower() == "right":
        return encode(lm, items, bool(truncate))
    tok = truncating(lm.tokenizer, lm.max_length, direction="left")
    rows = []
    for item in items:
        check_dropped()
        a, b = (item.text_a, item.text_b) if isinstance(item, TextPair) else (item, None)
        enc = encode_one(tok, a, b)
        rows.append((enc.ids, enc.type_ids))
    return rows


# -- /embed ------------------------------------------------------------------------------------


async def embed(svc: Service, req: EmbedRequest) -> list[list[float]]:
    plan = EmbedPlan.of(req, encode=_directed(req.truncation_direction))
    vectors, _, _ = await embed_pipeline.embed(svc, req.model, as_list(req.inputs)[0], plan, route="/embed")
    return vectors


def _directed(direction: str) -> Callable[[LoadedModel, list, bool], list[Row]]:
    """encode(lm, texts, truncate) cutting the end TEI's truncation_direction says."""
    return lambda lm, texts, truncate: _encode(lm, texts, truncate, direction)


# -- /similarity -------------------------------------------------------------------------------


async def similarity(svc: Service, req: SimilarityRequest) -> list[float]:
    params = req.parameters or SimilarityParameters()
    texts = [req.inputs.source_sentence, *req.inputs.sentences]
    plan = EmbedPlan.of(params, normalize=True, encode=_directed(params.truncation_direction))
    (source, *others), _, _ = await embed_pipeline.embed(svc, req.model, texts, plan, route="/similarity")
    return [sum(a * b for a, b in zip(source, other)) for other in others]  # unit vectors: dot = cosine


# -- POST / -------------------------------------------------------------------------------------


def root_route(lm: LoadedModel, body: dict) -> str:
    """What TEI's POST / is for its model's type (router/src/http/server.rs `run`): a re-ranker (a
    one-label classifier) reranks, another classifier predicts, an encoder embeds; an encoder compares
    when `inputs` is {source_sentence, sentences} (TEI does that with TASK=sentence-similarity)."""
    if isinstance(lm.model, BertForSequenceClassification):
        return "/rerank" if lm.config.num_labels == 1 else "/predict"
    if lm.sentence_modules.splade is not None:
        return "/embed_sparse"
    return "/similarity" if isinstance(body.get("inputs"), dict) else "/embed"


async def root(svc: Service, body: dict) -> list:
    """POST /: the body read as the request of root_route, for the model it names or the default one."""
    name = body.get("model")  # not a valid name: the default model's request type reports it
    lm = await svc.loaded_model(name if isinstance(name, str) and valid_name(name) else None, None, "/")
    route = root_route(lm, body)
    request_type, run = ROOT_ROUTES[route]
    try:
        req = request_type.model_validate(body)
    except ValidationError as e:
        raise RequestValidationError(e.errors()) from None
    return await run(svc, req.model_copy(update={"model": lm.name}))


# -- /predict ----------------------------------------------------------------------------------


def _predict_inputs(inputs) -> tuple[list[str | TextPair], bool]:
    """TEI's PredictInput as (texts or pairs, whether it was one input)."""

    def sequence(value: list[str]) -> str | TextPair:
        return value[0] if len(value) == 1 else TextPair.model_construct(text_a=value[0], text_b=value[1])

    if isinstance(inputs, str):
        return [inputs], True
    if isinstance(inputs[0], str):  # one text or one pair
        return [sequence(inputs)], True
    return [sequence(v) for v in inputs], False


def tei_scores(logits: list[float], raw: bool) -> list[float]:
    """TEI's predict: the logits, or softmax over labels (sigmoid for one label)."""
    if raw:
        return logits
    if len(logits) == 1:
        return [0.5 * (1.0 + math.tanh(logits[0] / 2))]  # sigmoid, without overflow
    top = max(logits)
    exps = [math.exp(x - top) for x in logits]
    total = sum(exps)
    return [e / total for e in exps]


def _best_first(entries: list[dict]) -> list[dict]:
    """TEI sorts ascending (stable) and reverses: equal scores end in reverse input order."""
    return sorted(entries, key=lambda e: e["score"])[::-1]


async def predict(svc: Service, req: PredictRequest) -> list:
    items, single = _predict_inputs(req.inputs)
    outcome = await _infer(
        svc,
        "classify",
        req.model or svc.settings.predict_model,
        items,
        _prepare_predict,
        req.truncate,
        req.truncation_direction,
        req.top_k,
        svc.settings.max_label_scores,
        params={"scoring": "logits" if req.raw_scores else "tei"},
        route="/predict",
    )
    out = [
        _best_first([{"score": s, "label": name} for s, name in zip(scores, names)])
        for scores, names in label_scores(outcome)
    ]
    return out[0] if single else out


def _prepare_predict(
    lm: LoadedModel, items: list, truncate: bool | None, direction: str, top_k: int | None, limit: int
) -> tuple[list[Row], dict]:
    return _encode(lm, items, truncate, direction), {"top_k": scores_per_input(lm, top_k, limit)}


# -- /rerank -----------------------------------------------------------------------------------


async def rerank(svc: Service, req: RerankRequest) -> list[dict]:
    name = req.model or svc.settings.rerank_model
    if await colbert_pipeline.is_late(svc, name, "/rerank"):  # a ColBERT ranks by MaxSim
        return await colbert_pipeline.rerank(svc, req, name)
    outcome = await _infer(
        svc,
        "classify",
        name,
        req.texts,
        _prepare_rerank,
        req.query,
        req.truncate,
        req.truncation_direction,
        svc.check_request_tokens,  # the bound; _infer charges the rows once
        params={"logits": True},
        route="/rerank",
    )
    ranks = []
    for index, logits in enumerate(outcome.results):
        rank: dict[str, int | float | str] = {"index": index, "score": tei_scores(logits, req.raw_scores)[0]}
        if req.return_text:
            rank["text"] = req.texts[index]
        ranks.append(rank)
    return _best_first(ranks)


def _prepare_rerank(
    lm: LoadedModel, texts: list[str], query: str, truncate: bool | None, direction: str, check_tokens
) -> tuple[list[Row], dict]:
    """One (query, text) row per text, as encode() of the pairs would make them, with the query tokenized
    once. The tokens before truncation (the query once, and every text) count against
    BERT_MAX_REQUEST_TOKENS as they are tokenized, so a huge query is refused before any pairing."""
    if lm.config.num_labels != 1:
        raise ServiceError(
            "validation",
            f"model '{lm.name}' is not a re-ranker: /rerank needs a sequence classifier "
            f"with one label (a cross-encoder), and it has {lm.config.num_labels}",
        )
    tok, counted = lm.tokenizer, "before truncation: the query once and every text"
    query_ids = tok.token_ids(query)
    total = len(query_ids)
    check_tokens(total, counted)
    rows = []
    for i, text in enumerate(texts):
        check_dropped()
        text_ids = tok.token_ids(text)
        total += len(text_ids)
        check_tokens(total, counted)
        row = tok.pair_from_ids(query_ids, text_ids, lm.max_length if truncate else None, direction.lower())
        if len(row["input_ids"]) > lm.max_length:
            raise too_long(lm, i, len(row["input_ids"]))
        rows.append((row["input_ids"], row["token_type_ids"]))
    return rows, {}


# -- /tokenize ---------------------------------------------------------------------------------


async def tokenize(svc: Service, req: TokenizeRequest) -> list[list[dict]]:
    lm = await svc.loaded_model(req.model, None, "/tokenize")
    texts, _ = as_list(req.inputs)
    svc.check_count(len(texts))
    tokens = await svc.off_loop(_tokenize, lm, texts, req.add_special_tokens, req.prompt_name)
    svc.check_tokens(sum(len(t) for t in tokens))
    return tokens


def _tokenize(lm: LoadedModel, texts: list[str], add_special_tokens: bool, prompt_name: str | None) -> list:
    prompt = prompt_text(lm, prompt_name, None)
    backend = lm.tokenizer.backend_tokenizer
    out = []
    for text in texts:
        check_dropped()
        text = prompt + text  # offsets are the prompted text's, as TEI's
        enc = encode_one(backend, text, add_special_tokens=add_special_tokens)
        out.append(
            [
                {"id": i, "text": token, "special": True, "start": None, "stop": None}
                if special
                else {"id": i, "text": text[start:stop], "special": False, "start": start, "stop": stop}
                for i, (start, stop), special, token in zip(enc.ids, enc.offsets, enc.special_tokens_mask, enc.tokens)
            ]
        )
    return out


# -- /embed_sparse, /embed_all, /decode -------------------------------------------------------------


async def embed_sparse(svc: Service, req: EmbedSparseRequest) -> list[list[dict]]:
    params = {"threshold": req.threshold, "top_k": req.top_k}
    limit = svc.settings.max_answer_values
    outcome = await _infer(svc, "sparse_encode", req.model, req.inputs, _prepare_sparse, req, limit, params=params)
    return await svc.off_loop(_sparse_answer, outcome.lm, outcome.results, req.return_tokens)


def _prepare_sparse(lm: LoadedModel, texts: list[str], req: EmbedSparseRequest, limit: int) -> tuple[list[Row], dict]:
    """The rows, once the model pools by SPLADE (its files say so, or the request) and the answer's most
    entries (inputs x the vocabulary, or x top_k) are within `limit`."""
    if lm.sentence_modules.splade is None and req.pooling is None:
        why = f"its files cannot say: {lm.embedding_error}" if lm.embedding_error else "/embed pools its embeddings"
        raise ServiceError(
            "validation",
            f'model \'{lm.name}\' is not a SPLADE model ({why}); send "pooling": "splade" to pool its '
            "masked-LM logits so anyway",
        )
    vocab = lm.config.vocab_size
    per_input = min(req.top_k or vocab, vocab)
    if len(texts) * per_input > limit:
        which = "top_k" if per_input < vocab else "the vocabulary's tokens"
        raise ServiceError(
            "validation",
            f"the answer may hold {len(texts) * per_input:,} entries ({len(texts)} inputs x {per_input:,}, {which}), "
            f"more than the {limit:,} BERT_MAX_ANSWER_VALUES allows; send fewer inputs or a smaller top_k",
        )
    return _encode(lm, _prompted(lm, texts, req.prompt_name), req.truncate, req.truncation_direction), {}


def _prompted(lm: LoadedModel, texts: list[str], prompt_name: str | None) -> list[str]:
    prompt = prompt_text(lm, prompt_name, None)
    return [prompt + text for text in texts] if prompt else texts


def _sparse_answer(lm: LoadedModel, results: list, return_tokens: bool) -> list[list[dict]]:
    """TEI's SparseValue lists, each entry's vocabulary token beside it with return_tokens."""
    if not return_tokens:
        return [[{"index": i, "value": v} for i, v in zip(indices, values)] for indices, values in results]
    tok = lm.tokenizer
    return [
        [{"index": i, "value": v, "token": t} for i, v, t in zip(indices, values, tok.convert_ids_to_tokens(indices))]
        for indices, values in results
    ]


async def embed_all(svc: Service, req: EmbedAllRequest) -> list[list[list[float]]]:
    limit = svc.settings.max_answer_values
    outcome = await _infer(svc, "token_encode", req.model, req.inputs, _prepare_embed_all, req, limit)
    return outcome.results


def _prepare_embed_all(lm: LoadedModel, texts: list[str], req: EmbedAllRequest, limit: int) -> tuple[list[Row], dict]:
    """The rows, once their tokens x the hidden size are within `limit` numbers."""
    rows = _encode(lm, _prompted(lm, texts, req.prompt_name), req.truncate, req.truncation_direction)
    tokens, hidden = sum(len(ids) for ids, _ in rows), lm.config.hidden_size
    if tokens * hidden > limit:
        raise ServiceError(
            "validation",
            f"the answer would hold {tokens * hidden:,} numbers ({tokens:,} tokens x {hidden} hidden size), more "
            f"than the {limit:,} BERT_MAX_ANSWER_VALUES allows; send fewer or shorter inputs",
        )
    return rows, {}


async def decode(svc: Service, req: DecodeRequest) -> list[str]:
    lm = await svc.loaded_model(req.model, None, "/decode")
    batch = req.ids if req.ids and isinstance(req.ids[0], list) else [req.ids]
    svc.check_count(len(batch))
    svc.check_tokens(sum(len(ids) for ids in batch))
    return await svc.off_loop(_decode, lm, batch, req.skip_special_tokens)


def _decode(lm: LoadedModel, batch: list[list[int]], skip_special_tokens: bool) -> list[str]:
    vocab = lm.tokenizer.vocab_size
    for i, ids in enumerate(batch):
        if ids and max(ids) >= vocab:
            raise ServiceError(
                "validation",
                f"ids {i}: {max(ids)} is not a token id of model '{lm.name}', whose vocabulary has "
                f"{vocab:,} tokens (ids 0 to {vocab - 1:,})",
            )
    return [lm.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens) for ids in batch]


# route -> (request type, its handler)
ROOT_ROUTES: dict[str, tuple[type[BaseModel], Callable[[Service, Any], Awaitable[list]]]] = {
    "/embed": (EmbedRequest, embed),
    "/embed_sparse": (EmbedSparseRequest, embed_sparse),
    "/similarity": (SimilarityRequest, similarity),
    "/predict": (PredictRequest, predict),
    "/rerank": (RerankRequest, rerank),
}
