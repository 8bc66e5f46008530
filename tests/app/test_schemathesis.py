"""Property-based API test: schemathesis generates requests from /openapi.json (valid and invalid)
and checks that no answer is a 5xx and every answer matches the documented status codes, content
types and schemas (the one error body included). Bounded: 20 examples per operation.

A second run puts hostile text into the inference bodies (issue 12): lone UTF-16 surrogates, which
JSON may escape but no text may hold, and hundreds of [MASK] tokens in one input."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path

import schemathesis
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from app.main import create_app
from model.modeling import (
    BertForPreTraining,
    BertForQuestionAnswering,
    BertForSequenceClassification,
    BertForTokenClassification,
    BertModel,
)
from tests.app.conftest import save_tiny, settings_for

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    response_headers_conformance,
]


# Named as in the OpenAPI examples, so the examples phase reaches real models.
EXAMPLE_MODELS = {
    "bert-tiny": (BertForPreTraining, {}),
    "sentiment": (BertForSequenceClassification, {"id2label": {0: "negative", 1: "positive"}}),
    "nli": (BertForSequenceClassification, {"id2label": {0: "entailment", 1: "neutral", 2: "contradiction"}}),
    "encoder": (BertModel, {}),
    "ner": (BertForTokenClassification, {"id2label": {0: "O", 1: "B-PER", 2: "I-PER", 3: "B-LOC", 4: "I-LOC"}}),
    "qa": (BertForQuestionAnswering, {}),
}


def _data_dir() -> Path:
    # Built at import: schemathesis' lazy `from_fixture` loader does not work with pytest 9.
    root = Path(tempfile.mkdtemp(prefix="bertserve-schemathesis-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    for i, (name, (cls, extra)) in enumerate(EXAMPLE_MODELS.items()):
        save_tiny(root / "models" / name, cls, seed=i, **extra)
    return root


# max_inputs small: generated lists stay cheap to run through the models.
APP = create_app(settings_for(_data_dir(), default_model="bert-tiny", max_inputs=8, max_wait_ms=0.0))
# The inference service's own operations (other resources have their own tests).
# Examples and fuzzing phases (20 cases per operation); the coverage phase (hundreds of boundary
# cases per operation, also clean when last run) is left to a manual `schemathesis run`.
CONFIG = schemathesis.Config.from_dict({"phases": {"coverage": {"enabled": False}}})
schema = schemathesis.openapi.from_asgi("/openapi.json", APP, config=CONFIG)
# Promoting and deleting models would change what the other cases run on: tests/app/test_model_versions.py.
# POST /models (an import job behind the admin key) has its own tests, like /jobs: tests/app/test_import_api.py.
schema = (
    schema.include(tag=["inference", "models", "operations"])
    .exclude(method=["DELETE"])
    .exclude(path_regex="/promote$")
    .exclude(method="POST", path="/models")
)


@schema.parametrize()
@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
def test_api_conforms_to_its_schema(case):
    case.call_and_validate(checks=CHECKS)


LONE_SURROGATES = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
HOSTILE_TEXT = st.one_of(
    st.text(st.one_of(LONE_SURROGATES, st.characters(max_codepoint=0x2FFF)), min_size=1, max_size=20).filter(
        lambda t: any(0xD800 <= ord(c) <= 0xDFFF for c in t)
    ),
    st.integers(1, 600).map(lambda n: "[MASK] " * n),  # far more masks than positions
    st.tuples(st.integers(1, 300), LONE_SURROGATES).map(lambda nc: f"[MASK]{nc[1]} " * nc[0]),
)


def _hostile(value):
    """A strategy for `value` with any of its strings possibly swapped for hostile text."""
    if isinstance(value, str):
        return st.one_of(st.just(value), HOSTILE_TEXT)
    if isinstance(value, list):
        return st.tuples(*map(_hostile, value)).map(list)
    if isinstance(value, dict):
        return st.fixed_dictionaries({k: _hostile(v) for k, v in value.items()})
    return st.just(value)


def flatmap_body(context, body):
    return _hostile(body)


inference = schema.include(tag=["inference"])


@inference.hooks.apply(flatmap_body)
@inference.parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
def test_hostile_text_is_never_a_server_error(case):
    case.call_and_validate(checks=CHECKS)


def test_the_run_reached_every_outcome():
    """The examples and generated cases hit real models (200s), not only rejections."""
    text = APP.state.service.metrics.render().decode()
    for route in (
        "/fill-mask",
        "/nsp",
        "/embeddings",
        "/v1/embeddings",
        "/classify",
        "/token-classification",
        "/question-answering",
    ):
        for status in ("200", "422"):
            assert f'route="{route}",status="{status}"' in text, (route, status)
