"""text-embeddings-inference's request and response shapes (app/api/routes/tei.py): those of
huggingface/text-embeddings-inference's router (router/src/http/types.rs: EmbedRequest, EmbedSparseRequest,
EmbedAllRequest, PredictRequest, RerankRequest, TokenizeRequest, DecodeRequest, SimilarityRequest and their
responses), so a TEI client works unchanged.

As /v1/embeddings, these ignore unknown fields: TEI itself does (serde's default), so clients written
against it may send fields we do not read. `model` is ours (TEI serves one model); omitted,
BERT_DEFAULT_MODEL (/embed, /embed_sparse, /embed_all, /similarity, /tokenize, /decode), BERT_PREDICT_MODEL (/predict) or BERT_RERANK_MODEL
(/rerank) serves the request.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field

from app.schemas.classify import LabelTopK
from app.schemas.embeddings import Dimensions, LongInputs, Prompt, PromptName
from app.schemas.shared import ModelName, Strict, examples

TeiTruncate = Annotated[
    bool | None, Field(description="Cut inputs longer than the model's maximum instead of answering 422 (null: false).")
]
# TEI's enum deserialises as "Left" / "Right" (what huggingface_hub sends); its docs write it lower-case.
TruncationDirection = Annotated[
    Literal["Left", "Right", "left", "right"], Field(description="Which end of an input truncation cuts.")
]


class EmbedRequest(Strict):
    """TEI's POST /embed: texts to embed (at most BERT_MAX_INPUTS), pooled as the model's sentence-transformers
    Pooling says (as TEI reads 1_Pooling/config.json; mean without one)."""

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
    normalize: bool = Field(
        True, description="Scale each vector to unit L2 norm (TEI's default: true, whatever the model's modules)."
    )
    model: ModelName | None = None
    dimensions: Dimensions = None
    prompt: Prompt = None
    long_inputs: LongInputs = None


EmbedResponse = list[list[float]]  # one vector per input, a list even for one input (as TEI)


class EmbedSparseRequest(Strict):
    """TEI's POST /embed_sparse: each text's SPLADE vector (at most BERT_MAX_INPUTS texts), as its nonzero
    entries, from a model whose files say SPLADE pooling (or any masked-LM model with "pooling": "splade")."""

    model_config = {
        **examples(
            one_text={"inputs": "What is Deep Learning?"},
            best_ten={"inputs": ["first text", "second text"], "top_k": 10, "return_tokens": True},
        ),
        "extra": "ignore",
    }
    inputs: str | Annotated[list[str], Field(min_length=1)]
    truncate: TeiTruncate = None
    truncation_direction: TruncationDirection = "Right"
    prompt_name: PromptName = None
    model: ModelName | None = None
    top_k: int | None = Field(None, ge=1, description="Keep each vector's k largest entries, largest first.")
    threshold: float = Field(0.0, ge=0.0, description="Drop the entries whose value is at most this (0: the zeros).")
    return_tokens: bool = Field(False, description="Add each entry's vocabulary token beside its index.")
    pooling: Literal["splade"] | None = Field(
        None,
        description='"splade": SPLADE pooling over the MLM logits of a model whose files do not say it '
        "(any model with a masked-LM head).",
    )


class SparseValue(BaseModel):
    index: int = Field(description="The vocabulary token's id.")
    value: float
    token: str | None = Field(None, description="The vocabulary token, with return_tokens.")


# one list per input (as TEI), by index, or largest first with top_k
EmbedSparseResponse = list[list[SparseValue]]


class EmbedAllRequest(Strict):
    """TEI's POST /embed_all: every token's last hidden state, per text (BERT_MAX_ANSWER_VALUES bounds them)."""

    model_config = {**examples(one_text={"inputs": "What is Deep Learning?"}), "extra": "ignore"}
    inputs: str | Annotated[list[str], Field(min_length=1)]
    truncate: TeiTruncate = None
    truncation_direction: TruncationDirection = "Right"
    prompt_name: PromptName = None
    model: ModelName | None = None


EmbedAllResponse = list[list[list[float]]]  # per input, per token ([CLS] and [SEP] included): its vector


class DecodeRequest(Strict):
    """TEI's POST /decode: token ids back to text, one list of ids or several."""

    model_config = {
        **examples(one={"ids": [101, 3231, 102]}, several={"ids": [[101, 3231, 102]], "skip_special_tokens": False}),
        "extra": "ignore",
    }
    ids: list[Annotated[int, Field(ge=0)]] | Annotated[list[list[Annotated[int, Field(ge=0)]]], Field(min_length=1)]
    skip_special_tokens: bool = True
    model: ModelName | None = None


DecodeResponse = list[str]  # one text per list of ids, a list even for one (as TEI)

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
