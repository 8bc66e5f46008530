"""What the request and response types of several routes share: `Strict`, the base of every request
type, with its one strictness rule; the named examples /docs shows; a request's `model` and `truncate`;
a text pair; a name in a job; the answer of a DELETE.

The strictness rule, for every request body: JSON types must match exactly (`"top_k": "5"` is not a
number, `"normalize": 1` not a boolean), unknown fields are errors and NaN/Infinity are refused.
The exceptions are /v1/embeddings and TEI's routes, which ignore unknown fields (embeddings.py, tei.py).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from datadir import NAME_MAX_LENGTH, NAME_PATTERN, NAME_RULE, valid_name
from model.tokenizer import lone_surrogate_at

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
            raise invalid(f"{where or 'body'} is not valid Unicode: lone surrogate {char!r} at character {at}")
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


def invalid(message: str) -> PydanticCustomError:
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


def _check_name(value: str) -> str:
    if not valid_name(value):
        raise invalid(NAME_RULE)
    return value


# A model, dataset or base-model name in a job or an import: one plain path component (datadir's rule).
Name = Annotated[
    str, Field(min_length=1, max_length=NAME_MAX_LENGTH, examples=["reviews"]), AfterValidator(_check_name)
]


class DeletedResponse(BaseModel):
    """What a DELETE removed and the disk space it freed."""

    deleted: Literal["model", "version", "dataset", "job"]
    name: str = Field(description="The model's or dataset's name, or the job's id.")
    version: int | None = Field(None, description="The version deleted (DELETE /models/{name}/versions/{version}).")
    freed_bytes: int
