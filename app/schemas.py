"""Every request and response type of the service (`<Verb>Request` / `<Verb>Response`), with the
examples /docs shows: inference, models and operations, datasets, training jobs.

One strictness rule for every request body: JSON types must match exactly (`"top_k": "5"` is not a
number, `"normalize": 1` not a boolean), unknown fields are errors and NaN/Infinity are refused.
The one exception is /v1/embeddings, which ignores unknown fields: OpenAI's client libraries may
send options this service does not implement, and add new ones over time; refusing them would break
clients that work against OpenAI.

Limits that depend on settings (inputs per request, tokens per input) are checked in
app/serving/pipelines.py, since a JSON schema cannot read the environment; their documentation is here.
A single input gets a single result, a list of inputs a list of results in the same order.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated, Any, Literal, get_args

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, create_model, model_validator
from pydantic.json_schema import JsonDict
from pydantic_core import PydanticCustomError

from app.settings import Settings
from datadir import NAME_MAX_LENGTH, NAME_PATTERN, NAME_RULE, STATES, valid_name
from datadir.datasets import DATASET_KINDS, KIND_OF_TASK, LISTED_LABELS
from datadir.jobs import LEGACY_OWNER, owner_of, steps_of
from datadir.scheduling import DEFAULT_PRIORITY, PRIORITY_MAX, PRIORITY_MIN
from model.data.question_answering import WindowMisfit, check_window
from model.options import TASKS, Option, format_default, options_for
from model.sources import HUB_ID_PATTERN
from model.tokenizer import SPECIAL_TOKENS_IN_A_PAIR, lone_surrogate_at

# The rule above, for every request type (response types are ours: no need).
STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

ModelName = Annotated[
    str,
    Field(
        pattern=NAME_PATTERN,
        max_length=NAME_MAX_LENGTH,
        description="A model in DATA_DIR/models/; omitted = the default model.",
        examples=["bert-tiny"],
    ),
]
Truncate = Annotated[bool, Field(description="Cut inputs longer than the model's maximum instead of answering 422.")]


class Strict(BaseModel):
    """The base of every request type: see the module docstring."""

    model_config = STRICT

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        """JSON may escape a lone UTF-16 surrogate ("\\ud800"); no text is valid Unicode with one."""
        if (found := _lone_surrogate(data, "")) is not None:
            where, char, at = found
            raise _invalid(f"{where or 'body'} is not valid Unicode: lone surrogate {char!r} at character {at}")
        return data


def _lone_surrogate(data: Any, where: str) -> tuple[str, str, int] | None:
    """(where, the surrogate, its index) of the first lone surrogate in a JSON value's strings."""
    if isinstance(data, str):
        at = None if data.isascii() else lone_surrogate_at(data)
        return None if at is None else (where, data[at], at)
    items = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else ()
    for key, value in items:
        if isinstance(key, str) and (found := _lone_surrogate(key, where)) is not None:
            return found
        inner = f"{where}[{key}]" if isinstance(key, int) else f"{where}.{key}" if where else str(key)
        if (found := _lone_surrogate(value, inner)) is not None:
            return found
    return None


def _invalid(message: str) -> PydanticCustomError:
    """A validation error whose message is shown as is (a ValueError would get "Value error, " before it)."""
    return PydanticCustomError("invalid", message)


_EXAMPLES: dict[int, dict[str, dict]] = {}  # id of a config's json_schema_extra -> its named examples


def examples(**named: dict) -> ConfigDict:
    """A model config whose JSON schema carries these request examples; `body_examples` names them."""
    config = ConfigDict(**STRICT, json_schema_extra={"examples": list(named.values())})
    _EXAMPLES[id(config["json_schema_extra"])] = named
    return config


def body_examples(model: type[BaseModel]) -> dict:
    """The model's examples as named OpenAPI request-body examples (the drop-down on /docs)."""
    named = _EXAMPLES[id(model.model_config["json_schema_extra"])]
    return {k.replace("_", " "): {"summary": k.replace("_", " "), "value": v} for k, v in named.items()}


class TextPair(Strict):
    text_a: str
    text_b: str


# -- fill-mask ---------------------------------------------------------------------------------


class FillMaskRequest(Strict):
    """Texts with one or more [MASK] tokens (at most BERT_MAX_INPUTS texts)."""

    model_config = examples(
        one_mask={"inputs": "paris is the [MASK] of france.", "top_k": 3},
        several_inputs_and_targets={
            "inputs": ["the [MASK] sat on the mat.", "a [MASK] of [MASK]"],
            "top_k": 2,
            "targets": ["cat", "dog"],
        },
    )
    inputs: str | Annotated[list[str], Field(min_length=1)]
    top_k: Annotated[int, Field(ge=1, le=100, description="Candidates per [MASK].")] = 5
    targets: Annotated[
        list[Annotated[str, Field(min_length=1, max_length=100)]] | None,
        Field(
            min_length=1,
            max_length=1000,
            description="Only score these tokens (a word outside the vocabulary "
            "stands for its first WordPiece, as in transformers).",
        ),
    ] = None
    model: ModelName | None = None
    truncate: Truncate = False


class FillMaskCandidate(BaseModel):
    score: float = Field(description="Probability of the token at this [MASK] (full-vocabulary softmax).")
    token: int
    token_str: str
    sequence: str = Field(description="The input with this [MASK] filled in, decoded.")


# One input: its candidates when it has one [MASK], else one list per [MASK] (transformers' shape).
FillMaskResult = list[FillMaskCandidate] | list[list[FillMaskCandidate]]
FillMaskResponse = FillMaskResult | list[FillMaskResult]

