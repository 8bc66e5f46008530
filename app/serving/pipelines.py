"""Request -> tokens -> engine work item -> response, for each task.

Every route goes through `_infer`: the model (with the head its task needs), the inputs as a list,
the count limit, preparing the rows off the event loop, then one work item on the engine's
inference thread (`_infer_many`: several requests' inputs as one work item, each request with its
own checks, errors and results, as the embedding routes run a batch's lines). Each route's function
adds only what differs: its checks and options while preparing, and the shape of its answer. Tokenising and decoding run in the service's thread pool;
the forward pass in the engine's inference thread; only awaiting happens on the event loop.
fill-mask answers in the shape of transformers' FillMaskPipeline (postprocess: scores from a
full-vocabulary softmax, `sequence` decoded with special tokens skipped only when the input has a
single mask). A request's cost is checked once it is tokenised, before it reaches the engine: its
tokens (BERT_MAX_REQUEST_TOKENS) and, for fill-mask, masks per input and candidates per request;
each candidate's `sequence` splices the candidate into the input decoded once per mask.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from app.errors import ServiceError
from app.schemas.classify import ClassifyRequest
from app.schemas.fill_mask import FillMaskRequest
from app.schemas.nsp import NspRequest
from app.schemas.shared import TextPair
from app.serving.engine import WorkItem
from app.serving.service import Service, WorkDropped, check_dropped
from app.serving.stored_models import LoadedModel
from app.settings import Settings
from worker.telemetry import tracing

Row = tuple[list[int], list[int]]  # (input_ids, token_type_ids)
_UNLIMITED = 10**9


# engine task -> (the head it needs, the route named when a model lacks it)
TASKS = {
    "encode": (None, "/embeddings"),
    "mlm": ("mlm", "/fill-mask"),
    "nsp": ("nsp", "/nsp"),
    "classify": ("classifier", "/classify"),
    "token_classify": ("token_classifier", "/token-classification"),
    "qa": ("qa", "/question-answering"),
    "sparse_encode": ("mlm", "/embed_sparse"),
    "token_encode": (None, "/embed_all"),
    "late_interaction": (None, "/embed_multi"),  # a ColBERT's (app/serving/colbert_pipeline.py checks it is one)
}


def encode(lm: LoadedModel, items: Sequence[str | TextPair], truncate: bool, first: int = 0) -> list[Row]:
    """Tokenise texts or pairs; too long for the model is a 422 unless `truncate`. Errors number the
    inputs from `first`. Stops between inputs once the request has gone (app/serving/service.py check_dropped)."""
    rows = []
    for i, item in enumerate(items, first):
        check_dropped()
        a, b = (item.text_a, item.text_b) if isinstance(item, TextPair) else (item, None)
        if truncate:
            enc = lm.tokenizer.encode(a, b, max_length=lm.max_length, truncation=True)
        else:
            enc = lm.tokenizer.encode(a, b, max_length=_UNLIMITED)
            if len(enc["input_ids"]) > lm.max_length:
                raise too_long(lm, i, len(enc["input_ids"]))
        rows.append((enc["input_ids"], enc["token_type_ids"]))
    return rows


def too_long(lm: LoadedModel, i: int, n: int) -> ServiceError:
    return ServiceError(
        "validation",
        f"input {i} is {n} tokens long, more than the {lm.max_length} model "
        f"'{lm.name}' takes; shorten it or send \"truncate\": true",
    )


def as_list(inputs) -> tuple[list, bool]:
    """(inputs as a list, whether the request sent a single input)."""
    return (inputs, False) if isinstance(inputs, list) else ([inputs], True)


@dataclass
class Outcome:
    """A work item's outcome, with what the route needs to shape its answer."""

    lm: LoadedModel
    rows: list[Row]
    results: list  # one per row, as the task's runner returned it (app/serving/forward.py)
    single: bool  # the request sent one input, not a list

    def answer(self, out: list) -> Any:
        """One result for one input, the list for a list."""
        return out[0] if self.single else out


def _tokenize(lm: LoadedModel, items: list, truncate: bool) -> tuple[list[Row], dict]:
    """The usual preparation: the rows, no extra options."""
    return encode(lm, items, truncate), {}


