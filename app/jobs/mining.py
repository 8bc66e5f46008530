"""Hard negatives mined with a served embedding model, published as a new pairs dataset: a job of kind
"mine-negatives" that the API runs itself, as it runs batches (app/serving/batch_jobs.py).

POST /jobs checks and sizes it before anything is queued (`mining_spec`: the names, the key's rights, the
model's modules and prompts, and BERT_MINE_MAX_* against the datasets' meta.json); JobService writes the
record and `Mining` runs it in this process through datadir/runner.py (lease, heartbeat, the named
transitions), resuming at start every one no process runs. A run:

1. reads the dataset (and `corpus`) and plans what to embed (model/training/hard_negatives.py MiningPlan:
   sentence-transformers' rules for distinct anchors, corpus texts and positives);
2. embeds every distinct anchor, then every corpus text, through the batching engine as background work,
   as /embeddings embeds them (an injected embedder: app/serving/embed_pipeline.py BackgroundEmbedder, which
   this room may not import), CHUNK_TEXTS at a time: each chunk is appended to embeddings.f32 in the job's
   directory, fsynced, and only then counted in the record (progress.step: texts embedded), with AHEAD
   chunks embedding while one is written;
3. mines (exact cosine search) and writes the rows, anchors in first-seen order, as JSONL (anchor, positive,
   negative_1 .. negative_n), dropping those whose anchor got fewer than num_negatives (the reference's
   n-tuple output does);
4. publishes them as a pairs dataset through the upload's own checks, meta.json and atomic rename
   (app/jobs/uploads.py install_file): its owner the job's key, shared when that key is an admin, its size
   held to BERT_MAX_DATASET_BYTES and to the key's disk quota.

Crash safety: a new attempt cuts embeddings.f32 back to the rows counted and goes on after them; vectors from
another version of the model (promoted meanwhile) start the embedding over. Nothing is visible before the
install's rename, and the record notes the file's sha256 first, so an attempt that finds the dataset installed
(its process died between the rename and the record) succeeds without mining again. The embeddings file goes
when the job ends. A cancel is taken between chunks and before publishing; nothing is published then.

    params   {"name", "corpus", the options of MineNegativesParams (seed and prompts resolved), "shared",
              "dataset_sha256", "corpus_sha256"}
    estimate {"anchors", "corpus_texts", "dimension", "embedding_bytes", "candidate_bytes", "memory_bytes",
              "disk_bytes"}
    progress {"step": texts embedded, "total_steps", "anchors", "corpus", "dimension", "model_version",
              "published_sha256", "publishing"}
    result   {"dataset", "rows", "dropped", "anchors", "corpus", "num_negatives", "range_max"}

Reference: sentence-transformers 6.x, util/hard_negatives.py (mine_hard_negatives).
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import functools
import hashlib
import json
import logging
import os
import secrets
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from app.errors import ServiceError
from app.jobs.quota import check_room
from app.jobs.uploads import check_fields, install_file
from app.keys import ownership
from app.keys.keyfile import Key
from app.schemas.jobs import MineNegativesJobRequest
from app.settings import Settings
from datadir import TERMINAL, JobRecord, JobRecords, read_meta, runner
from datadir.datasets import dataset_file, staging_dir
from datadir.jobs import owner_of
from model.data.pairs import ANCHOR, POSITIVE, load_pairs
from model.data.retrieval_data import load_retrieval
from model.model_dir import read_prompts
from model.sentence_modules import read_sentence_modules
from model.sizing import format_bytes
from model.training.hard_negatives import MiningOptions, MiningPlan, mine, negative_columns

log = logging.getLogger("bertserve")

KIND = "mine-negatives"
EMBEDDINGS = "embeddings.f32"  # the vectors so far, float32 rows, in the job's directory
CHUNK_TEXTS = 512  # texts embedded, written and counted at once
AHEAD = 2  # chunks embedding while one is written
FLOAT32 = 4
CANDIDATE_BYTES = 24  # a candidate's float32 score and int64 row, and their sorted copies
ROW_CHARS = 24  # a mined row's JSON keys and quotes beside its texts, and per negative 16 more (disk estimate)
CORPUS_KINDS = ("pairs", "retrieval")
QUERY_PROMPT, CORPUS_PROMPT = "query", "document"  # the prompts encode_query and encode_document put first


class Embedder(Protocol):
    """Texts to (len(texts), D) float32 vectors and the version of the model that made them."""

    async def embed(
        self, model: str, texts: list[str], prompt_name: str | None = None, prompt: str | None = None
    ) -> tuple[np.ndarray, int]: ...


class JobFailed(Exception):
    """Why the job cannot be done, in words its record shows (the data or the request, not a bug)."""


# -- POST /jobs: the checks before anything is queued ----------------------------------------------------


async def mining_spec(req: MineNegativesJobRequest, caller: Key, settings: Settings, registry: Any) -> dict:
    """The record's spec for `req`, made by `caller`: 422 for what cannot run or is over a limit (with the
    numbers), 403 for a model or dataset the key may not use, 409 for a name taken. `registry`: the
    service's ModelRegistry (app/serving/model_registry.py)."""
    data_dir = settings.data_dir
    await asyncio.to_thread(check_fields, {"name": req.name}, data_dir)  # a plain, new name
    dataset = await asyncio.to_thread(_dataset, data_dir, req.dataset, "dataset", ("pairs",))
    ownership.check_dataset(caller, dataset)
    corpus = None
    if req.corpus is not None:
        corpus = await asyncio.to_thread(_dataset, data_dir, req.corpus, "corpus", CORPUS_KINDS)
        ownership.check_dataset(caller, corpus, field="corpus")
    try:
        entry = await registry.lookup(req.model)
    except ServiceError:
        raise ServiceError("validation", f"model: model '{req.model}' not found in DATA_DIR/models") from None
    ownership.check_model(caller, req.model, entry.access, field="model")
    if entry.error is not None:
        raise ServiceError("validation", f"model: model '{req.model}' cannot be used: {entry.error}")
    try:
        modules = await asyncio.to_thread(read_sentence_modules, entry.path)
        prompts, _ = await asyncio.to_thread(read_prompts, entry.path)
    except ValueError as e:
        raise ServiceError("validation", f"model: model '{req.model}' cannot embed: {e}") from None
    p = req.params
    chosen = {
        **_prompt(req.model, prompts, "query", p.query_prompt_name, p.query_prompt, QUERY_PROMPT),
        **_prompt(req.model, prompts, "corpus", p.corpus_prompt_name, p.corpus_prompt, CORPUS_PROMPT),
    }
    seed = p.seed if p.seed is not None else secrets.randbelow(2**31)  # kept: a restart draws the same
    estimate = _size(settings, dataset, corpus, p.options(seed), modules.pooling.dimension(entry.config.hidden_size))
    params = {
        "name": req.name,
        "corpus": req.corpus,
        **p.model_dump(exclude=set(chosen)),
        "seed": seed,
        **chosen,
        "shared": caller.is_admin,  # as an upload: an admin's dataset is every key's to train on
        "dataset_sha256": dataset["sha256"],
        "corpus_sha256": corpus["sha256"] if corpus is not None else None,
    }
    return {
        "kind": KIND,
        "model_name": "",  # it publishes no model
        "base_model": req.model,  # the model it embeds with: not deleted while the job runs (catalog.py)
        "dataset": req.dataset,
        "params": params,
        "estimate": estimate,
    }