FILL_MASK_EXAMPLE = [
    {"score": 0.41, "token": 3007, "token_str": "capital", "sequence": "paris is the capital of france."},
    {"score": 0.07, "token": 2803, "token_str": "center", "sequence": "paris is the center of france."},
    {"score": 0.03, "token": 2540, "token_str": "heart", "sequence": "paris is the heart of france."},
]


# -- nsp ---------------------------------------------------------------------------------------


class NspRequest(Strict):
    """Sentence pairs: does text_b follow text_a? (needs a model with the NSP head)."""

    model_config = examples(
        one_pair={"inputs": {"text_a": "I went to the store.", "text_b": "I bought a gallon of milk."}},
        a_list_of_pairs={"inputs": [{"text_a": "The sky is blue.", "text_b": "Penguins cannot fly."}]},
    )
    inputs: TextPair | Annotated[list[TextPair], Field(min_length=1)]
    model: ModelName | None = None
    truncate: Truncate = False


class NspResult(BaseModel):
    is_next: bool = Field(description="score >= 0.5")
    score: float = Field(description="P(text_b follows text_a): softmax of the NSP logits, label 0.")


NspResponse = NspResult | list[NspResult]


# -- embeddings --------------------------------------------------------------------------------
# The embedding options of /embeddings, /v1/embeddings and TEI's /embed (app/serving/embed_pipeline.py applies them).

Dimensions = Annotated[
    int | None,
    Field(
        description=(
            "Keep the first N components of each embedding, then normalise if normalising (Matryoshka, as "
            "sentence-transformers' truncate_dim); from 1 to the model's hidden size. Omitted: all of them."
        )
    ),
]
PromptName = Annotated[
    str | None,
    Field(
        description=(
            "A prompt of the model's config_sentence_transformers.json, put before each input; omitted: "
            "its default_prompt_name's, if it has one (GET /models/{name} lists a model's prompts)."
        )
    ),
]
Prompt = Annotated[str | None, Field(description="A literal prompt put before each input, instead of prompt_name.")]
LongInputs = Annotated[
    Literal["error", "truncate", "chunk"] | None,
    Field(
        description=(
            "An input longer than the model's window: error (422), truncate (cut it, as truncate: true), or "
            "chunk (embed overlapping windows and average them, weighted by their tokens). Omitted: truncate's choice."
        )
    ),
]


class EmbeddingsRequest(Strict):
    """Texts to embed (at most BERT_MAX_INPUTS)."""

    model_config = examples(
        one_text={"inputs": "a sentence to embed", "pooling": "mean", "normalize": True},
        several_texts_cls_pooling={
            "inputs": ["first sentence", "second sentence"],
            "pooling": "cls",
            "normalize": False,
        },
    )
    inputs: str | Annotated[list[str], Field(min_length=1)]
    pooling: Literal["mean", "cls"] = Field(
        "mean", description="mean: average of the (unpadded) last hidden states; cls: the [CLS] vector."
    )
    normalize: bool = Field(True, description="Scale each vector to unit L2 norm.")
    model: ModelName | None = None
    truncate: Truncate = False
    dimensions: Dimensions = None
    prompt_name: PromptName = None
    prompt: Prompt = None
    long_inputs: LongInputs = None


EmbeddingsResponse = list[float] | list[list[float]]


class OpenAIEmbeddingsRequest(Strict):
    """OpenAI's embeddings request (mean pooling, normalised, as sentence-transformers models)."""

    model_config = {
        **examples(openai_client={"input": ["first sentence", "second sentence"], "model": "bert-tiny"}),
        "extra": "ignore",
    }  # OpenAI clients send fields we do not use (module docstring)
    input: str | Annotated[list[str], Field(min_length=1)]
    model: ModelName | None = None
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="base64: little-endian float32 bytes, as OpenAI's clients ask for by default."
    )
    dimensions: Dimensions = None
    user: str | None = None
    prompt_name: PromptName = None  # not OpenAI's: the client's extra_body={"prompt_name": ...}
    long_inputs: LongInputs = None  # not OpenAI's; omitted: error


class OpenAIEmbedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str
    index: int


class OpenAIUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class OpenAIEmbeddingsResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[OpenAIEmbedding]
    model: str
    usage: OpenAIUsage


# -- classify ----------------------------------------------------------------------------------

# How many labels' scores a classifier's answer holds per input (/classify, TEI's /predict).
LabelTopK = Annotated[
    int | None,
    Field(
        ge=1,
        description=(
            "Labels scored per input, best first. Default: every label of a model with at most "
            f"BERT_MAX_LABEL_SCORES ({Settings.model_fields['max_label_scores'].default}) labels, else the best that many; "
            "a larger top_k is a 422."
        ),
    ),
]


class ClassifyRequest(Strict):
    """Texts or text pairs for a fine-tuned classifier."""

    model_config = examples(
        one_text={"inputs": "a gripping, beautifully shot film", "model": "sentiment"},
        text_pairs={"inputs": [{"text_a": "A man is eating.", "text_b": "Someone eats."}], "model": "nli"},
    )
    inputs: str | TextPair | Annotated[list[str | TextPair], Field(min_length=1)]
    model: ModelName
    truncate: Truncate = False
    top_k: LabelTopK = None


class ClassifyResult(BaseModel):
    label: str = Field(description="The best label (config.id2label).")
    score: float = Field(description="Its score.")
    scores: dict[str, float] = Field(
        description="The labels' scores: softmax over labels (sigmoid for a single or "
        "multi-label head, the raw value for regression); every label in "
        "id order, or the top_k best, best first."
    )


ClassifyResponse = ClassifyResult | list[ClassifyResult]


# -- token classification and question answering -----------------------------------------------
# The shapes of transformers' pipelines: "token-classification" (TokenClassificationPipeline) and 4.x's
# "question-answering" (QuestionAnsweringPipeline); app/serving/ner_pipeline.py and
# app/serving/qa_pipeline.py say what is followed.


