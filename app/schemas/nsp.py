"""POST /nsp's request and response (app/api/routes/nsp.py)."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, Field

from app.schemas.shared import ModelName, Strict, TextPair, Truncate, examples


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
