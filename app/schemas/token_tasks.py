"""POST /token-classification's and POST /question-answering's requests and responses
(app/api/routes/token_tasks.py), in the shapes of transformers' pipelines: "token-classification"
(TokenClassificationPipeline) and 4.x's "question-answering" (QuestionAnsweringPipeline);
app/serving/ner_pipeline.py and app/serving/qa_pipeline.py say what is followed.
"""

from __future__ import annotations

from typing import Annotated, Literal, Self

from pydantic import BaseModel, Field, model_validator

from app.schemas.shared import ModelName, Strict, Truncate, examples, invalid


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
    def _same_shape(self) -> Self:
        if isinstance(self.question, str) != isinstance(self.context, str) or (
            not isinstance(self.question, str) and len(self.question) != len(self.context)
        ):
            raise invalid("question and context must both be strings, or lists of the same length")
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
