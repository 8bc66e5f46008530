"""Embeddings: /embeddings, /v1/embeddings and (through app/serving/tei_compat.py) TEI's /embed and
/similarity, with the options they share, applied by an `EmbedPlan` made per request.

- pooling and normalize: a model embeds as its sentence-transformers modules say (LoadedModel.sentence_modules,
  read by model.sentence_modules: its Pooling, and whether it has a Normalize), so /embeddings answers what
  sentence-transformers' `encode` gives for the model's directory (one without modules.json: mean pooling,
  unit length). /embeddings' `pooling` ("mean" or "cls") and `normalize` override them when sent;
  /v1/embeddings is always unit length (OpenAI's contract), TEI's /embed normalises unless `normalize` is
  false (TEI's default) and /similarity always does (a cosine). The engine pools each work item as its
  params say (app/serving/forward.py run_encode), so requests run together as one work item
  (`_embed_each`) share their pooling, normalisation and prompt. An input's window is the model's
  (max_length), as for every route, not sentence_bert_config.json's max_seq_length.
- prompts (sentence-transformers' `encode(prompt_name=, prompt=)`): the prompt text is put before each
  input before it is tokenised, so its tokens count like the input's. `prompt_name` names one of the
  model's config_sentence_transformers.json prompts (model.model_dir.read_prompts); none named, its
  default_prompt_name's prompt, if any; `prompt` is a literal one.
- dimensions (OpenAI's `dimensions`, sentence-transformers' `truncate_dim`, Matryoshka embeddings):
  the first N components of the pooled vector, L2-normalised after the cut when normalising.
- long_inputs: "error" (422), "truncate" (cut at the model's window) or "chunk": the input's tokens
  are cut into windows of max_length - 2 tokens between [CLS] and [SEP], each repeating the last
  CHUNK_OVERLAP (a quarter) of the one before (127 tokens at max_length 512), the last one shorter;
  each window is a row of the same work item, so the engine batches them as any rows, and the
  input's vector is the mean of its windows' pooled vectors weighted by each window's length in
  tokens ([CLS] and [SEP] included), normalised after. Every window's tokens count against
  BERT_MAX_REQUEST_TOKENS before the engine sees any, and are charged to the request's key once.
With dimensions or chunking the engine pools without normalising and `EmbedPlan.finish` (off the event
loop) averages, cuts and normalises; otherwise the engine's vectors are the answer, as they always were.

`BackgroundEmbedder` embeds many texts for a job of the API (mining hard negatives, app/jobs/mining.py) as a
batch's lines are embedded: requests of /embeddings' own shape ("truncate": true) through one lane of the
engine, after every online request.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from app.errors import ServiceError
from app.keys.limits import CALLER
from app.schemas.embeddings import EmbeddingsRequest, OpenAIEmbeddingsRequest
from app.serving.forward import REQUEST_POOLINGS
from app.serving.pipelines import Outcome, Row, _infer_many, encode
from app.serving.service import LANE, Lane, Service, check_dropped
from app.serving.stored_models import LoadedModel
from model.tokenizer import SPECIAL_TOKENS_IN_ONE_TEXT, window_count, with_special_tokens

CHUNK_OVERLAP = 0.25  # of a window's content tokens, repeated at the start of the next window
_OPTIONS = ("normalize", "pooling", "dimensions", "prompt_name", "prompt")  # EmbedPlan fields a request may set
CHUNKED = "every window of every input, [CLS] and [SEP] included"  # what the token bound counts


@dataclass
class EmbedPlan:
    """One request's embedding options: `prepare` makes its rows (in the thread pool), `finish` its vectors."""

    long_inputs: str  # "error", "truncate" or "chunk"
    normalize: bool | None = None  # None: as the model's Normalize module (SentenceModules.normalize)
    pooling: str | None = None  # "mean" or "cls" (forward.REQUEST_POOLINGS); None: the model's Pooling
    dimensions: int | None = None
    prompt_name: str | None = None
    prompt: str | None = None
    check_tokens: Callable[[int, str], None] | None = None  # the service's bound, for chunked requests
    # encode(lm, texts, truncate) for "error" and "truncate" (TEI's /embed passes one that cuts either end)
    encode: Callable[[LoadedModel, list, bool], list[Row]] = encode
    windows: list[list[int]] = field(default_factory=list)  # per input: its rows' lengths (set by prepare)
    unit_length: bool = False  # whether `finish` normalises: `normalize`, or the model's (set by prepare)

    @classmethod
    def of(cls, req: Any, **options) -> EmbedPlan:
        """The plan of a request's embedding options: those of its fields it has (`truncate`, `long_inputs`,
        `normalize`, `dimensions`, `prompt_name`, `prompt`), and `options` for the rest. `long_inputs`, or
        truncate's choice when it is omitted; truncate: true with another is a 422."""
        declared = type(req).model_fields
        truncate = req.truncate if "truncate" in declared else None
        long_inputs = req.long_inputs if "long_inputs" in declared else None
        if truncate and long_inputs not in (None, "truncate"):
            raise ServiceError(
                "validation", f'"truncate": true and "long_inputs": "{long_inputs}" disagree; send one of them'
            )
        fields = {name: getattr(req, name) for name in _OPTIONS if name in declared}
        return cls(long_inputs=long_inputs or ("truncate" if truncate else "error"), **{**fields, **options})

    @property
    def engine_params(self) -> dict:
        """What the engine's run_encode is asked: the pooling, and normalising (None: as the model does)
        only when nothing is left to do after it."""
        return {"pooling": self.pooling, "normalize": False if self.finishes else self.normalize}

    @property
    def group_key(self) -> tuple:
        """Plans with equal keys may run as one work item (`_embed_each`): the same engine params, and the same
        prompt, whose length a model's pooling may leave out (`prepare`'s prompt_length)."""
        return (*sorted(self.engine_params.items()), self.prompt_name, self.prompt)

    @property
    def finishes(self) -> bool:
        return self.dimensions is not None or self.long_inputs == "chunk"

    def prepare(self, lm: LoadedModel, texts: list[str]) -> tuple[list[Row], dict]:
        """The rows (one per input, or one per window when chunking), prompts put before the texts; and the
        engine option "prompt_length" when the model's pooling leaves the prompt out."""
        if lm.embedding_error is not None:
            raise ServiceError("validation", f"model '{lm.name}' cannot embed: {lm.embedding_error}")
        if lm.sentence_modules.splade is not None:
            raise ServiceError(
                "validation",
                f"model '{lm.name}' is a sparse (SPLADE) encoder: its embeddings hold one weight per vocabulary "
                f"token ({lm.config.vocab_size:,}), which POST /embed_sparse answers, not the dense embedding routes",
            )
        self._check_dimensions(lm)
        self.unit_length = lm.sentence_modules.normalize if self.normalize is None else self.normalize
        prompt = prompt_text(lm, self.prompt_name, self.prompt)
        texts = [prompt + text for text in texts] if prompt else texts
        options = self._prompt_options(lm, prompt)
        if self.long_inputs != "chunk":
            rows = self.encode(lm, texts, self.long_inputs == "truncate")
            self.windows = [[len(ids)] for ids, _ in rows]
            return rows, options
        return self._chunk(lm, texts), options

    def _prompt_options(self, lm: LoadedModel, prompt: str) -> dict:
        """{"prompt_length": n} when the model's own pooling leaves out a prompt (include_prompt false): [CLS]
        and the prompt's tokens, as sentence-transformers counts them (the prompt tokenised alone, less its
        [SEP]). Chunking with it is a 422: only an input's first window starts with the prompt."""
        if not prompt or self.pooling is not None or lm.sentence_modules.pooling.include_prompt:
            return {}
        if self.long_inputs == "chunk":
            raise ServiceError(
                "validation",
                f"model '{lm.name}' pools without its prompt's tokens (include_prompt false), and only an input's "
                'first window holds the prompt: send "long_inputs": "chunk" without a prompt, or another long_inputs',
            )
        return {"prompt_length": len(lm.tokenizer.token_ids(prompt)) + 1}

    def dimension(self, lm: LoadedModel) -> int:
        """The size of this plan's pooled vectors on model `lm` (several pooling modes make them longer)."""
        pooling = REQUEST_POOLINGS[self.pooling] if self.pooling else lm.sentence_modules.pooling
        return pooling.dimension(lm.config.hidden_size)

    def _check_dimensions(self, lm: LoadedModel) -> None:
        size = self.dimension(lm)
        if self.dimensions is not None and not 1 <= self.dimensions <= size:
            raise ServiceError(
                "validation",
                f"dimensions must be from 1 to {size} (model '{lm.name}' makes {size}-dimensional "
                f"embeddings), got {self.dimensions}",
            )

    def _chunk(self, lm: LoadedModel, texts: list[str]) -> list[Row]:
        """Each text's windows as rows; their tokens together are checked before any row is made."""
        tok, room = lm.tokenizer, lm.max_length - SPECIAL_TOKENS_IN_ONE_TEXT  # content tokens per window
        overlap = int(room * CHUNK_OVERLAP)
        step = room - overlap
        token_ids = []
        for text in texts:
            check_dropped()
            token_ids.append(tok.token_ids(text))
        self.windows = [
            [
                min(room, len(ids) - i * step) + SPECIAL_TOKENS_IN_ONE_TEXT
                for i in range(window_count(len(ids), room, overlap))
            ]
            for ids in token_ids
        ]
        if self.check_tokens is not None:
            self.check_tokens(sum(map(sum, self.windows)), CHUNKED)
        rows = []
        for ids, lengths in zip(token_ids, self.windows):
            for i, n in enumerate(lengths):
                content = ids[i * step : i * step + n - SPECIAL_TOKENS_IN_ONE_TEXT]
                rows.append(with_special_tokens(content, None, tok.cls_token_id, tok.sep_token_id))
        return rows

    def finish(self, results: list[list[float]]) -> list[list[float]]:
        """Per input: its windows' vectors averaged (weighted by their lengths), cut, normalised."""
        if not self.finishes:
            return results
        out, start = [], 0
        for lengths in self.windows:
            vectors = np.asarray(results[start : start + len(lengths)], dtype=np.float64)
            start += len(lengths)
            vector = np.average(vectors, axis=0, weights=lengths)[: self.dimensions]
            if self.unit_length:
                vector = vector / max(float(np.linalg.norm(vector)), 1e-12)  # as torch's F.normalize
            out.append(vector.tolist())
        return out