async def _infer(
    svc: Service,
    task: str,
    name: str | None,
    inputs,
    prepare: Callable,
    *args,
    params: dict | None = None,
    route: str | None = None,
) -> Outcome:
    """Run one request's inputs as a work item on model `name` (None: the route's default). `prepare(lm, items, *args)` runs in the thread pool
    and returns (rows, options to add to `params`). `route` names the route in errors when it is
    not the task's own."""
    (outcome,) = await _infer_many(
        svc, task, name, [(inputs, lambda lm, items: prepare(lm, items, *args))], params=params, route=route
    )
    if isinstance(outcome, Exception):
        raise outcome
    return outcome


async def _infer_many(
    svc: Service,
    task: str,
    name: str | None,
    requests: list[tuple[Any, Callable]],
    params: dict | None = None,
    route: str | None = None,
) -> list[Outcome | Exception]:
    """Run several requests of one model and task as one work item: each request is (inputs,
    prepare(lm, items)), checked and prepared on its own (a request's error is its own, in its place),
    all prepared in one thread-pool job; their rows run together and each gets its own results. So a
    batch's lines (app/serving/batch_jobs.py) cost one pipeline call, not one each. An error of them
    all (the model, a full queue, the engine) is raised. Preparing gives every request the same options."""
    head, task_route = TASKS[task]
    route = route or task_route
    with svc.incoming():
        lm = await svc.loaded_model(name, head, route)
        asked = [as_list(inputs) for inputs, _ in requests]
        errors: list[Exception | None] = [_checked(svc.check_count, len(items)) for items, _ in asked]
        todo = [i for i, error in enumerate(errors) if error is None]
        jobs = [(asked[i][0], requests[i][1]) for i in todo]
        if tracing.enabled():
            tracing.annotate(
                **{"bertserve.model": lm.name, "bertserve.version": lm.version, "bertserve.precision": lm.precision}
            )
        with tracing.span("tokenize"):
            prepared = dict(zip(todo, await svc.off_loop(_prepare_each, lm, jobs) if jobs else []))
        for i, p in prepared.items():
            errors[i] = p if isinstance(p, Exception) else _checked(svc.check_tokens, sum(len(ids) for ids, _ in p[0]))
    ready = {i: prepared[i] for i, error in enumerate(errors) if error is None}
    rows = [row for request_rows, _ in ready.values() for row in request_rows]
    options = next(iter(ready.values()))[1] if ready else {}
    if tracing.enabled():
        tracing.annotate(**{"bertserve.task": task, "bertserve.tokens": sum(len(ids) for ids, _ in rows)})
    assert all(o == options for _, o in ready.values()), "requests run together are prepared with the same options"
    results = await svc.run(WorkItem(task, lm, rows, {**(params or {}), **options})) if rows else []
    outcomes: list[Outcome | Exception] = []
    start = 0
    for i, (_, single) in enumerate(asked):
        if (error := errors[i]) is not None:
            outcomes.append(error)
            continue
        request_rows = ready[i][0]
        outcomes.append(Outcome(lm, request_rows, results[start : start + len(request_rows)], single))
        start += len(request_rows)
    return outcomes


def _checked(check: Callable, n: int) -> ServiceError | None:
    """A request's check (its count, its tokens): its error, or None."""
    try:
        check(n)
    except ServiceError as e:
        return e
    return None


def _prepare_each(lm: LoadedModel, requests: list[tuple[list, Callable]]) -> list:
    """In the thread pool: per request, its (rows, options), or its error."""
    out: list = []
    for items, prepare in requests:
        try:
            out.append(prepare(lm, items))
        except WorkDropped:
            raise
        except Exception as e:  # this request's: the others run
            out.append(e)
    return out


# -- fill-mask ---------------------------------------------------------------------------------


async def fill_mask(svc: Service, req: FillMaskRequest) -> Any:
    outcome = await _infer(
        svc,
        "mlm",
        req.model,
        req.inputs,
        _prepare_fill_mask,
        req.targets,
        req.truncate,
        req.top_k,
        svc.settings,
        params={"top_k": req.top_k},
    )
    return outcome.answer(await svc.off_loop(_format_fill_mask, outcome.lm, outcome.rows, outcome.results))