def _dataset(data_dir: Path, name: str, field: str, kinds: tuple[str, ...]) -> dict:
    meta = read_meta(data_dir, name)
    if meta is None:
        raise ServiceError("validation", f"{field}: '{name}' not found (upload it with POST /datasets)")
    if meta["kind"] not in kinds:
        wanted = " or ".join(kinds)
        raise ServiceError(
            "validation", f"{field}: '{name}' is a {meta['kind']} dataset; a mining job needs a {wanted} one"
        )
    return meta


def _prompt(
    model: str, prompts: dict[str, str], side: str, name: str | None, text: str | None, usual: str
) -> dict[str, str | None]:
    """{side_prompt_name, side_prompt} as the run embeds with them: a literal prompt; the prompt named (one
    the model has); else the model's `usual` prompt, or none at all (not its default prompt): what
    sentence-transformers' encode_query and encode_document do, whose prompts always hold "query" and
    "document" (empty unless the model sets them)."""
    if name is not None and name not in prompts:
        has = f"its prompts: {', '.join(sorted(prompts))}" if prompts else "it has no prompts"
        raise ServiceError(
            "validation", f"params.{side}_prompt_name: '{name}' is not a prompt of model '{model}'; {has}"
        )
    if text is None and name is None:
        name, text = (usual, None) if usual in prompts else (None, "")
    return {f"{side}_prompt_name": name, f"{side}_prompt": text}


