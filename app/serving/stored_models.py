"""What the model registry knows of one model directory (app/serving/model_registry.py keeps them): a
StoredModel (its promoted version's path and identity, config, class, heads, parameter count, why it
cannot be served, its access) read from the config and weight names without loading tensors, and a
LoadedModel (the module, its tokenizer, prompts and sentence-transformers modules, the precision it
runs in). The heads a route needs are declared here, with the classes that have them.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

import model as model_package
from app.errors import ONE_LINE, ServiceError, without_data_dir
from datadir.cards import read_card
from datadir.jobs import LEGACY_OWNER
from datadir.versions import MODEL_JSON, Access
from model.compute import kernels
from model.compute.device import return_freed_memory
from model.compute.precision import apply_precision
from model.config import BertConfig
from model.late_interaction import LateInteraction, read_late_interaction
from model.model_dir import read_prompts
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
from model.sentence_modules import SentenceModules, read_sentence_modules
from model.tokenizer import BertTokenizer
from model.weights import heads_in_dir

log = logging.getLogger("bertserve.registry")
log.addFilter(ONE_LINE)  # a model's name and path, one line each (app/errors.py)

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
    precision: str = "fp32"  # as model.compute.precision.apply_precision was given it
    warm: bool = False
    prompts: dict[str, str] = field(default_factory=dict)  # config_sentence_transformers.json's, by name
    default_prompt_name: str | None = None  # the prompt an embedding request gets when it names none
    # its pooling and Normalize (model.sentence_modules), read once as it loads: how the embedding routes embed
    sentence_modules: SentenceModules = field(default_factory=SentenceModules)
    embedding_error: str | None = None  # why its sentence-transformers files cannot be run (None: they can)
    late_interaction: LateInteraction | None = None  # a ColBERT's projection and settings (/embed_multi, /rerank)
    weight_bytes: int = 0  # its weights' estimate, as counted against the memory budget
    working_bytes: int = 0  # its forward pass's working set, as counted
    holders: int = 0  # requests and work items running on it now (ModelRegistry.hold and release)
    version: int = 1  # the version of the model it was loaded from (StoredModel.version)

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
    """What the registry knows of one directory, loaded or not."""

    name: str
    path: Path  # the promoted version's directory
    identity: tuple  # (inode, mtime_ns) of model.json and of `path`: changes on a promote or a replacement
    version: int = 1  # the promoted version's number
    versions: list[int] = field(default_factory=list)  # every version on disk, as of the last scan
    config: BertConfig | None = None
    architecture: str | None = None
    heads: list[str] = field(default_factory=list)  # servable_heads of its class
    num_parameters: int | None = None
    error: str | None = None  # why the directory cannot be served
    loaded: LoadedModel | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    reserved_bytes: int = 0  # its weights' estimate, counted against the budget while loading or loaded
    last_used: int = 0  # when its last request came (a registry-wide count): the least recent is unloaded first
    users: dict[str, float] = field(default_factory=dict)  # key name -> when it last asked for it (registry.clock)
    access: Access = field(default_factory=lambda: Access.new(LEGACY_OWNER))  # its owner, and whether it is shared
    # its card's measured precisions, by kind of CPU (model/precision_choice.py; app/serving/auto_precision.py)
    precision_table: dict | None = None


def path_identity(path: Path) -> tuple | None:
    try:
        st = path.stat()
    except (FileNotFoundError, NotADirectoryError):
        return None
    return (st.st_ino, st.st_mtime_ns)


def model_identity(model_root: Path, version_dir: Path) -> tuple | None:
    """Two stats: model.json (None for a flat model) and the promoted version's directory."""
    version_identity = path_identity(version_dir)
    return None if version_identity is None else (path_identity(model_root / MODEL_JSON), version_identity)


def _count_parameters(cls: type, config: BertConfig, heads: set[str]) -> int:
    """Exact parameter count of the class load_model would build, built on the meta device (no memory)."""
    with torch.device("meta"):
        model = BertModel(config, add_pooling_layer="pooler" in heads) if cls is BertModel else cls(config)
    return model.num_parameters()