def prompt_text(lm: LoadedModel, prompt_name: str | None, prompt: str | None) -> str:
    """The text put before each input: `prompt`, the model's prompt `prompt_name`, or its default's."""
    if prompt is not None:
        if prompt_name is not None:
            raise ServiceError("validation", "send prompt_name or prompt, not both")
        return prompt
    if prompt_name is None:
        return lm.prompts[lm.default_prompt_name] if lm.default_prompt_name else ""
    if not lm.prompts:
        raise ServiceError(
            "validation",
            f"prompt_name '{prompt_name}' is not supported: model '{lm.name}' has no "
            "prompts; put the prompt at the start of the text instead",
        )
    if prompt_name not in lm.prompts:
        raise ServiceError(
            "validation",
            f"prompt_name '{prompt_name}' is not a prompt of model '{lm.name}'; its prompts: "
            f"{', '.join(sorted(lm.prompts))}",
        )
    return lm.prompts[prompt_name]


async def embed(
    svc: Service, model: str | None, inputs, plan: EmbedPlan, route: str | None = None
) -> tuple[Any, int, LoadedModel]:
    """(one vector per input, or the vector of a single input; the tokens run; the model)."""
    (answer,) = await embed_many(svc, model, [(inputs, plan)], route)
    if isinstance(answer, Exception):
        raise answer
    return answer


