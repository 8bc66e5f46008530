"""POST /fill-mask's request and response (app/api/routes/fill_mask.py)."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, Field

from app.schemas.shared import ModelName, Strict, Truncate, examples


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
