"""POST /classify's request and response (app/api/routes/classify.py), and how many labels' scores an
answer holds, which TEI's /predict shares (tei.py)."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, Field

from app.schemas.shared import ModelName, Strict, TextPair, Truncate, examples
from app.settings import Settings

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