class TokenClassificationRequest(Strict):
    """Texts for a token classifier (e.g. NER), answered as transformers' token-classification pipeline."""

    model_config = examples(
        grouped={
            "inputs": "my name is wolfgang and i live in berlin",
            "model": "ner",
            "aggregation_strategy": "simple",
        },
        per_token={"inputs": ["wolfgang lives in berlin", "sarah went to paris"], "model": "ner"},
    )
    inputs: str | Annotated[list[str], Field(min_length=1)]
    model: ModelName
    aggregation_strategy: Literal["none", "simple", "first", "average", "max"] = Field(
        "none",
        description="transformers' AggregationStrategy: none answers every token; simple groups adjacent "
        "tokens of one entity; first, average and max first make each word one label (its "
        "first token's, its tokens' mean scores', its best-scored token's), then group.",
    )
    ignore_labels: list[str] = Field(["O"], description="Labels left out of the answer.")
    stride: int | None = Field(
        None,
        ge=0,
        description="Read a text longer than the model whole, in windows that "
        "share this many tokens (not with aggregation_strategy none).",
    )
    truncate: Truncate = False


class TokenEntity(BaseModel):
    entity_group: str | None = Field(None, description="The entity (B-/I- prefix removed); grouped strategies.")
    entity: str | None = Field(None, description="The token's label; strategy none.")
    score: float
    index: int | None = Field(None, description="The token's position in the input ids; strategy none.")
    word: str
    start: int = Field(description="Character offset of its first character in the input.")
    end: int = Field(description="Character offset just past its last character.")


TokenClassificationResponse = list[TokenEntity] | list[list[TokenEntity]]


class QuestionAnsweringRequest(Strict):
    """Questions about contexts, answered with a span of the context as transformers 4.x's
    question-answering pipeline does; a context longer than the model is read in windows."""

    model_config = examples(
        one_question={"question": "where does sarah live ?", "context": "sarah lives in london .", "model": "qa"},
        top_answers={
            "question": ["who went to paris ?"],
            "context": ["sarah went to paris ."],
            "model": "qa",
            "top_k": 2,
            "handle_impossible_answer": True,
        },
    )
    question: str | Annotated[list[str], Field(min_length=1)]
    context: str | Annotated[list[str], Field(min_length=1)]
    model: ModelName
    top_k: int = Field(1, ge=1, le=100, description="How many answers per question, best first.")
    max_answer_len: int = Field(15, ge=1, le=512, description="The longest answer, in tokens.")
    max_seq_len: int | None = Field(
        None, ge=8, description="Tokens per window, question included (default: the model's maximum, at most 384)."
    )
    doc_stride: int | None = Field(
        None,
        ge=0,
        description="Tokens of context that consecutive windows share (default: half max_seq_len, at most 128).",
    )
    handle_impossible_answer: bool = Field(
        False, description="Also offer the empty answer (score of [CLS]), for SQuAD 2.0-style models."
    )
    align_to_words: bool = Field(True, description="Widen the answer to whole words.")

    @model_validator(mode="after")
    def _same_shape(self):
        if isinstance(self.question, str) != isinstance(self.context, str) or (
            not isinstance(self.question, str) and len(self.question) != len(self.context)
        ):
            raise _invalid("question and context must both be strings, or lists of the same length")
        return self


class Answer(BaseModel):
    score: float = Field(
        description="P(start) x P(end) within its window; for the empty answer, "
        "P(start=[CLS]) x P(end=[CLS]), lowest over the windows."
    )
    start: int = Field(description="Character offset of the answer in the context (0 for the empty answer).")
    end: int
    answer: str


# One question: its answer (a list when top_k > 1 finds more than one); several: one such per question.
QuestionAnsweringResponse = Answer | list[Answer] | list[Answer | list[Answer]]


