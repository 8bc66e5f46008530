"""POST /embeddings' and POST /v1/embeddings' requests and responses (app/api/routes/embeddings.py),
and the embedding options they share with TEI's routes (tei.py).

/v1/embeddings ignores unknown fields, the exception to the strictness rule (shared.py): OpenAI's client
libraries may send options this service does not implement, and add new ones over time; refusing them
would break clients that work against OpenAI.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field

from app.schemas.shared import ModelName, Strict, Truncate, examples

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
        one_text={"inputs": "a sentence to embed"},
        several_texts_cls_pooling={
            "inputs": ["first sentence", "second sentence"],
            "pooling": "cls",
            "normalize": False,
        },
    )
    inputs: str | Annotated[list[str], Field(min_length=1)]
    pooling: Literal["mean", "cls"] | None = Field(
        None,
        description=(
            "Omitted: the model's own pooling (its sentence-transformers Pooling module; mean without one), as "
            "sentence-transformers encodes with it. mean: the average of the (unpadded) last hidden states; "
            "cls: the [CLS] vector."
        ),
    )
    normalize: bool | None = Field(
        None,
        description=(
            "Scale each vector to unit L2 norm. Omitted: as the model does (true when it has a sentence-transformers "
            "Normalize module, or no modules.json at all; false when its modules.json has none)."
        ),
    )
    model: ModelName | None = None
    truncate: Truncate = False
    dimensions: Dimensions = None
    prompt_name: PromptName = None
    prompt: Prompt = None
    long_inputs: LongInputs = None


EmbeddingsResponse = list[float] | list[list[float]]


class OpenAIEmbeddingsRequest(Strict):
    """OpenAI's embeddings request: the model's own pooling, and always unit length, as OpenAI's embeddings are."""

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
