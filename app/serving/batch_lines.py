"""A batch's input lines: the endpoints a batch may name (each with its route's request type, pipeline and
answer type), each line checked as its route checks its body, and a batch's input held small as it runs
(CheckedLines). app/serving/batch_jobs.py runs them.
"""

from __future__ import annotations

import array
import collections
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, TypeAdapter, ValidationError

from app.errors import ServiceError, suggest_fields
from app.schemas.classify import ClassifyRequest, ClassifyResponse
from app.schemas.embeddings import (
    EmbeddingsRequest,
    EmbeddingsResponse,
    OpenAIEmbeddingsRequest,
    OpenAIEmbeddingsResponse,
)
from app.schemas.fill_mask import FillMaskRequest, FillMaskResponse
from app.schemas.nsp import NspRequest, NspResponse
from app.schemas.openai_batches import BATCH_ENDPOINTS
from app.schemas.tei import RerankRequest, RerankResponse
from app.schemas.token_tasks import (
    QuestionAnsweringRequest,
    QuestionAnsweringResponse,
    TokenClassificationRequest,
    TokenClassificationResponse,
)
from app.serving import embed_pipeline, ner_pipeline, pipelines, qa_pipeline, tei_compat
from app.serving.service import Service


@dataclass(frozen=True)
class Endpoint:
    """What a line's body is checked with, what answers it, and how the route serialises the answer."""

    request: type[BaseModel]
    run: Callable[[Service, Any], Awaitable[Any]]
    response: TypeAdapter
    exclude_none: bool = False
    # The route's function for many requests at once (per request its answer or its error, in order): a
    # chunk's lines then cost one pipeline call, not one each. The route's `run` is it, for one request.
    run_many: Callable[[Service, list], Awaitable[list]] | None = None


ENDPOINTS: dict[str, Endpoint] = {
    "/v1/embeddings": Endpoint(
        OpenAIEmbeddingsRequest,
        embed_pipeline.openai_embeddings,
        TypeAdapter(OpenAIEmbeddingsResponse),
        run_many=embed_pipeline.openai_embeddings_many,
    ),
    "/embeddings": Endpoint(
        EmbeddingsRequest,
        embed_pipeline.embeddings,
        TypeAdapter(EmbeddingsResponse),
        run_many=embed_pipeline.embeddings_many,
    ),
    "/fill-mask": Endpoint(FillMaskRequest, pipelines.fill_mask, TypeAdapter(FillMaskResponse)),
    "/nsp": Endpoint(NspRequest, pipelines.nsp, TypeAdapter(NspResponse)),
    "/classify": Endpoint(ClassifyRequest, pipelines.classify, TypeAdapter(ClassifyResponse)),
    "/token-classification": Endpoint(
        TokenClassificationRequest,
        ner_pipeline.token_classification,
        TypeAdapter(TokenClassificationResponse),
        exclude_none=True,
    ),
    "/question-answering": Endpoint(
        QuestionAnsweringRequest, qa_pipeline.question_answering, TypeAdapter(QuestionAnsweringResponse)
    ),
    "/rerank": Endpoint(RerankRequest, tei_compat.rerank, TypeAdapter(RerankResponse), exclude_none=True),
}
assert tuple(ENDPOINTS) == BATCH_ENDPOINTS


@dataclass
class Line:
    """One input line: its request (checked), or why it cannot run."""

    index: int
    custom_id: str | None
    request: BaseModel | None = None
    error: tuple[str, str] | None = None  # (code, message)