# -- models and operations ---------------------------------------------------------------------


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
        "auto shows as what it resolved to on this device)."
    )
    kernels: str | None = Field(
        None,
        description="Once loaded, the kernels it runs through on this machine: "
        "onednn-fp32, torch-fp32, onednn-bf16, bf16-emulated (...), "
        "int8-vnni, int8-emulated (...), cuda-fp32, cuda-bf16 (...).",
    )
    why: str | None = Field(
        None,
        description="Once loaded, why those kernels: what this CPU or GPU has, e.g. "
        '"cpu AVX2, no native bf16, no VNNI", and what is emulated.',
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

    card: dict[str, Any] | None = Field(
        None,
        description="The model's card.json, if it has one: `source` (where it came from), `evaluation` (scores "
        "on the held-out Wikipedia set wiki-heldout-v1: sequences, tokens, masked_tokens, mlm_top1, mlm_top5, "
        "content_top1, content_top5, nsp_accuracy; `skipped` without MLM and NSP heads, `error` if it failed) "
        "and `job_eval` (a training job's own evaluation).",
    )
    prompts: dict[str, str] | None = Field(
        None,
        description=(
            "Its named prompts (config_sentence_transformers.json), for prompt_name on the embedding routes; "
            "null without any."
        ),
    )


class MemoryInfo(BaseModel):
    """The model memory budget and what counts against it now (estimates)."""

    budget_bytes: int | None = Field(description="BERT_MODEL_MEMORY_GB in bytes (or its default share of memory).")
    loaded_bytes: int = Field(description="The weights of the models loaded (or loading).")
    working_set_bytes: int = Field(
        description="One forward pass's activations at BERT_MAX_BATCH_TOKENS, for the largest loaded model; 0 when "
        "none is loaded."
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


class PromoteRequest(BaseModel):
    version: int = Field(ge=1, description="The version requests get from now on (rollback: an older one).")


class DeletedResponse(BaseModel):
    """What a DELETE removed and the disk space it freed."""

    deleted: Literal["model", "version", "dataset", "job"]
    name: str = Field(description="The model's or dataset's name, or the job's id.")
    version: int | None = Field(None, description="The version deleted (DELETE /models/{name}/versions/{version}).")
    freed_bytes: int


class OpenAIModel(BaseModel):
    id: str = Field(description="The model's name, as requests name it.")
    object: Literal["model"] = "model"
    created: int = Field(description="When its directory was last written (unix seconds).")
    owned_by: str


class OpenAIModelsResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[OpenAIModel]


class HealthResponse(BaseModel):
    status: Literal["ok"] = "ok"


class ReadyResponse(BaseModel):
    status: Literal["ready"] = "ready"
    model: str
    mlm_model: str | None = Field(
        None, description="The model /fill-mask and /nsp use when a request names none (null: `model`)."
    )


class InfoResponse(BaseModel):
    name: str
    version: str
    device: str
    cpu: str = Field(
        description="The processor and what torch reports it can do, e.g. "
        '"AMD EPYC: cpu AVX2, no native bf16, no VNNI".'
    )
    torch: str
    python: str
    settings: dict
    keys: dict = Field(
        description="The keys file, how many keys it holds, the built-in keys that are set, and the error of "
        "its last change when that change could not be read (the keys read before stay in use)."
    )


# -- datasets ----------------------------------------------------------------------------------

# POST /datasets is parsed by app/jobs/uploads.py as it streams in, so FastAPI never sees a body model;
# this is its OpenAPI description.
DATASET_UPLOAD_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["file"],
                    "properties": {
                        "file": {
                            "type": "string",
                            "format": "binary",
                            "description": "corpus: .txt or .jsonl (a 'text' field); labelled: .csv, .tsv or .jsonl "
                            "with 'text' and 'label' (and optionally 'text_pair'); token-labelled: CoNLL "
                            "columns (.conll, .iob, .iob2, .bio, .txt, .tsv) or .jsonl with 'tokens' and "
                            "'tags' (IOB2); qa: SQuAD v1.1/v2.0 .json",
                        },
                        "name": {
                            "type": "string",
                            "pattern": NAME_PATTERN,
                            "description": "Default: the file name's stem.",
                        },
                        "kind": {
                            "type": "string",
                            "enum": list(DATASET_KINDS),
                            "description": "Default: from the extension, the first kind it can be (.txt: corpus; .tsv: "
                            "labelled; .jsonl: token-labelled if rows have 'tokens' and 'tags', labelled "
                            "if 'label', else corpus).",
                        },
                    },
                }
            }
        },
    }
}

DatasetKind = Literal["corpus", "labelled", "token-labelled", "qa"]
assert set(get_args(DatasetKind)) == set(DATASET_KINDS)


class DatasetInfo(BaseModel):
    name: str
    kind: DatasetKind
    format: str
    file: str
    original_filename: str
    bytes: int
    sha256: str
    created_at: str
    owner: str = Field(
        LEGACY_OWNER,
        description="The name of the key that uploaded it (`admin` for datasets from before keys had names).",
    )
    documents: int | None = None
    sentences: int | None = None
    rows: int | None = None
    num_labels: int | None = Field(
        None,
        description=f"Distinct labels (tags); `labels` and the counts list at "
        f"most {LISTED_LABELS} of them, the most frequent.",
    )
    labels: list[str] | None = None
    label_counts: dict[str, int] | None = None
    is_pair: bool | None = None
    tokens: int | None = None
    entity_counts: dict[str, int] | None = None
    questions: int | None = None
    impossible: int | None = None
    contexts: int | None = None
    disk_bytes: int | None = Field(None, description="Bytes on disk: the file, meta.json and token caches.")


class DatasetsResponse(BaseModel):
    datasets: list[DatasetInfo]


# -- training jobs: requests -------------------------------------------------------------------


def _check_name(value: str) -> str:
    if not valid_name(value):
        raise _invalid(NAME_RULE)
    return value


# A model, dataset or base-model name in a job: one plain path component (datadir's rule).
Name = Annotated[
    str, Field(min_length=1, max_length=NAME_MAX_LENGTH, examples=["reviews"]), AfterValidator(_check_name)
]


_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_DURATION = re.compile(r"(\d+)([smhd])")
MAX_RUNTIME_CEILING = 366 * 86400  # a sanity bound; BERT_JOB_MAX_RUNTIME is the deployment's


def _seconds(value: int | str) -> int:
    """A duration in seconds: an integer, or a string of <number><unit> parts ("90m", "1h30m", "2d")."""
    if isinstance(value, str):
        text = value.replace(" ", "")
        if not text or _DURATION.sub("", text):
            raise _invalid(f"'{value}' is not a duration: give seconds (an integer) or e.g. '90m', '12h', '1d12h'")
        value = sum(int(n) * _DURATION_UNITS[unit] for n, unit in _DURATION.findall(text))
    if not 1 <= value <= MAX_RUNTIME_CEILING:
        raise _invalid(f"must be between 1 second and 366 days, got {value} s")
    return value


# Seconds, or a duration string; always seconds once validated.
Duration = Annotated[int | str, AfterValidator(_seconds)]


def option_fields(kind: str, names: list[str]) -> dict[str, Any]:
    """Pydantic fields of model/options.py's options `names` for a job of `kind`: type, default, bounds,
    choices and description from the table. A fine-tuning option whose default depends on the task shows
    the default task's, and the others in its description and under `x-task-defaults`."""
    by_name = {o.name: o for o in options_for(kind, job=True)}
    return {name: _option_field(by_name[name], kind) for name in names}