def _prepare_fill_mask(
    lm: LoadedModel, texts: list[str], targets: list[str] | None, truncate: bool, top_k: int, limits: Settings
) -> tuple[list[Row], dict]:
    """The rows, and the request's cost checked before any inference: masks per input, and
    candidates (inputs x masks x top_k), each answered and decoded, per request."""
    mask, name, masks, rows = lm.mask_token_id, lm.tokenizer.mask_token, 0, []
    for i, text in enumerate(texts):  # one at a time: an input over a limit stops the tokenising
        ((ids, types),) = encode(lm, [text], truncate, first=i)
        rows.append((ids, types))
        n = ids.count(mask)
        if n == 0:
            raise ServiceError("validation", f"input {i} has no {name} token; fill-mask needs at least one")
        if n > limits.max_masks_per_input:
            raise ServiceError(
                "validation",
                f"input {i} has {n} {name} tokens, more than the "
                f"{limits.max_masks_per_input} per input that "
                "BERT_MAX_MASKS_PER_INPUT allows",
            )
        masks += n
    target_ids = _target_ids(lm, targets) if targets is not None else None
    candidates = masks * min(top_k, len(target_ids) if target_ids else lm.tokenizer.vocab_size)
    if candidates > limits.max_fill_mask_candidates:
        raise ServiceError(
            "validation",
            f"the request asks for {candidates} candidates ({masks} {name} tokens x "
            f"top_k), more than the {limits.max_fill_mask_candidates} per request that "
            "BERT_MAX_FILL_MASK_CANDIDATES allows",
        )
    return rows, {"target_ids": target_ids}


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
            sequences = tok.decode_filled(ids, pos, token_ids, skip_special_tokens=single)
            answers.append(
                [
                    {
                        "score": score,
                        "token": token,
                        "token_str": tok.decode([token], skip_special_tokens=False),
                        "sequence": sequence,
                    }
                    for score, token, sequence in zip(scores, token_ids, sequences)
                ]
            )
        out.append(answers[0] if single else answers)
    return out


# -- nsp ---------------------------------------------------------------------------------------


async def nsp(svc: Service, req: NspRequest) -> Any:
    outcome = await _infer(svc, "nsp", req.model, req.inputs, _tokenize, req.truncate)
    return outcome.answer([{"is_next": s >= 0.5, "score": s} for s in outcome.results])


# -- classify ----------------------------------------------------------------------------------


async def classify(svc: Service, req: ClassifyRequest) -> Any:
    outcome = await _infer(
        svc,
        "classify",
        req.model,
        req.inputs,
        _prepare_classify,
        req.truncate,
        req.top_k,
        svc.settings.max_label_scores,
    )
    out = []
    for scores, names in label_scores(outcome):
        best = max(range(len(scores)), key=scores.__getitem__)
        out.append({"label": names[best], "score": scores[best], "scores": dict(zip(names, scores))})
    return outcome.answer(out)


def _prepare_classify(
    lm: LoadedModel, items: list, truncate: bool, top_k: int | None, limit: int
) -> tuple[list[Row], dict]:
    return encode(lm, items, truncate), {"top_k": scores_per_input(lm, top_k, limit)}


def scores_per_input(lm: LoadedModel, top_k: int | None, limit: int) -> int:
    """How many label scores each input gets: top_k (at most the labels), by default every label up to
    `limit` (BERT_MAX_LABEL_SCORES); asking for more than `limit` is a 422."""
    labels = lm.config.num_labels
    if top_k is None:
        return min(labels, limit)
    if min(top_k, labels) > limit:
        raise ServiceError(
            "validation",
            f"top_k: {top_k} label scores per input is more than the {limit} that BERT_MAX_LABEL_SCORES allows",
        )
    return min(top_k, labels)


def label_scores(outcome: Outcome) -> list[tuple[list[float], list[str]]]:
    """Each classified row's scores and the names of their labels: every label in id order, or the
    best few, best first (app/serving/forward.py run_classify with top_k)."""
    id2label = outcome.lm.config.id2label or {}
    out = []
    for result in outcome.results:
        scores, ids = result if isinstance(result, tuple) else (result, range(len(result)))
        out.append((scores, [id2label.get(i, f"LABEL_{i}") for i in ids]))
    return out