class CheckedLines:
    """A batch's input as it was checked, held small: each line's byte offset and number, the errors found (a
    duplicate custom_id needs the whole file to tell), and how many lines name each model. Lines are parsed
    again a chunk at a time as they run (`lines[a:b]`), so a running batch holds the lines in flight and no
    more, whatever its size; the first `keep` parsed at the check are kept for the run that follows it."""

    def __init__(self, path: Path, endpoint: str, max_line_bytes: int):
        self.path, self.endpoint, self.max_line_bytes = path, endpoint, max_line_bytes
        self.offsets, self.numbers = array.array("q"), array.array("q")
        self.errors: dict[int, Line] = {}  # by position: the lines that cannot run, as they were found
        self.models: collections.Counter[str] = collections.Counter()  # lines naming each model
        self.refused: dict[str, str] = {}  # model -> why its lines fail (set by Batches.create, kept in params)
        self._kept: dict[int, Line] = {}

    @classmethod
    def scan(
        cls, path: Path, endpoint: str, max_line_bytes: int, max_lines: int | None = None, keep: int | None = 0
    ) -> CheckedLines:
        """Check every non-blank line (a 413 past `max_lines`); keep the first `keep` parsed (None: all)."""
        checked, seen, ep = cls(path, endpoint, max_line_bytes), set[str](), ENDPOINTS[endpoint]
        with open(path, "rb") as f:
            offset = 0
            for number, raw in enumerate(f, start=1):
                start, offset = offset, offset + len(raw)
                if not raw.strip():
                    continue
                if max_lines is not None and len(checked) == max_lines:
                    raise ServiceError(
                        "too_large", f"the file holds more than {max_lines} requests (BERT_BATCH_MAX_LINES)"
                    )
                line = _parse_line(number, raw, ep, endpoint, seen, max_line_bytes)
                position = len(checked)
                checked.offsets.append(start)
                checked.numbers.append(number)
                if line.error is not None:
                    checked.errors[position] = line
                elif isinstance(model := getattr(line.request, "model", None), str):
                    checked.models[model] += 1
                if keep is None or position < keep:
                    checked._kept[position] = line
        return checked

    def __len__(self) -> int:
        return len(self.offsets)

    @property
    def invalid(self) -> int:
        return len(self.errors) + sum(self.models[m] for m in self.refused)

    def __getitem__(self, part: slice) -> list[Line]:
        """The lines of `part` (a slice), parsed again from the file where they were not kept."""
        positions = range(*part.indices(len(self)))
        lines = [self._kept.pop(i, None) or self.errors.get(i) for i in positions]
        if any(line is None for line in lines):
            ep, seen = ENDPOINTS[self.endpoint], set[str]()  # its duplicates are among the errors already
            with open(self.path, "rb") as f:
                for k, i in enumerate(positions):
                    if lines[k] is None:
                        f.seek(self.offsets[i])
                        raw = f.readline()
                        lines[k] = _parse_line(self.numbers[i], raw, ep, self.endpoint, seen, self.max_line_bytes)
        found = [line for line in lines if line is not None]
        refuse(found, self.refused)
        return found


def _parse_line(number: int, raw: bytes, ep: Endpoint, endpoint: str, seen: set[str], max_bytes: int) -> Line:
    line = Line(number, None)
    if len(raw) > max_bytes:
        line.error = ("too_large", f"line {number} is {len(raw)} bytes, more than BERT_MAX_BODY_BYTES ({max_bytes})")
        return line
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        line.error = ("invalid_json", f"line {number} is not valid JSON")
        return line
    if not isinstance(data, dict):
        line.error = ("invalid_request", f"line {number} is not a JSON object")
        return line
    custom_id = data.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        line.error = ("missing_custom_id", f"line {number} has no custom_id (a non-empty string)")
        return line
    line.custom_id = custom_id
    if custom_id in seen:
        line.error = ("duplicate_custom_id", f"line {number}: custom_id {custom_id[:80]!r} is used by an earlier line")
        return line
    seen.add(custom_id)
    if data.get("method") != "POST":
        line.error = ("invalid_method", f'line {number}: method must be "POST"')
    elif data.get("url") != endpoint:
        line.error = (
            "mismatched_url",
            f"line {number}: url {str(data.get('url'))[:80]!r} is not the batch's endpoint {endpoint}",
        )
    else:
        try:
            line.request = ep.request.model_validate(data.get("body"))
        except ValidationError as e:
            where = "; ".join(
                f"{'.'.join(str(p) for p in err['loc']) or 'body'}: {err['msg']}"
                for err in suggest_fields(e.errors(include_url=False), ep.request)
            )
            line.error = ("invalid_body", f"line {number}: body: {where}")
    return line


def refuse(lines: list[Line], refused: dict[str, str]) -> None:
    """Each line naming a model of `refused` fails alone with the reason (a 403 of its route)."""
    for line in lines:
        model = getattr(line.request, "model", None)
        if line.error is None and model in refused:
            line.request, line.error = None, ("forbidden", f"line {line.index}: {refused[model]}")