async def embed_many(
    svc: Service,
    model: str | None,
    requests: list[tuple[Any, EmbedPlan]],
    route: str | None = None,
) -> list[tuple[Any, int, LoadedModel] | Exception]:
    """`embed` for several requests of one model whose plans have one group_key (the same engine params and
    prompt), as one work item (pipelines._infer_many): per request its answer, or its error in its place."""
    for _, plan in requests:
        plan.check_tokens = svc.check_request_tokens  # the bound; _infer_many charges the rows once
    outcomes = await _infer_many(
        svc,
        "encode",
        model,
        [(inputs, plan.prepare) for inputs, plan in requests],
        params=requests[0][1].engine_params,
        route=route,
    )
    finishing = [
        (i, plan, o.results)
        for i, ((_, plan), o) in enumerate(zip(requests, outcomes))
        if isinstance(o, Outcome) and plan.finishes
    ]
    finished = (
        await svc.off_loop(_finish_each, [(plan, results) for _, plan, results in finishing]) if finishing else []
    )
    vectors: dict[int, list] = {i: v for (i, _, _), v in zip(finishing, finished)}
    return [
        o
        if isinstance(o, Exception)
        else (o.answer(vectors.get(i, o.results)), sum(len(ids) for ids, _ in o.rows), o.lm)
        for i, o in enumerate(outcomes)
    ]