def _size(settings: Settings, dataset: dict, corpus: dict | None, options: MiningOptions, dimension: int) -> dict:
    """The job's size from the datasets' meta.json, against BERT_MINE_MAX_*: a 422 with the numbers."""
    rows, anchors = dataset["rows"], dataset["distinct_anchors"]
    if corpus is None:
        texts, what = rows * (1 + (dataset.get("negatives") or 0)), "its positives and negatives"
    elif corpus["kind"] == "pairs":
        texts, what = (
            corpus["rows"] * (1 + (corpus.get("negatives") or 0)) + rows,
            "the corpus's texts and the positives",
        )
    else:
        texts, what = corpus["documents"] + rows, "the corpus's documents and the positives"
    n, ranks = options.num_negatives, options.ranks()
    if n > settings.mine_max_negatives:
        raise ServiceError(
            "validation",
            f"params.num_negatives: {n} is more than this service allows ({settings.mine_max_negatives}, "
            "BERT_MINE_MAX_NEGATIVES)",
        )
    if ranks > settings.mine_max_range:
        how = (
            f"range_max {ranks}"
            if options.range_max is not None
            else f"range_min {options.range_min} + num_negatives {n}{' x 10, as a filter is set' * options.filters}"
        )
        raise ServiceError(
            "validation",
            f"params: the job would look {ranks} ranks deep ({how}), more than this service allows "
            f"({settings.mine_max_range}, BERT_MINE_MAX_RANGE)",
        )
    if anchors > settings.mine_max_anchors:
        raise ServiceError(
            "validation",
            f"dataset: '{dataset['name']}' has {anchors:,} distinct anchors, more than a mining job may embed "
            f"({settings.mine_max_anchors:,}, BERT_MINE_MAX_ANCHORS)",
        )
    if texts > settings.mine_max_corpus:
        raise ServiceError(
            "validation",
            f"corpus: {texts:,} texts to search ({what}), more than a mining job may embed "
            f"({settings.mine_max_corpus:,}, BERT_MINE_MAX_CORPUS)",
        )
    width = ranks + (rows - anchors + 1) + 1  # an anchor has at most rows - anchors + 1 positives
    embedding, candidates = (anchors + texts) * dimension * FLOAT32, anchors * width * CANDIDATE_BYTES
    limit = int(settings.mine_max_memory_gb * 1024**3)
    if embedding + candidates > limit:
        raise ServiceError(
            "validation",
            f"params: the job is too large: an estimated {format_bytes(embedding + candidates)} for its embeddings "
            f"({anchors + texts:,} texts x {dimension} dimensions, float32: {format_bytes(embedding)}) and "
            f"candidates ({anchors:,} anchors x {width} candidates: {format_bytes(candidates)}) is more than the "
            f"limit of {format_bytes(limit)} (BERT_MINE_MAX_MEMORY_GB)",
        )
    chars = dataset.get("mean_chars") or {}
    row = chars.get(ANCHOR, 0) + chars.get(POSITIVE, 0) * (1 + n) + ROW_CHARS + 16 * n
    return {
        "anchors": anchors,
        "corpus_texts": texts,
        "dimension": dimension,
        "embedding_bytes": embedding,
        "candidate_bytes": candidates,
        "memory_bytes": embedding + candidates,
        "disk_bytes": embedding + int(rows * row),  # its embeddings while it runs, and the dataset
    }