def _option_field(o: Option, kind: str) -> tuple[Any, Any]:
    annotation: Any = Literal[o.choices] if o.choices else o.type  # a type expression built at runtime
    if o.nullable:
        annotation = annotation | None
    b = o.bounds(kind)
    constraints: dict[str, Any] = {
        "ge": b.get("minimum"),
        "le": b.get("maximum"),
        "gt": b.get("above"),
        "lt": b.get("below"),
    }
    description = o.help[0].upper() + o.help[1:] + "."
    extra: JsonDict | None = None
    if kind == "finetune" and o.by_task:
        description += f" Default: {format_default(o, kind)}."
        extra = {"x-task-defaults": {task: o.default_for(kind, task) for task in TASKS}}
    return annotation, Field(
        o.default_for(kind),
        description=description,
        json_schema_extra=extra,
        **{k: v for k, v in constraints.items() if v is not None},
    )


def _job_option_names(kind: str) -> list[str]:
    return [o.name for o in options_for(kind, job=True)]


# Job options both kinds share with the same default go on TrainParams; the others on each kind's class.
_SHARED = [
    o.name
    for o in options_for("pretrain", job=True)
    if "finetune" in o.kinds
    and not o.by_task
    and o.default_for("pretrain") == o.default_for("finetune")
    and o.bounds("pretrain") == o.bounds("finetune")
]


class _TrainParams(Strict):
    """Shared by both kinds. Bounds guard the service, not good practice: see docs/training.md for that."""

    devices: int = Field(
        1,
        ge=1,
        le=64,
        description="Data-parallel processes on the worker's machine (one per "
        "GPU on CUDA), through torchrun; batch_size stays the "
        "global batch. At most BERT_JOB_MAX_DEVICES.",
    )
    max_runtime: Duration | None = Field(
        None,
        description="Training time allowed, summed over attempts: seconds, or a duration such as '90m', "
        "'12h', '1d12h'. Past it the job saves a checkpoint and fails with \"time limit\". "
        "At most BERT_JOB_MAX_RUNTIME, which is also the default.",
    )

    if TYPE_CHECKING:
        # The options' fields are added by create_model (option_fields, from model/options.py), which
        # mypy cannot see; to it they read as Any here and on every subclass.
        def __getattr__(self, name: str) -> Any: ...

    @model_validator(mode="after")
    def _consistent(self):
        if self.warmup_steps is not None and self.max_steps is not None and self.warmup_steps > self.max_steps:
            raise _invalid(f"warmup_steps ({self.warmup_steps}) must not exceed max_steps ({self.max_steps})")
        if self.eval_every and not self.eval_fraction:
            raise _invalid("eval_every needs eval_fraction > 0 (there is nothing to evaluate on)")
        return self

    def to_record(self) -> dict[str, Any]:
        """What the job stores: the parameters the request set, and the service's own (devices, max_runtime)."""
        return {**self.model_dump(exclude_unset=True), "devices": self.devices, "max_runtime": self.max_runtime}


# Only the parameters a request sets are stored with its job; the run gives the others the defaults shown,
# the same `bert pretrain` / `bert finetune` give (model/options.py).
_UNSET_DEFAULTS = (
    "Parameters left out take the defaults shown, the same as the `bert {}` command's (per task "
    "where a description says so)."
)
TrainParams = create_model(
    "TrainParams",
    __base__=_TrainParams,
    __module__=__name__,
    __doc__=_TrainParams.__doc__,
    **option_fields("pretrain", _SHARED),
)

assert set(TASKS) == set(KIND_OF_TASK)  # every fine-tuning task names the dataset kind it trains on


class _FinetuneParams(TrainParams):
    @model_validator(mode="after")
    def _task_options(self):
        if self.regression and self.task != "sequence-classification":
            raise _invalid(f"regression is for task sequence-classification, not {self.task}")
        if self.task != "question-answering":
            if self.doc_stride is not None:
                raise _invalid(f"doc_stride is for task question-answering, not {self.task}")
            return self
        try:
            check_window(self.max_seq_len, self.max_query_length, self.doc_stride or 0)
        except WindowMisfit as e:
            if e.no_room:
                raise _invalid(
                    f"max_seq_len ({self.max_seq_len}) leaves no room for the context beside a question "
                    f"of max_query_length ({self.max_query_length}) and {SPECIAL_TOKENS_IN_A_PAIR} special tokens"
                ) from None
            raise _invalid(
                f"doc_stride ({self.doc_stride}) must be less than the {e.room} context tokens a window "
                f"of max_seq_len {self.max_seq_len} holds beside a question of max_query_length "
                f"{self.max_query_length}"
            ) from None
        return self


FinetuneParams = create_model(
    "FinetuneParams",
    __base__=_FinetuneParams,
    __module__=__name__,
    __doc__=_UNSET_DEFAULTS.format("finetune"),
    **option_fields("finetune", [n for n in _job_option_names("finetune") if n not in _SHARED]),
)


class ModelSize(Strict):
    """The size of a model pretrained from scratch (BERT-base: 768, 12, 12, 3072, 512)."""

    hidden_size: int = Field(256, ge=8, le=4096)
    num_hidden_layers: int = Field(4, ge=1, le=48)
    num_attention_heads: int = Field(4, ge=1, le=64)
    intermediate_size: int = Field(1024, ge=8, le=16384)
    max_position_embeddings: int = Field(512, ge=16, le=4096)

    @model_validator(mode="after")
    def _heads_divide(self):
        if self.hidden_size % self.num_attention_heads:
            raise _invalid(
                f"hidden_size ({self.hidden_size}) must be a multiple of num_attention_heads "
                f"({self.num_attention_heads})"
            )
        return self