def _finish_each(finishing: list[tuple[EmbedPlan, list]]) -> list[list[list[float]]]:
    return [plan.finish(results) for plan, results in finishing]


async def _embed_each(
    svc: Service, requests: list[tuple[str | None, Any, EmbedPlan | ServiceError]]
) -> list[tuple[Any, int, LoadedModel] | Exception]:
    """Requests (model, inputs, plan or its error), those of one model and group_key run together as one
    work item each (embed_many): per request its answer or its error, in order."""
    groups: dict[tuple, list[tuple[int, Any, EmbedPlan]]] = {}
    for i, (model, inputs, plan) in enumerate(requests):
        if isinstance(plan, EmbedPlan):
            groups.setdefault((model, *plan.group_key), []).append((i, inputs, plan))
    answers: list = [plan for _, _, plan in requests]

    async def run(model: str | None, members: list[tuple[int, Any, EmbedPlan]]) -> None:
        try:
            outs = await embed_many(svc, model, [(inputs, plan) for _, inputs, plan in members])
        except Exception as e:  # the group's (its model, a full queue, the engine): each of its requests'
            outs = [e] * len(members)
        for (i, _, _), out in zip(members, outs):
            answers[i] = out

    await asyncio.gather(*(run(key[0], members) for key, members in groups.items()))
    return answers


def _plan(req: Any, **options) -> EmbedPlan | ServiceError:
    """A request's plan (EmbedPlan.of), or its error in its place."""
    try:
        return EmbedPlan.of(req, **options)
    except ServiceError as e:
        return e


async def embeddings(svc: Service, req: EmbeddingsRequest) -> Any:
    return await _one(embeddings_many, svc, req)


async def embeddings_many(svc: Service, reqs: list[EmbeddingsRequest]) -> list:
    """/embeddings for several requests at once (a batch's lines): per request its answer or its error."""
    plans = [_plan(r) for r in reqs]
    answers = await _embed_each(svc, [(r.model, r.inputs, plan) for r, plan in zip(reqs, plans)])
    return [a if isinstance(a, Exception) else a[0] for a in answers]


async def openai_embeddings(svc: Service, req: OpenAIEmbeddingsRequest) -> dict:
    return await _one(openai_embeddings_many, svc, req)


async def openai_embeddings_many(svc: Service, reqs: list[OpenAIEmbeddingsRequest]) -> list:
    """/v1/embeddings for several requests at once (a batch's lines): per request its answer or its error."""
    plans = [_plan(r, normalize=True) for r in reqs]  # OpenAI's vectors are always unit length
    answers = await _embed_each(svc, [(r.model, r.input, plan) for r, plan in zip(reqs, plans)])
    return [a if isinstance(a, Exception) else _openai_answer(r, *a) for r, a in zip(reqs, answers)]