# -- running -------------------------------------------------------------------------------------------


class Mining:
    """Run (one asyncio task per job, on the API's event loop, one job at a time) and resume the mining jobs;
    `embedder()` makes one job's embedder, `key_named(name)` finds its key (for the disk quota when it
    publishes; None: no quota)."""

    def __init__(
        self,
        settings: Settings,
        embedder: Callable[[], Embedder],
        key_named: Callable[[str], Key | None] = lambda name: None,
    ):
        self.settings, self.embedder, self.key_named = settings, embedder, key_named
        self.data_dir = Path(settings.data_dir)
        self.records = JobRecords(settings.data_dir)
        self.tasks: dict[str, asyncio.Task] = {}
        self._running = asyncio.Semaphore(1)  # each holds its embeddings matrix: one at a time, oldest first

    def start(self, job_id: str) -> None:
        task = asyncio.get_running_loop().create_task(
            self.run(job_id), name=f"mine-{job_id}", context=contextvars.copy_context()
        )
        self.tasks[job_id] = task
        task.add_done_callback(lambda _: self.tasks.pop(job_id, None))

    async def resume(self, quiet: bool = False) -> list[str]:
        """Start every unfinished mining job no process runs (runner.resumable), at start and every
        RESUME_EVERY_S while serving (`quiet`), as the batches are."""
        ids = await runner.resume_here(self.records, {KIND}, self.tasks, self.start)
        if ids and not quiet:
            log.info("resuming %d mining job(s): %s", len(ids), ", ".join(ids))
        return ids

    async def stop(self) -> None:
        """Stop the runs (before the engine stops): each hands its job back, its uncounted chunk dropped."""
        await runner.stop_tasks(self.tasks.values())

    async def run(self, job_id: str) -> str:
        """One attempt, through the runner; the embeddings file goes once the job has ended."""
        try:
            async with self._running:
                return await runner.run_async(self.records, job_id, self._body, wait_s=1.0)
        finally:
            await asyncio.shield(asyncio.to_thread(self._tidy, job_id))

    def _tidy(self, job_id: str) -> None:
        if self.records.exists(job_id) and self.records.read(job_id)["state"] in TERMINAL:
            (self.records.job_dir(job_id) / EMBEDDINGS).unlink(missing_ok=True)

    async def _body(self, attempt: runner.Attempt) -> str:
        record = attempt.record
        assert record is not None
        try:
            done = await asyncio.to_thread(self._published, record)
            if done is not None:
                return await asyncio.to_thread(attempt.succeed, done, _words(done))
            plan, options = await asyncio.to_thread(self._plan, record)
            if await self._embed(attempt, plan) == "cancelled":
                return await asyncio.to_thread(self._cancel, attempt)
            vectors = await asyncio.to_thread(self._vectors, attempt.job_id, plan)
            found = await asyncio.to_thread(
                mine, vectors[: len(plan.queries)], vectors[len(plan.queries) :], plan, options
            )
            del vectors
            if await asyncio.to_thread(self.records.cancel_requested, attempt.job_id):
                return await asyncio.to_thread(self._cancel, attempt)
            result = await asyncio.to_thread(self._publish, record, plan, found, options)
        except (JobFailed, ServiceError, ValueError) as e:  # the data, the request or a refusal: said as it is
            message = e.message if isinstance(e, ServiceError) else str(e)
            return await asyncio.to_thread(attempt.fail, message)
        return await asyncio.to_thread(attempt.succeed, result, _words(result))

    # -- 1. the plan

    def _plan(self, record: JobRecord) -> tuple[MiningPlan, MiningOptions]:
        """The dataset and corpus read again (checked unchanged since the job was made) and planned."""
        params, dataset = record["params"], record["dataset"]
        assert dataset is not None
        pairs = load_pairs(self._file(dataset, params["dataset_sha256"], "dataset")[0])
        if params.get("corpus") is None:
            extra = [n for p in pairs for n in p.negatives]
        else:
            path, meta = self._file(params["corpus"], params["corpus_sha256"], "corpus")
            if meta["kind"] == "retrieval":
                extra = list(load_retrieval(path).corpus.values())
            else:
                extra = [t for p in load_pairs(path) for t in (p.positive, *p.negatives)]
        plan = MiningPlan.of([(p.anchor, p.positive) for p in pairs], extra)
        options = MiningOptions(**{k: params[k] for k in MiningOptions.__dataclass_fields__})
        return plan, options

    def _file(self, name: str, sha256: str, field: str) -> tuple[Path, dict]:
        try:
            path, meta = dataset_file(self.data_dir, name)
        except FileNotFoundError:
            raise JobFailed(f"{field}: dataset '{name}' is gone") from None
        if meta["sha256"] != sha256:
            raise JobFailed(f"{field}: dataset '{name}' is not the one the job was made with (it was replaced)")
        return path, meta

    # -- 2. the embeddings

    async def _embed(self, attempt: runner.Attempt, plan: MiningPlan) -> str:
        """Embed what is not counted yet; "cancelled" when a cancel came first. Vectors of another model
        version than those counted start it over."""
        job_id, record = attempt.job_id, attempt.record
        assert record is not None
        params, model = record["params"], record["base_model"]
        assert model is not None
        total = len(plan.queries) + len(plan.corpus)
        done = await asyncio.to_thread(self._prepare, job_id, plan)
        embedder = self.embedder()
        parts = [
            (plan.queries, 0, params["query_prompt_name"], params["query_prompt"]),
            (plan.corpus, len(plan.queries), params["corpus_prompt_name"], params["corpus_prompt"]),
        ]
        chunks = [
            (start + i, texts[i : i + CHUNK_TEXTS], name, prompt)
            for texts, start, name, prompt in parts
            for i in range(0, len(texts), CHUNK_TEXTS)
        ]
        ahead: collections.deque[tuple[int, asyncio.Future]] = collections.deque()
        todo = iter([c for c in chunks if c[0] >= done])
        try:
            while True:
                while len(ahead) < AHEAD and (chunk := next(todo, None)) is not None:
                    first, texts, name, prompt = chunk
                    ahead.append((first, asyncio.ensure_future(embedder.embed(model, texts, name, prompt))))
                if not ahead:
                    return "embedded"
                if await asyncio.to_thread(self.records.cancel_requested, job_id):
                    return "cancelled"
                first, running = ahead.popleft()
                vectors, version = await running
                if not await asyncio.to_thread(self._commit, job_id, first, vectors, version, total):
                    log.info("mining job %s: model '%s' changed to version %d; embedding again", job_id, model, version)
                    for _, other in ahead:
                        other.cancel()
                    ahead.clear()
                    todo = iter(chunks)
        finally:
            for _, other in ahead:
                other.cancel()
            await asyncio.gather(*(other for _, other in ahead), return_exceptions=True)

    def _prepare(self, job_id: str, plan: MiningPlan) -> int:
        """The rows counted, the embeddings file cut back to them (a killed attempt's uncounted tail)."""
        path = self.records.job_dir(job_id) / EMBEDDINGS
        total = len(plan.queries) + len(plan.corpus)

        def cut(record: JobRecord) -> None:
            progress = record.get("progress") or {}
            width = progress.get("dimension", 0) * FLOAT32
            on_disk = path.stat().st_size // width if width and path.exists() else 0
            step = min(progress.get("step", 0), on_disk)
            with open(path, "ab") as f:
                f.truncate(step * width)
                os.fsync(f.fileno())
            record["progress"] = {
                **progress,
                "step": step,
                "total_steps": total,
                "anchors": len(plan.queries),
                "corpus": len(plan.corpus),
            }

        return self.records.update(job_id, cut)["progress"]["step"]

    def _commit(self, job_id: str, first: int, vectors: np.ndarray, version: int, total: int) -> bool:
        """Append a chunk's vectors at row `first`, fsync, then count them; False (everything dropped) when
        they come from another version of the model than those counted."""
        path = self.records.job_dir(job_id) / EMBEDDINGS
        progress = self.records.read(job_id)["progress"]
        if progress.get("model_version", version) != version:
            self.records.update(job_id, lambda r: r["progress"].update(step=0, model_version=version))
            with open(path, "wb") as f:
                os.fsync(f.fileno())
            return False
        assert progress["step"] == first, (progress["step"], first)  # chunks are committed in order
        with open(path, "ab") as f:
            f.write(np.ascontiguousarray(vectors, dtype="<f4").tobytes())
            f.flush()
            os.fsync(f.fileno())

        def count(record: JobRecord) -> None:
            record["progress"].update(
                step=first + len(vectors), total_steps=total, dimension=vectors.shape[1], model_version=version
            )

        self.records.update(job_id, count)
        return True

    def _vectors(self, job_id: str, plan: MiningPlan) -> torch.Tensor:
        total = len(plan.queries) + len(plan.corpus)
        flat = np.fromfile(self.records.job_dir(job_id) / EMBEDDINGS, dtype="<f4")
        return torch.from_numpy(flat.reshape(total, -1))

    # -- 4. publishing

    def _publish(self, record: JobRecord, plan: MiningPlan, found: Any, options: MiningOptions) -> dict:
        """Write the rows and install them as a pairs dataset; the result."""
        params, job_id = record["params"], record["id"]
        rows = plan.tuples(found)
        result = {
            "dataset": params["name"],
            "rows": len(rows),
            "dropped": plan.pairs - len(rows),
            "anchors": len(plan.queries),
            "corpus": len(plan.corpus),
            "num_negatives": options.num_negatives,
            "range_max": options.ranks(plan.max_positives),
        }
        if not rows:
            raise JobFailed(
                f"no anchor got {options.num_negatives} negatives, so no row is left: lower range_min, "
                "num_negatives or the margins, or raise range_max or max_score"
            )
        tmp = staging_dir(self.data_dir, "mined")
        try:
            path = tmp / "data.jsonl"
            columns = negative_columns(options.num_negatives)
            with open(path, "w", encoding="utf-8") as f:
                for anchor, positive, negatives in rows:
                    row = {ANCHOR: anchor, POSITIVE: positive, **dict(zip(columns, negatives))}
                    f.write(json.dumps(row, ensure_ascii=False) + "\n")
            size = path.stat().st_size
            if size > self.settings.max_dataset_bytes:
                raise JobFailed(
                    f"the mined dataset is {size:,} bytes, more than the limit of "
                    f"{self.settings.max_dataset_bytes:,} (BERT_MAX_DATASET_BYTES)"
                )
            owner = owner_of(record)
            key = self.key_named(owner)
            room = functools.partial(check_room, self.data_dir, key, what="the mined dataset") if key else None
            noted = {"publishing": result, "published_sha256": _sha256(path)}  # before the rename: see _published
            self.records.update(job_id, lambda r: r["progress"].update(noted))
            meta = install_file(
                tmp,
                f"{params['name']}.jsonl",
                params["name"],
                "pairs",
                self.data_dir,
                self.settings,
                owner,
                params["shared"],
                room,
            )
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return {**result, "sha256": meta["sha256"]}

    def _published(self, record: JobRecord) -> dict | None:
        """The result of an attempt that installed the dataset and died before it said so, else None."""
        progress, params = record.get("progress") or {}, record["params"]
        sha = progress.get("published_sha256")
        meta = read_meta(self.data_dir, params["name"]) if sha else None
        if meta is None or meta["sha256"] != sha or meta.get("owner") != owner_of(record):
            return None
        return {**progress["publishing"], "sha256": sha}

    def _cancel(self, attempt: runner.Attempt) -> str:
        progress = self.records.read(attempt.job_id)["progress"]
        return attempt.cancel(f"cancelled after {progress['step']} of {progress['total_steps']} texts embedded")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _words(result: dict) -> str:
    return (
        f"published dataset '{result['dataset']}': {result['rows']} rows with {result['num_negatives']} negatives, "
        f"{result['dropped']} dropped (too few candidates)"
    )
