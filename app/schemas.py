"""Request and response types (`<Verb>Request` / `<Verb>Response`), with the examples /docs shows.

Limits that depend on settings (inputs per request, tokens per input) are checked in
app/pipelines.py, since a JSON schema cannot read the environment; their documentation is here.
A single input gets a single result, a list of inputs a list of results in the same order.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from model.datadir import NAME_PATTERN

ModelName = Annotated[str, Field(pattern=NAME_PATTERN, max_length=64,
                                 description="A model in DATA_DIR/models/; omitted = the default model.",
                                 examples=["bert-tiny"])]
Truncate = Annotated[bool, Field(description="Cut inputs longer than the model's maximum instead of "
                                             "answering 422.")]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


_EXAMPLES: dict[str, dict[str, dict]] = {}


def examples(**named: dict) -> ConfigDict:
    """A model config whose JSON schema carries these request examples; `body_examples` names them."""
    config = ConfigDict(extra="forbid", json_schema_extra={"examples": list(named.values())})
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
        several_inputs_and_targets={"inputs": ["the [MASK] sat on the mat.", "a [MASK] of [MASK]"], "top_k": 2,
                                    "targets": ["cat", "dog"]},
    )
    inputs: str | Annotated[list[str], Field(min_length=1)]
    top_k: Annotated[int, Field(ge=1, le=100, description="Candidates per [MASK].")] = 5
    targets: Annotated[list[Annotated[str, Field(min_length=1, max_length=100)]] | None,
                       Field(min_length=1, max_length=1000,
                             description="Only score these tokens (a word outside the vocabulary "
                                         "stands for its first WordPiece, as in transformers).")] = None
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

class EmbeddingsRequest(Strict):
    """Texts to embed (at most BERT_MAX_INPUTS)."""

    model_config = examples(
        one_text={"inputs": "a sentence to embed", "pooling": "mean", "normalize": True},
        several_texts_cls_pooling={"inputs": ["first sentence", "second sentence"], "pooling": "cls",
                                   "normalize": False},
    )
    inputs: str | Annotated[list[str], Field(min_length=1)]
    pooling: Literal["mean", "cls"] = Field("mean", description="mean: average of the (unpadded) last "
                                                                "hidden states; cls: the [CLS] vector.")
    normalize: bool = Field(True, description="Scale each vector to unit L2 norm.")
    model: ModelName | None = None
    truncate: Truncate = False


EmbeddingsResponse = list[float] | list[list[float]]


class OpenAIEmbeddingsRequest(BaseModel):
    """OpenAI's embeddings request (mean pooling, normalised, as sentence-transformers models)."""

    model_config = {**examples(openai_client={"input": ["first sentence", "second sentence"], "model": "bert-tiny"}),
                    "extra": "ignore"}  # OpenAI clients send fields we do not use
    input: str | Annotated[list[str], Field(min_length=1)]
    model: ModelName | None = None
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="base64: little-endian float32 bytes, as OpenAI's clients ask for by default.")
    dimensions: Annotated[int, Field(ge=1)] | None = Field(
        None, description="Must equal the model's hidden size if given (no truncated embeddings).")
    user: str | None = None


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

class ClassifyRequest(Strict):
    """Texts or text pairs for a fine-tuned classifier."""

    model_config = examples(
        one_text={"inputs": "a gripping, beautifully shot film", "model": "sentiment"},
        text_pairs={"inputs": [{"text_a": "A man is eating.", "text_b": "Someone eats."}], "model": "nli"},
    )
    inputs: str | TextPair | Annotated[list[str | TextPair], Field(min_length=1)]
    model: ModelName
    truncate: Truncate = False


class ClassifyResult(BaseModel):
    label: str = Field(description="The best label (config.id2label).")
    score: float = Field(description="Its score.")
    scores: dict[str, float] = Field(description="Every label's score: softmax over labels (sigmoid for a "
                                                 "single or multi-label head, the raw value for regression).")


ClassifyResponse = ClassifyResult | list[ClassifyResult]


# -- models and operations ---------------------------------------------------------------------

class ModelInfo(BaseModel):
    name: str
    architecture: str | None = Field(description="The class the weights load as, e.g. BertForPreTraining.")
    heads: list[str] = Field(description="What it can serve beyond embeddings: mlm, nsp, classifier.")
    labels: list[str] | None = Field(None, description="Classifier labels, in id order.")
    num_parameters: int | None
    max_position_embeddings: int | None
    hidden_size: int | None
    default: bool
    loaded: bool
    precision: str = Field(description="Inference precision: fp32, bf16 or int8 (BERT_PRECISION, BERT_MODEL_PRECISION).")
    error: str | None = Field(None, description="Why the directory cannot be served, if it cannot.")


class ModelsResponse(BaseModel):
    models: list[ModelInfo]
    default: str | None


class HealthResponse(BaseModel):
    status: Literal["ok"] = "ok"


class ReadyResponse(BaseModel):
    status: Literal["ready"] = "ready"
    model: str


class InfoResponse(BaseModel):
    name: str
    version: str
    device: str
    torch: str
    python: str
    settings: dict
