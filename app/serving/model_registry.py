"""the model registry: DATA_DIR/models/<name>/ directories in Hugging Face layout.

The store scans the directory (at start-up, on GET /models and when a request names a model it
does not know), so a model saved while the service runs is served without a restart. Hidden and
temporary directories ("." or "tmp" prefix, as model.files.atomic_dir writes) are skipped. A
directory that is replaced (a new inode or mtime, as an atomic save produces) is reloaded on its
next use. Weights come through model.modeling.load_model (safetensors, or weights-only torch.load):
nothing is ever unpickled.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import threading
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

import model as model_package
from app.errors import ServiceError
from model import kernels
from model.config import BertConfig
from model.datadir import DataDir, JobRecords, valid_name
from model.datadir.jobs import steps_of
from model.modeling import (
    BertForMaskedLM,
    BertForPreTraining,
    BertForQuestionAnswering,
    BertForSequenceClassification,
    BertForTokenClassification,
    BertModel,
    BertPreTrainedModel,
    class_for_heads,
    load_model,
)
from model.precision import apply_precision
from model.tokenizer import BertTokenizer
from model.weights import heads_in_dir

log = logging.getLogger("bertserve.store")

# What each route needs (a servable head), and the model classes that have it. Not model.weights'
# weight heads (pooler, mlm, nsp, classifier): those say which tensors a directory holds.
HEAD_CLASSES = {
    "mlm": (BertForMaskedLM, BertForPreTraining),
    "nsp": (BertForPreTraining,),
    "classifier": (BertForSequenceClassification,),
    "token_classifier": (BertForTokenClassification,),
    "qa": (BertForQuestionAnswering,),
}
HEAD_TITLES = {
    "mlm": "masked-LM (mlm)",
    "nsp": "next-sentence (nsp)",
    "classifier": "classifier",
    "token_classifier": "token-classifier (token_classifier)",
    "qa": "question-answering (qa)",
}


def servable_heads(cls: type) -> list[str]:
    """What a route can use a model of class `cls` for: mlm, nsp, classifier, token_classifier, qa
    (embeddings: any model)."""
    return [head for head, classes in HEAD_CLASSES.items() if issubclass(cls, classes)]


@dataclass
class LoadedModel:
    """A model in memory with what the engine and routes need beside it."""

    name: str
    model: BertPreTrainedModel
    tokenizer: BertTokenizer
    max_length: int  # tokens, [CLS] and [SEP] included
    precision: str = "fp32"  # as model.precision.apply_precision was given it
    warm: bool = False

    @property
    def config(self) -> BertConfig:
        return self.model.config

    @property
    def encoder(self) -> BertModel:
        # (torch types a submodule as Tensor | Module; every head class's `bert` is a BertModel)
        return self.model if isinstance(self.model, BertModel) else self.model.bert  # type: ignore[return-value]

    @property
    def pad_token_id(self) -> int:
        return self.tokenizer.pad_token_id

    @property
    def mask_token_id(self) -> int:
        return self.tokenizer.mask_token_id


@dataclass
class StoredModel:
    """What the store knows of one directory, loaded or not."""

    name: str
    path: Path
    identity: tuple  # (inode, mtime_ns) of the directory: changes when it is replaced
    config: BertConfig | None = None
    architecture: str | None = None
    heads: list[str] = field(default_factory=list)  # servable_heads of its class
    num_parameters: int | None = None
    error: str | None = None  # why the directory cannot be served
    loaded: LoadedModel | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


def _identity(path: Path) -> tuple | None:
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return (st.st_ino, st.st_mtime_ns)


def _count_parameters(cls: type, config: BertConfig, heads: set[str]) -> int:
    """Exact parameter count of the class load_model would build, built on the meta device (no memory)."""
    with torch.device("meta"):
        model = BertModel(config, add_pooling_layer="pooler" in heads) if cls is BertModel else cls(config)
    return model.num_parameters()


def read_stored_model(name: str, path: Path, identity: tuple) -> StoredModel:
    """What the store knows of a model directory, from its config and weight names (cheap: no tensors
    are loaded); a directory that cannot be served gets its reason in `error`."""
    entry = StoredModel(name=name, path=path, identity=identity)
    try:
        entry.config = BertConfig.from_json_file(path / "config.json")
        weight_heads = heads_in_dir(path)
        cls = class_for_heads(weight_heads, entry.config.architectures)  # as load_model chooses
        entry.architecture = cls.__name__
        entry.heads = servable_heads(cls)
        entry.num_parameters = _count_parameters(cls, entry.config, weight_heads)
    except Exception as e:  # a broken directory is listed with its reason, not hidden
        entry.error = describe_failure(e, path.parent.parent)
        log.warning("model %s at %s is unusable: %s: %s", name, path, type(e).__name__, e)
    return entry


MODEL_PACKAGE = Path(model_package.__file__).resolve().parent


def describe_failure(e: Exception, data_dir: Path) -> str:
    """Why a model directory cannot be served, in words an answer may carry: our own messages (raised
    in model/), with paths relative to DATA_DIR; for a library's exception, its type only (its text,
    which may quote internals, stays in the log)."""
    if isinstance(e, pickle.UnpicklingError):
        return (
            "pytorch_model.bin is not plain weights: loading it would unpickle code, which is refused "
            "(convert it to model.safetensors)"
        )
    raised_in = Path(traceback.extract_tb(e.__traceback__)[-1].filename) if e.__traceback__ else None
    if raised_in is None or not raised_in.resolve().is_relative_to(MODEL_PACKAGE):
        return f"{type(e).__name__} (the service log has the details)"
    message = str(e)  # ours, or an OS error from a builtin model/ called (open, stat)
    for prefix in {str(data_dir), str(data_dir.resolve())}:
        message = message.replace(prefix.rstrip("/") + "/", "")
    return message


class ModelRegistry:
    def __init__(
        self,
        data_dir: Path,
        default_model: str | None,
        device: torch.device,
        warm_up=None,
        default_mlm_model: str | None = None,
        precision=lambda name: "fp32",
    ):
        self.root = DataDir(data_dir).models
        self.jobs = JobRecords(data_dir)
        self.default_name = default_model
        self.default_mlm_name = default_mlm_model  # for the routes that need the MLM or NSP head
        self.precision_of = precision  # name -> "fp32" | "bf16" | "int8" (resolved: never "auto")
        self.device = device
        self.warm_up = warm_up  # async (LoadedModel) -> None: forward passes before first use
        self._entries: dict[str, StoredModel] = {}
        self._lock = threading.Lock()

    # -- scanning (filesystem work: call through asyncio.to_thread from async code) ----------

    def scan(self) -> list[StoredModel]:
        """Bring the entries in line with the directory; return them sorted by name."""
        found = {}
        if self.root.is_dir():
            for child in self.root.iterdir():
                name = child.name
                if not valid_name(name) or not child.is_dir():  # also skips .tmp-* and tmp* dirs
                    continue
                if not (child / "config.json").is_file():
                    continue
                identity = _identity(child)
                if identity is not None:
                    found[name] = identity
        with self._lock:
            for name in list(self._entries):
                if name not in found:
                    del self._entries[name]
            for name, identity in found.items():
                old = self._entries.get(name)
                if old is None or old.identity != identity:
                    self._entries[name] = read_stored_model(name, self.root / name, identity)
            return [self._entries[n] for n in sorted(self._entries)]

    def _refresh(self, name: str) -> StoredModel | None:
        """The entry for `name`, read again if its directory was replaced since."""
        entry = self._entries.get(name)
        if entry is None:
            return None
        identity = _identity(entry.path)
        if identity is None:  # removed (or mid-replacement): let a scan decide
            self.scan()
            return self._entries.get(name)
        if identity != entry.identity:
            with self._lock:
                self._entries[name] = read_stored_model(name, entry.path, identity)
        return self._entries[name]

    # -- lookups --------------------------------------------------------------------------------

    def default(self) -> str | None:
        """BERT_DEFAULT_MODEL, or the only model in the store when it holds exactly one."""
        if self.default_name:
            return self.default_name
        names = list(self._entries)
        return names[0] if len(names) == 1 else None

    def peek(self, name: str) -> StoredModel | None:
        """The entry as last scanned, without touching the filesystem."""
        return self._entries.get(name)

    def entries(self) -> list[StoredModel]:
        return [self._entries[n] for n in sorted(self._entries)]

    async def lookup(self, name: str | None, head: str | None = None) -> StoredModel:
        """The stored model a request names (or the default); 404 when there is none, 503 while a
        training job is still producing it."""
        if name is None and head in ("mlm", "nsp") and self.default_mlm_name:
            name = self.default_mlm_name
        if name is None:
            if self.default() is None:
                await asyncio.to_thread(self.scan)
            name = self.default()
            if name is None:
                raise ServiceError(
                    "not_found", "no model named in the request and no default model (set BERT_DEFAULT_MODEL)"
                )
        if not valid_name(name):
            raise ServiceError("not_found", f"model '{name}' not found")
        entry = self._entries.get(name)
        if entry is not None and _identity(entry.path) == entry.identity:
            return entry  # the common case: one stat, no thread hop
        entry = await asyncio.to_thread(self._refresh, name)
        if entry is None:
            await asyncio.to_thread(self.scan)
            entry = self._entries.get(name)
        if entry is None:
            await asyncio.to_thread(self._raise_if_training, name)
            known = ", ".join(sorted(self._entries)) or "none"
            raise ServiceError("not_found", f"model '{name}' not found (available: {known})")
        return entry

    def _raise_if_training(self, name: str) -> None:
        """503 naming the job when a queued or running job will publish a model called `name`."""
        record = self.jobs.unfinished_job_for_model(name)
        if record is not None:
            step, total = steps_of(record)
            job = {
                "id": record["id"],
                "state": record["state"],
                "step": step,
                "total_steps": total,
                "status_url": f"/jobs/{record['id']}",
            }
            if record.get("kind") == "import":
                progress = record.get("progress") or {}
                done = f", {progress['downloaded_bytes']:,} of {progress['total_bytes']:,} bytes" if progress else ""
                doing = f"being imported by job {job['id']} ({job['state']}{done})"
            else:
                doing = (
                    f"still being trained by job {job['id']} ({job['state']}, step {job['step']}/{job['total_steps']})"
                )
            raise ServiceError(
                "unavailable", f"model '{name}' is {doing}; it is served as soon as the job finishes", job=job
            )

    async def get(self, name: str | None, head: str | None = None, route: str = "") -> LoadedModel:
        """The loaded model for a request, loading and warming it up on first use.

        `head` names what the route needs; a model without it is a 422 that names both.
        """
        entry = await self.lookup(name, head)
        if entry.error is not None:
            raise ServiceError("unavailable", f"model '{entry.name}' cannot be served: {entry.error}")
        if head is not None and head not in entry.heads:
            has = ", ".join(entry.heads) or "none"
            raise ServiceError(
                "validation",
                f"model '{entry.name}' has no {HEAD_TITLES[head]} head, which "
                f"{route} needs (it is a {entry.architecture}; heads: {has})",
            )
        return await self.ensure_loaded(entry)

    async def ensure_loaded(self, entry: StoredModel) -> LoadedModel:
        if entry.loaded is not None:
            return entry.loaded
        async with entry.lock:  # concurrent first requests load it once
            if entry.loaded is None:
                try:
                    loaded = await asyncio.to_thread(self._load, entry)
                    if self.warm_up is not None:
                        await self.warm_up(loaded)
                    loaded.warm = True
                    entry.loaded = loaded
                except ServiceError:
                    raise
                except Exception as e:  # remembered until the directory changes: no retry storm
                    log.exception("loading model %s failed", entry.name)
                    entry.error = f"loading failed: {describe_failure(e, self.root.parent)}"
                    message = f"model '{entry.name}' cannot be served: {entry.error}"
                    raise ServiceError("unavailable", message) from None
        return entry.loaded

    def _load(self, entry: StoredModel) -> LoadedModel:
        precision = self.precision_of(entry.name)
        model = apply_precision(load_model(entry.path, device=self.device), precision)
        tokenizer = BertTokenizer.from_pretrained(entry.path)
        if tokenizer.vocab_size > model.config.vocab_size:
            # An id past the embedding table is an IndexError for one batch on the CPU, but on CUDA a
            # device-side assert that poisons the context for every later batch: refuse it here.
            entry.error = (
                f"its tokenizer has {tokenizer.vocab_size:,} tokens but the model's embeddings only "
                f"{model.config.vocab_size:,} rows (config.json's vocab_size)"
            )
            raise ServiceError("unavailable", f"model '{entry.name}' cannot be served: {entry.error}")
        max_length = min(model.config.max_position_embeddings, tokenizer.model_max_length)
        plan = kernels.warn_if_emulated(precision, self.device)  # decides the paths off the event loop
        log.info(
            "loaded model %s (%s, %s, kernels %s) on %s",
            entry.name,
            type(model).__name__,
            precision,
            plan["kernels"],
            self.device,
        )
        return LoadedModel(entry.name, model, tokenizer, max_length, precision)

    def loaded_count(self) -> int:
        return sum(e.loaded is not None for e in self._entries.values())