class _PretrainParams(TrainParams):
    config: ModelSize | None = Field(None, description="From scratch only: the model's size.")
    vocab_size: int | None = Field(
        None, ge=32, le=200_000, description="From scratch only: WordPiece vocabulary learnt from the corpus."
    )
    lowercase: bool | None = Field(None, description="From scratch only: lowercase the vocabulary.")


PretrainParams = create_model(
    "PretrainParams",
    __base__=_PretrainParams,
    __module__=__name__,
    __doc__=_UNSET_DEFAULTS.format("pretrain"),
    **option_fields("pretrain", [n for n in _job_option_names("pretrain") if n not in _SHARED]),
)


PRIORITY_FIELD = Field(
    DEFAULT_PRIORITY,
    ge=PRIORITY_MIN,
    le=PRIORITY_MAX,
    description=(
        "Higher runs first; equal priorities run in the order they came. A job of higher priority that finds every "
        "worker busy makes the lowest-priority running job hand its worker back (it resumes later from its "
        "checkpoint). At most BERT_JOB_MAX_PRIORITY."
    ),
)


class PretrainJobRequest(Strict):
    kind: Literal["pretrain"]
    model_name: Name = Field(description="Name of the model to publish in DATA_DIR/models/.")
    base_model: Name | None = Field(None, description="Continue pretraining this model; omitted: from scratch.")
    dataset: Name = Field(description="A corpus uploaded with POST /datasets.")
    params: PretrainParams = Field(default_factory=PretrainParams)
    priority: int = PRIORITY_FIELD


class FinetuneJobRequest(Strict):
    kind: Literal["finetune"]
    model_name: Name = Field(description="Name of the classifier to publish in DATA_DIR/models/.")
    base_model: Name = Field(description="The model whose encoder is fine-tuned.")
    dataset: Name = Field(description="A labelled dataset uploaded with POST /datasets.")
    params: FinetuneParams = Field(default_factory=FinetuneParams)
    priority: int = PRIORITY_FIELD


CreateJobRequest = Annotated[PretrainJobRequest | FinetuneJobRequest, Field(discriminator="kind")]

CREATE_EXAMPLE = {
    "kind": "finetune",
    "model_name": "reviews-clf",
    "base_model": "bert-tiny",
    "dataset": "reviews",
    "params": {"max_steps": 200, "batch_size": 16, "lr": 5e-5, "save_every": 50},
}


# -- training jobs: responses ------------------------------------------------------------------

JobState = Literal["queued", "running", "succeeded", "failed", "cancelled"]
assert set(get_args(JobState)) == set(STATES)


class CreateJobResponse(BaseModel):
    id: str
    state: JobState
    status_url: str


class ImportModelRequest(BaseModel):
    """POST /models as JSON: a model from the Hugging Face Hub (an archive is sent as multipart instead)."""

    model_config = STRICT

    name: Name = Field(description="The model's name in DATA_DIR/models/ (an existing name gets a new version).")
    source: str = Field(
        pattern=HUB_ID_PATTERN,
        max_length=200,
        description="A Hugging Face Hub repo id, e.g. google-bert/bert-base-uncased (never a path on the server).",
    )
    revision: str | None = Field(
        None,
        max_length=200,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_./-]*$",
        description="A branch, tag or commit; default main.",
    )


IMPORT_EXAMPLE = {"name": "bert-base", "source": "google-bert/bert-base-uncased"}


class JobStatus(BaseModel):
    """A job as job.json has it, with the latest progress flattened in."""

    id: str
    kind: Literal["pretrain", "finetune", "import", "batch"]
    state: JobState
    model_name: str
    base_model: str | None
    dataset: str | None = Field(description="The training data (training jobs); null for an import or a batch.")
    params: dict[str, Any]
    step: int = Field(description="Optimizer steps done (as of the latest progress report).")
    total_steps: int
    loss: float | None = Field(description="Mean training loss over the latest logging window.")
    lr: float | None
    tokens_per_s: float | None
    eta_s: float | None = Field(description="Seconds to go at the current pace (running jobs only).")
    epoch: float | None
    rank_tokens_per_s: list[float] | None = Field(
        None, description="Tokens/s of each process, rank 0 first (jobs with devices > 1)."
    )
    latest_checkpoint: str | None = Field(description="Relative to the job directory, e.g. checkpoints/step-200.")
    attempts: int = Field(description="Times a worker started the job (a worker death costs one).")
    runtime_s: float | None = Field(description="Training time so far, summed over attempts (max_runtime counts this).")
    estimate: dict[str, Any] | None = Field(
        description="The size POST /jobs estimated (model/sizing.py): parameters and peak training memory."
    )
    cancel_requested: bool
    error: str | None = Field(
        description="Why the job failed; while it runs, why its last attempt was lost "
        "(e.g. the worker process was killed)."
    )
    eval: dict[str, Any] | None = Field(description="The latest evaluation (fine-tuning).")
    result: dict[str, Any] | None = Field(description="Set on success: the published model and final numbers.")
    created_at: str
    enqueued_at: str | None
    started_at: str | None
    finished_at: str | None
    updated_at: str
    heartbeat_at: str | None = Field(description="Last sign of life of the training process (running jobs).")
    worker: str | None
    owner: str = Field(
        LEGACY_OWNER, description="The name of the key that made the job (`admin` for jobs from before keys had names)."
    )
    events: list[dict[str, Any]]
    downloaded_bytes: int | None = Field(None, description="An import's bytes downloaded so far.")
    total_bytes: int | None = Field(None, description="An import's bytes to download in all.")
    status_url: str
    metrics_url: str
    disk_bytes: int | None = Field(None, description="Bytes its directory holds (checkpoints, mostly).")
    priority: int = Field(description="Higher runs first (training jobs); see POST /jobs.")
    queue_position: int | None = Field(
        None, description="A queued training job's place in the queue, 1 = next (GET /jobs/{id} only)."
    )
    waiting_for: str | None = Field(
        None,
        description="What a queued training job waits for: the queued jobs ahead and the running job(s) "
        "(id, priority, step of total), or a free worker (GET /jobs/{id} only).",
    )
    start_estimate_s: float | None = Field(
        None,
        description="Seconds until a queued job starts, from the pace of the running job it waits for; null when "
        "none can be had (GET /jobs/{id} only).",
    )

    @classmethod
    def from_record(
        cls, record: Mapping[str, Any], disk_bytes: int | None = None, place: Mapping[str, Any] | None = None
    ) -> JobStatus:
        """The answer for a job record (datadir's job.json); `place`: a queued job's position
        (datadir.scheduling.queue_place)."""
        progress = record.get("progress") or {}
        running = record["state"] == "running"
        step, total_steps = steps_of(record)
        return cls(
            **{
                k: record.get(k)
                for k in (
                    "id",
                    "kind",
                    "state",
                    "model_name",
                    "base_model",
                    "dataset",
                    "params",
                    "attempts",
                    "runtime_s",
                    "estimate",
                    "error",
                    "eval",
                    "result",
                    "created_at",
                    "enqueued_at",
                    "started_at",
                    "finished_at",
                    "updated_at",
                    "worker",
                    "latest_checkpoint",
                )
            },
            cancel_requested=bool(record.get("cancel_requested")),
            events=record.get("events") or [],
            owner=owner_of(record),
            heartbeat_at=record.get("heartbeat_at") if running else None,
            step=step,
            total_steps=total_steps,
            loss=progress.get("loss"),
            lr=progress.get("lr"),
            tokens_per_s=progress.get("tokens_per_s"),
            eta_s=progress.get("eta_s") if running else None,
            epoch=progress.get("epoch"),
            rank_tokens_per_s=progress.get("rank_tokens_per_s"),
            downloaded_bytes=progress.get("downloaded_bytes"),
            total_bytes=progress.get("total_bytes"),
            status_url=f"/jobs/{record['id']}",
            metrics_url=f"/jobs/{record['id']}/metrics",
            disk_bytes=disk_bytes,
            priority=record.get("priority", DEFAULT_PRIORITY),
            **(place or {}),
        )


