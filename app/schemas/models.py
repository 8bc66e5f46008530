"""The types of /models (app/api/routes/models.py): each model with its versions, card, prompts and pooling, the
memory budget, a promotion, and an import from the Hugging Face Hub (which answers a job: jobs.py's JobStatus).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, Field

from app.schemas.shared import STRICT, Name, invalid
from model.sources import HUB_ID_PATTERN, REVISION_RULE, valid_revision


class ModelInfo(BaseModel):
    name: str
    architecture: str | None = Field(description="The class the weights load as, e.g. BertForPreTraining.")
    heads: list[str] = Field(
        description="What it can serve beyond embeddings: mlm, nsp, classifier, token_classifier, qa."
    )
    labels: list[str] | None = Field(None, description="Classifier (or token classifier) labels, in id order.")
    num_parameters: int | None
    max_position_embeddings: int | None
    hidden_size: int | None
    default: bool
    loaded: bool
    precision: str = Field(
        description="Inference precision: fp32, bf16 or int8 (BERT_PRECISION, BERT_MODEL_PRECISION; "
        "auto shows as what it resolved to on this device: on a CPU, the fastest precision its card measured "
        "within the BERT_AUTO_MIN_* bounds on this kind of CPU)."
    )
    kernels: str | None = Field(
        None,
        description="Once loaded, the kernels it runs through on this machine: "
        "onednn-fp32, torch-fp32, onednn-bf16, bf16-emulated (...), "
        "int8-vnni, int8-emulated (...), cuda-fp32, cuda-bf16 (...).",
    )
    why: str | None = Field(
        None,
        description="Once loaded, why this precision and those kernels: the setting that chose the precision "
        "(for auto, why auto means it on this device), then what this CPU or GPU has and what is emulated, e.g. "
        '"bf16 by BERT_PRECISION=auto (measured on x86 avx512 bf16 vnni amx: embeddings min cosine 0.99994 ≥ 0.999, '
        '3.2× fp32 on this CPU); cpu AVX512, native bf16, VNNI".',
    )
    error: str | None = Field(None, description="Why the directory cannot be served, if it cannot.")
    pinned: bool = Field(
        False, description="Never unloaded to make room (BERT_PINNED_MODELS; unset: the default model)."
    )
    estimated_bytes: int | None = Field(
        None, description="Estimated memory of its weights at its precision, counted against the memory budget."
    )
    version: int = Field(1, description="The promoted version: the one requests get.")
    num_versions: int = Field(1, description="Versions on disk (POST /models/{name}/promote switches).")
    disk_bytes: int = Field(0, description="Bytes on disk, every version together.")
    owner: str = Field(
        "admin", description="The key that owns the name: only it (or an admin) publishes new versions of it."
    )
    shared: bool = Field(
        True, description="Every key may use and train from it (an admin shares or unshares: PATCH /models/{name})."
    )

    card: dict[str, Any] | None = Field(
        None,
        description="The model's card.json, if it has one: `source` (where it came from), `evaluation` (scores "
        "on the held-out Wikipedia set wiki-heldout-v1: sequences, tokens, masked_tokens, mlm_top1, mlm_top5, "
        "content_top1, content_top5, nsp_accuracy; `skipped` without MLM and NSP heads, `error` if it failed) "
        "`job_eval` (a training job's own evaluation), `before_after` (when the job evaluated its base model "
        "first: [{metric, before, after}], each metric before training and after) and `precision` (by kind of CPU: "
        "each native precision's speed and scores against fp32, what auto chooses from).",
    )
    prompts: dict[str, str] | None = Field(
        None,
        description=(
            "Its named prompts (config_sentence_transformers.json), for prompt_name on the embedding routes; "
            "null without any."
        ),
    )
    pooling: list[str] | None = Field(
        None,
        description=(
            "How the embedding routes pool its last hidden states: the modes of its sentence-transformers Pooling "
            'module (1_Pooling/config.json), several concatenated in this order; ["mean"] without modules.json; '
            '["splade"] for a sparse encoder (a SpladePooling module, or imported with pooling splade), which '
            "/embed_sparse serves and the dense embedding routes refuse. Null when its files cannot say (`error`)."
        ),
    )
    normalize: bool | None = Field(
        None,
        description=(
            "Whether /embeddings normalises its embeddings when a request does not say: true with a "
            "sentence-transformers Normalize module, or without modules.json. Null when its files cannot say."
        ),
    )


class MemoryInfo(BaseModel):
    """The model memory budget and what counts against it now (estimates)."""

    budget_bytes: int | None = Field(description="BERT_MODEL_MEMORY_GB in bytes (or its default share of memory).")
    loaded_bytes: int = Field(description="The weights of the models loaded (or loading).")
    held_bytes: int = Field(
        description="The weights of models unloaded to make room that requests still run on: counted against the "
        "budget until the last of those requests ends."
    )
    working_set_bytes: int = Field(
        description="One forward pass's activations at BERT_MAX_BATCH_TOKENS, for the largest model loaded or held; "
        "0 when none is."
    )


class ModelVersion(BaseModel):
    version: int
    promoted: bool = Field(description="Whether requests get this version.")
    created_at: str | None = Field(description="When it was published (or imported).")
    disk_bytes: int
    made_by: str | None = Field(description="The id of the job (or import) that made it.")
    owner: str | None = Field(
        None, description="The name of the key that made that job (null where it was made another way)."
    )
    card: dict[str, Any] = Field(description="Its card.json: source and measured scores ({} when it has none).")


class ModelDetail(ModelInfo):
    versions: list[ModelVersion] = Field(description="Every version, oldest first.")


class ModelsResponse(BaseModel):
    models: list[ModelInfo]
    default: str | None
    memory: MemoryInfo


class ShareRequest(BaseModel):
    """PATCH /models/{name}: whether every key may use the model and train from it."""

    model_config = STRICT

    shared: bool = Field(description="true: every key may use it; false: its owner, admins and keys listing it.")


class PromoteRequest(BaseModel):
    version: int = Field(ge=1, description="The version requests get from now on (rollback: an older one).")


def _check_revision(value: str) -> str:
    if not valid_revision(value):
        raise invalid(REVISION_RULE)
    return value


Revision = Annotated[str, Field(examples=["main", "v1.0", "refs/pr/1"]), AfterValidator(_check_revision)]


class ImportModelRequest(BaseModel):
    """POST /models as JSON: a model from the Hugging Face Hub (an archive is sent as multipart instead)."""

    model_config = STRICT

    name: Name = Field(description="The model's name in DATA_DIR/models/ (an existing name gets a new version).")
    source: str = Field(
        pattern=HUB_ID_PATTERN,
        max_length=200,
        description="A Hugging Face Hub repo id, e.g. google-bert/bert-base-uncased (never a path on the server).",
    )
    revision: Revision | None = Field(None, description=f"A branch, tag or commit; default main. It {REVISION_RULE}.")
    pooling: Literal["splade"] | None = Field(
        None,
        description='"splade": import a masked-LM model as a sparse encoder (/embed_sparse) when its files do not '
        "say so (a sentence-transformers SparseEncoder's do). Default: as its files say.",
    )


IMPORT_EXAMPLE = {"name": "bert-base", "source": "google-bert/bert-base-uncased"}