def read_stored_model(
    name: str, path: Path, identity: tuple, version: int = 1, versions: list[int] | None = None
) -> StoredModel:
    """What the registry knows of a model directory, from its config and weight names (cheap: no tensors
    are loaded); a directory that cannot be served gets its reason in `error`."""
    entry = StoredModel(name=name, path=path, identity=identity, version=version, versions=versions or [version])
    try:
        entry.config = BertConfig.from_json_file(path / "config.json")
        weight_heads = heads_in_dir(path)
        cls = class_for_heads(weight_heads, entry.config.architectures)  # as load_model chooses
        entry.architecture = cls.__name__
        entry.heads = servable_heads(cls)
        entry.num_parameters = _count_parameters(cls, entry.config, weight_heads)
        table = read_card(path).get("precision")
        entry.precision_table = table if isinstance(table, dict) else None
    except Exception as e:  # a broken directory is listed with its reason, not hidden
        entry.error = describe_failure(e, _data_dir_of(path))
        log.warning("model %s at %s is unusable: %s: %s", name, path, type(e).__name__, e)
    return entry


def _data_dir_of(path: Path) -> Path:
    """DATA_DIR of a model's directory: models/<name>/ (flat) or models/<name>/v<N>/."""
    return path.parent.parent.parent if path.parent.parent.name == "models" else path.parent.parent


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
    return without_data_dir(str(e), data_dir)  # ours, or an OS error from a builtin model/ called (open, stat)


def load_stored(entry: StoredModel, device: torch.device, precision: str) -> LoadedModel:
    """The entry's model loaded on `device` at `precision`, with its tokenizer, prompts and sentence-transformers
    modules (in a thread: it reads files and builds the model); a ServiceError (and `entry.error`) when the
    directory cannot be served."""
    if device.type == "cpu":
        return_freed_memory()  # what unloaded models left in the C heap, before this one takes more
    # Read, checked and cast on the host, then moved: a GPU holds the weights once, at their precision (not fp32
    # weights cast in place, a transient twice a bf16 model's reserved size), and never a model refused below.
    model = apply_precision(load_model(entry.path, device="cpu"), precision)
    tokenizer = BertTokenizer.from_pretrained(entry.path)
    if tokenizer.vocab_size > model.config.vocab_size:
        # An id past the embedding table is an IndexError for one batch on the CPU, but on CUDA a
        # device-side assert that poisons the context for every later batch: refuse it here.
        entry.error = (
            f"its tokenizer has {tokenizer.vocab_size:,} tokens but the model's embeddings only "
            f"{model.config.vocab_size:,} rows (config.json's vocab_size)"
        )
        raise ServiceError("unavailable", f"model '{entry.name}' cannot be served: {entry.error}")
    model = model.to(device)
    try:
        prompts, default_prompt = read_prompts(entry.path)
    except ValueError as e:
        entry.error = str(e)
        raise ServiceError("unavailable", f"model '{entry.name}' cannot be served: {entry.error}") from None
    # Modules this service cannot run (a Dense layer, ...) take the embedding routes away, not the others.
    sentence_modules, embedding_error, late = SentenceModules(), None, None
    try:
        late = read_late_interaction(entry.path)
        if late is not None:
            late.token_ids(tokenizer)  # its markers are tokens of the vocabulary
            if max(late.settings.query_length, late.settings.document_length) > model.config.max_position_embeddings:
                raise ValueError(
                    f"its query_length {late.settings.query_length} or document_length "
                    f"{late.settings.document_length} is more than max_position_embeddings "
                    f"{model.config.max_position_embeddings}"
                )
    except ValueError as e:
        entry.error = str(e)
        raise ServiceError("unavailable", f"model '{entry.name}' cannot be served: {entry.error}") from None
    try:
        if late is not None:
            raise ValueError("a late-interaction (ColBERT) model: its token vectors come from /embed_multi")
        sentence_modules = read_sentence_modules(entry.path)
        sentence_modules.check_tokenizer(tokenizer.lowercase)
    except ValueError as e:
        embedding_error = str(e)
    max_length = min(model.config.max_position_embeddings, tokenizer.model_max_length)
    plan = kernels.warn_if_emulated(precision, device)  # decides the paths off the event loop
    log.info(
        "loaded model %s (%s, %s, kernels %s) on %s",
        entry.name,
        type(model).__name__,
        precision,
        plan["kernels"],
        device,
    )
    return LoadedModel(
        entry.name,
        model,
        tokenizer,
        max_length,
        precision,
        prompts=prompts,
        default_prompt_name=default_prompt,
        sentence_modules=sentence_modules,
        embedding_error=embedding_error,
        late_interaction=late,
        version=entry.version,
    )