class JobsResponse(BaseModel):
    jobs: list[JobStatus]


class JobMetricsResponse(BaseModel):
    id: str
    records: list[dict[str, Any]] = Field(description='metrics.jsonl: {"type": "train"|"eval"|"resume", "step", ...}')


# -- text-embeddings-inference (TEI) compatibility ---------------------------------------------
# The request and response shapes of huggingface/text-embeddings-inference's router
# (router/src/http/types.rs: EmbedRequest, PredictRequest, RerankRequest, TokenizeRequest, SimilarityRequest
# and their responses), so a TEI client works unchanged. As /v1/embeddings, these ignore unknown fields: TEI
# itself does (serde's default), so clients written against it may send fields we do not read.
# `model` is ours (TEI serves one model); omitted, BERT_DEFAULT_MODEL (/embed, /similarity, /tokenize),
# BERT_PREDICT_MODEL (/predict) or BERT_RERANK_MODEL (/rerank) serves the request.

TeiTruncate = Annotated[
    bool | None, Field(description="Cut inputs longer than the model's maximum instead of answering 422 (null: false).")
]
# TEI's enum deserialises as "Left" / "Right" (what huggingface_hub sends); its docs write it lower-case.
TruncationDirection = Annotated[
    Literal["Left", "Right", "left", "right"], Field(description="Which end of an input truncation cuts.")
]


class EmbedRequest(Strict):
    """TEI's POST /embed: texts to embed (at most BERT_MAX_INPUTS), mean-pooled."""

    model_config = {
        **examples(
            one_text={"inputs": "What is Deep Learning?"},
            several_texts={"inputs": ["first sentence", "second sentence"], "normalize": False},
        ),
        "extra": "ignore",
    }
    inputs: str | Annotated[list[str], Field(min_length=1)]
    truncate: TeiTruncate = None
    truncation_direction: TruncationDirection = "Right"
    prompt_name: PromptName = None
    normalize: bool = Field(True, description="Scale each vector to unit L2 norm (TEI's default: true).")
    model: ModelName | None = None
    dimensions: Dimensions = None
    prompt: Prompt = None
    long_inputs: LongInputs = None


EmbedResponse = list[list[float]]  # one vector per input, a list even for one input (as TEI)

# TEI's PredictInput: a string, a pair [a, b], or a batch of [text] / [a, b] lists.
PredictSequence = Annotated[list[str], Field(min_length=1, max_length=2)]


class PredictRequest(Strict):
    """TEI's POST /predict: a text, a pair ["a", "b"], or a batch [["a"], ["a", "b"], ...] for a classifier."""

    model_config = {
        **examples(
            one_text={"inputs": "I like you. I love you"},
            a_pair={"inputs": ["A man is eating.", "Someone eats."]},
            a_batch={"inputs": [["I like you."], ["A man is eating.", "Someone eats."]], "raw_scores": True},
        ),
        "extra": "ignore",
    }
    inputs: str | PredictSequence | Annotated[list[PredictSequence], Field(min_length=1)]
    truncate: TeiTruncate = None
    truncation_direction: TruncationDirection = "Right"
    raw_scores: bool = Field(
        False, description="Logits as they are; else softmax over the labels (sigmoid for one label), as TEI."
    )
    top_k: LabelTopK = None
    model: ModelName | None = None


class Prediction(BaseModel):
    score: float
    label: str


# One input: its labels, best first; a batch: one such list per input.
PredictResponse = list[Prediction] | list[list[Prediction]]


