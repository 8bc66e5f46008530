"""Embeddings: /embeddings, /v1/embeddings and (through app/serving/tei_compat.py) TEI's /embed and
/similarity, with the options they share, applied by an `EmbedPlan` made per request.

- prompts (sentence-transformers' `encode(prompt_name=, prompt=)`): the prompt text is put before each
  input before it is tokenised, so its tokens count like the input's. `prompt_name` names one of the
  model's config_sentence_transformers.json prompts (model.model_dir.read_prompts); none named, its
  default_prompt_name's prompt, if any; `prompt` is a literal one.
- dimensions (OpenAI's `dimensions`, sentence-transformers' `truncate_dim`, Matryoshka embeddings):
  the first N components of the pooled vector, L2-normalised after the cut if the request normalises.
- long_inputs: "error" (422), "truncate" (cut at the model's window) or "chunk": the input's tokens
  are cut into windows of max_length - 2 tokens between [CLS] and [SEP], each repeating the last
  CHUNK_OVERLAP (a quarter) of the one before (127 tokens at max_length 512), the last one shorter;
  each window is a row of the same work item, so the engine batches them as any rows, and the
  input's vector is the mean of its windows' pooled vectors weighted by each window's length in
  tokens ([CLS] and [SEP] included), normalised after. Every window's tokens count against
  BERT_MAX_REQUEST_TOKENS before the engine sees any.
With dimensions or chunking the engine pools without normalising and `EmbedPlan.finish` (off the event
loop) averages, cuts and normalises; otherwise the engine's vectors are the answer, as they always were.
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from app.errors import ServiceError
from app.schemas import EmbeddingsRequest, OpenAIEmbeddingsRequest
from app.serving.model_registry import LoadedModel
from app.serving.pipelines import Row, _infer, encode
from app.serving.service import Service, check_dropped
from model.tokenizer import window_count

CHUNK_OVERLAP = 0.25  # of a window's content tokens, repeated at the start of the next window
CHUNKED = "every window of every input, [CLS] and [SEP] included"  # what the token bound counts


@dataclass
class EmbedPlan:
    """One request's embedding options: `prepare` makes its rows (in the thread pool), `finish` its vectors."""

    normalize: bool
    long_inputs: str  # "error", "truncate" or "chunk"
    dimensions: int | None = None
    prompt_name: str | None = None
    prompt: str | None = None
    check_tokens: Callable[[int, str], None] | None = None  # the service's, for chunked requests
    # encode(lm, texts, truncate) for "error" and "truncate" (TEI's /embed passes one that cuts either end)
    encode: Callable[[LoadedModel, list, bool], list[Row]] = encode
    windows: list[list[int]] = field(default_factory=list)  # per input: its rows' lengths (set by prepare)

    @classmethod
    def of(cls, truncate: bool | None, long_inputs: str | None, **options) -> EmbedPlan:
        """`long_inputs`, or truncate's choice when it is omitted; truncate: true with another is a 422."""
        if truncate and long_inputs not in (None, "truncate"):
            raise ServiceError(
                "validation", f'"truncate": true and "long_inputs": "{long_inputs}" disagree; send one of them'
            )
        return cls(long_inputs=long_inputs or ("truncate" if truncate else "error"), **options)

    @property
    def engine_params(self) -> dict:
        """The engine normalises only when nothing is left to do after it."""
        return {"normalize": self.normalize and not self.finishes}

    @property
    def finishes(self) -> bool:
        return self.dimensions is not None or self.long_inputs == "chunk"

    def prepare(self, lm: LoadedModel, texts: list[str]) -> tuple[list[Row], dict]:
        """The rows (one per input, or one per window when chunking), prompts put before the texts."""
        self._check_dimensions(lm)
        prompt = prompt_text(lm, self.prompt_name, self.prompt)
        texts = [prompt + text for text in texts] if prompt else texts
        if self.long_inputs != "chunk":
            rows = self.encode(lm, texts, self.long_inputs == "truncate")
            self.windows = [[len(ids)] for ids, _ in rows]
            return rows, {}
        return self._chunk(lm, texts), {}

    def _check_dimensions(self, lm: LoadedModel) -> None:
        size = lm.config.hidden_size
        if self.dimensions is not None and not 1 <= self.dimensions <= size:
            raise ServiceError(
                "validation",
                f"dimensions must be from 1 to {size} (model '{lm.name}' makes {size}-dimensional "
                f"embeddings), got {self.dimensions}",
            )

    def _chunk(self, lm: LoadedModel, texts: list[str]) -> list[Row]:
        """Each text's windows as rows; their tokens together are checked before any row is made."""
        tok, room = lm.tokenizer, lm.max_length - 2  # content tokens per window, besides [CLS] and [SEP]
        overlap = int(room * CHUNK_OVERLAP)
        step = room - overlap
        token_ids = []
        for text in texts:
            check_dropped()
            token_ids.append(tok.token_ids(text))
        self.windows = [
            [min(room, len(ids) - i * step) + 2 for i in range(window_count(len(ids), room, overlap))]
            for ids in token_ids
        ]
        if self.check_tokens is not None:
            self.check_tokens(sum(map(sum, self.windows)), CHUNKED)
        cls, sep = tok.cls_token_id, tok.sep_token_id
        rows = []
        for ids, lengths in zip(token_ids, self.windows):
            for i, n in enumerate(lengths):
                window = [cls, *ids[i * step : i * step + n - 2], sep]
                rows.append((window, [0] * len(window)))
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
            if self.normalize:
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
    svc: Service, model: str | None, inputs, plan: EmbedPlan, pooling: str = "mean", route: str | None = None
) -> tuple[Any, int, LoadedModel]:
    """(one vector per input, or the vector of a single input; the tokens run; the model)."""
    plan.check_tokens = svc.check_tokens
    outcome = await _infer(
        svc,
        "encode",
        model,
        inputs,
        plan.prepare,
        params={"pooling": pooling, **plan.engine_params},
        route=route,
    )
    vectors = await svc.off_loop(plan.finish, outcome.results) if plan.finishes else outcome.results
    return outcome.answer(vectors), sum(len(ids) for ids, _ in outcome.rows), outcome.lm


async def embeddings(svc: Service, req: EmbeddingsRequest) -> Any:
    plan = EmbedPlan.of(
        req.truncate,
        req.long_inputs,
        normalize=req.normalize,
        dimensions=req.dimensions,
        prompt_name=req.prompt_name,
        prompt=req.prompt,
    )
    vectors, _, _ = await embed(svc, req.model, req.inputs, plan, req.pooling)
    return vectors


async def openai_embeddings(svc: Service, req: OpenAIEmbeddingsRequest) -> dict:
    plan = EmbedPlan.of(None, req.long_inputs, normalize=True, dimensions=req.dimensions, prompt_name=req.prompt_name)
    vectors, tokens, lm = await embed(svc, req.model, req.input, plan)
    vectors = vectors if isinstance(req.input, list) else [vectors]
    if req.encoding_format == "base64":
        vectors = [base64.b64encode(np.asarray(v, dtype="<f4").tobytes()).decode() for v in vectors]
    return {
        "object": "list",
        "model": lm.name,
        "data": [{"object": "embedding", "embedding": v, "index": i} for i, v in enumerate(vectors)],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