def _openai_answer(req: OpenAIEmbeddingsRequest, vectors: Any, tokens: int, lm: LoadedModel) -> dict:
    vectors = vectors if isinstance(req.input, list) else [vectors]
    if req.encoding_format == "base64":
        vectors = [base64.b64encode(np.asarray(v, dtype="<f4").tobytes()).decode() for v in vectors]
    return {
        "object": "list",
        "model": lm.name,
        "data": [{"object": "embedding", "embedding": v, "index": i} for i, v in enumerate(vectors)],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


async def _one(many: Callable, svc: Service, req: Any) -> Any:
    """A route's one request through its `many` function: its answer, or its error raised."""
    (answer,) = await many(svc, [req])
    if isinstance(answer, Exception):
        raise answer
    return answer


RETRY_S = 0.05  # a full engine or tokeniser queue (429): the request waits its turn, as a batch's line does


class BackgroundEmbedder:
    """Texts embedded for a job of the API: each request of `max_inputs` texts is embedded as /embeddings with
    "truncate": true embeds it (the model's own pooling, Normalize and prompts; `prompt_name`, `prompt`), and
    its rows go to the engine through this embedder's lane (LANE) as background work, after every online
    request, a quarter of the tokeniser queue at most, as a batch's lines do (app/serving/batch_jobs.py). No
    key is charged: the job's key was checked when it was made."""

    def __init__(self, service: Service):
        self.service = service
        settings = service.settings
        self.lane = Lane(service, max(1, settings.max_tokenizer_queue // 4), cut_rows=settings.batch_concurrency)

    async def embed(
        self, model: str, texts: list[str], prompt_name: str | None = None, prompt: str | None = None
    ) -> tuple[np.ndarray, int]:
        """((len(texts), D) float32 vectors, the version of the model that made them). A refusal of the
        requests (the model gone, a prompt it lacks) is raised; a full queue is waited out."""
        lane, caller = LANE.set(self.lane), CALLER.set(None)
        try:
            entry = await self.service.registry.lookup(model)
            positions = entry.config.max_position_embeddings if entry.config is not None else 512
            settings = self.service.settings
            size = max(1, min(settings.max_inputs, settings.max_request_tokens // positions))  # texts a request
            groups = [texts[i : i + size] for i in range(0, len(texts), size)]
            answers = await self._embed_groups(model, groups, prompt_name, prompt)
        finally:
            LANE.reset(lane)
            CALLER.reset(caller)
        versions = {lm.version for _, _, lm in answers}
        if len(versions) > 1:  # promoted while these ran: not one model's vectors
            raise ServiceError(
                "unavailable", f"model '{model}' changed (versions {sorted(versions)}) while it embedded"
            )
        vectors = np.asarray([v for vs, _, _ in answers for v in vs], dtype=np.float32)
        return vectors.reshape(len(texts), -1), versions.pop()

    async def _embed_groups(
        self, model: str, groups: list[list[str]], prompt_name: str | None, prompt: str | None
    ) -> list[tuple[Any, int, LoadedModel]]:
        answers: list = [None] * len(groups)
        todo = list(range(len(groups)))
        while todo:
            plans = [EmbedPlan("truncate", prompt_name=prompt_name, prompt=prompt) for _ in todo]
            try:
                outs = await embed_many(self.service, model, [(groups[i], plan) for i, plan in zip(todo, plans)])
            except ServiceError as e:  # the requests' together: the model, a full engine queue
                if e.error_type != "overloaded":
                    raise
                outs = [e] * len(todo)
            retry = []
            for i, out in zip(todo, outs):
                if isinstance(out, ServiceError) and out.error_type == "overloaded":
                    retry.append(i)
                elif isinstance(out, Exception):
                    raise out
                else:
                    answers[i] = out
            if todo := retry:
                await asyncio.sleep(RETRY_S)
        return answers