class RerankRequest(Strict):
    """TEI's POST /rerank: texts ranked by a cross-encoder's relevance to the query (at most BERT_MAX_INPUTS)."""

    model_config = {
        **examples(
            rank_texts={
                "query": "What is Deep Learning?",
                "texts": ["Deep Learning is a kind of machine learning.", "Paris is the capital of France."],
                "return_text": True,
            }
        ),
        "extra": "ignore",
    }
    query: str
    texts: Annotated[list[str], Field(min_length=1)]
    truncate: TeiTruncate = None
    truncation_direction: TruncationDirection = "Right"
    raw_scores: bool = Field(False, description="The logit as it is; else its sigmoid.")
    return_text: bool = Field(False, description="Add each text to its rank.")
    model: ModelName | None = None


class Rank(BaseModel):
    index: int = Field(description="The text's position in `texts`.")
    text: str | None = Field(None, description="Only with return_text.")
    score: float


RerankResponse = list[Rank]  # best first


class TokenizeRequest(Strict):
    """TEI's POST /tokenize: the model's tokens of each text, with character offsets."""

    model_config = {
        **examples(
            one_text={"inputs": "test"},
            no_special_tokens={"inputs": ["first text", "second"], "add_special_tokens": False},
        ),
        "extra": "ignore",
    }
    inputs: str | Annotated[list[str], Field(min_length=1)]
    add_special_tokens: bool = True
    prompt_name: PromptName = None
    model: ModelName | None = None


class SimpleToken(BaseModel):
    id: int
    text: str = Field(description="The input's characters start:stop; a special token's own text.")
    special: bool
    start: int | None = Field(description="Character offset in the input; null for a special token.")
    stop: int | None


TokenizeResponse = list[list[SimpleToken]]  # one list per input, a list even for one input (as TEI)


class SimilarityInput(Strict):
    model_config = {"extra": "ignore"}
    source_sentence: str = Field(description="The text the others are compared with.")
    sentences: Annotated[list[str], Field(min_length=1, description="The texts compared with source_sentence.")]


class SimilarityParameters(Strict):
    model_config = {"extra": "ignore"}
    truncate: TeiTruncate = None
    truncation_direction: TruncationDirection = "Right"
    prompt_name: PromptName = None


class SimilarityRequest(Strict):
    """TEI's POST /similarity (huggingface_hub's sentence_similarity): the cosine similarity of the
    source sentence's embedding with each sentence's (all together at most BERT_MAX_INPUTS texts)."""

    model_config = {
        **examples(
            compare={
                "inputs": {
                    "source_sentence": "What is Deep Learning?",
                    "sentences": ["What is Machine Learning?", "Paris is in France."],
                }
            }
        ),
        "extra": "ignore",
    }
    inputs: SimilarityInput
    parameters: SimilarityParameters | None = None
    model: ModelName | None = None


SimilarityResponse = list[float]  # one cosine similarity per sentence, in their order


# -- OpenAI-shaped batches: /v1/files and /v1/batches (app/serving/batch_jobs.py) ---------------------------

# The routes a batch's lines may call; each line's body is validated by that route's request model.
BatchEndpoint = Literal[
    "/v1/embeddings",
    "/embeddings",
    "/fill-mask",
    "/nsp",
    "/classify",
    "/token-classification",
    "/question-answering",
    "/rerank",
]
BATCH_ENDPOINTS: tuple[str, ...] = get_args(BatchEndpoint)
BatchStatus = Literal[
    "validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled"
]


class FileObject(BaseModel):
    """OpenAI's file object."""

    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int = Field(description="Unix seconds.")
    filename: str
    purpose: str = Field(description='"batch" (an uploaded input), "batch_output" (a batch\'s output or error file).')


class FileList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FileObject]
    has_more: bool = False


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool


class CreateBatchRequest(BaseModel):
    """POST /v1/batches: OpenAI's batch request."""

    model_config = ConfigDict(extra="forbid")

    input_file_id: str = Field(description="A file uploaded with purpose batch: one request a line.")
    endpoint: BatchEndpoint = Field(description="The route every line calls (each line's `url` must be it).")
    completion_window: Literal["24h"] = Field(description='Only "24h", as OpenAI\'s API.')
    metadata: dict[str, str] | None = Field(None, max_length=16, description="Up to 16 string pairs, kept as given.")


class BatchRequestCounts(BaseModel):
    total: int
    completed: int
    failed: int


class BatchError(BaseModel):
    code: str
    message: str
    param: str | None = None
    line: int | None = None


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchError]


class BatchObject(BaseModel):
    """OpenAI's batch object; the batch is also the job of kind "batch" with the same id (GET /jobs/{id})."""

    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    errors: BatchErrors | None
    input_file_id: str
    completion_window: str
    status: BatchStatus
    output_file_id: str | None
    error_file_id: str | None
    created_at: int
    in_progress_at: int | None
    expires_at: int | None
    finalizing_at: int | None
    completed_at: int | None
    failed_at: int | None
    expired_at: int | None = None
    cancelling_at: int | None
    cancelled_at: int | None
    request_counts: BatchRequestCounts
    metadata: dict[str, str] | None


class BatchList(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class KeyUsage(BaseModel):
    requests: int = Field(description="Requests made with the key since the service started (refused ones included).")
    tokens: int = Field(description="Tokens of its inference requests since the service started.")
    rate_limited: int = Field(description="Its requests refused (429) by its own limits since the service started.")
    job_seconds: float = Field(description="Worker time of its jobs, from the job records (all time).")


class UsageResponse(BaseModel):
    """Usage per key, by the key's name; the counters are this replica's, since it started."""

    keys: dict[str, KeyUsage]
