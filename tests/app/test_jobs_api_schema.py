"""Property-based check of /jobs and /datasets against their OpenAPI schema (schemathesis): no 5xx
but the documented 503 (no broker here), and every answer matches its declared status and body."""

from __future__ import annotations

import tempfile
from pathlib import Path

import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from app.main import create_app
from app.settings import Settings
from tests.helpers import BASE_MODEL, make_data_dir

CHECKS = [status_code_conformance, content_type_conformance, response_schema_conformance]

APP = create_app(
    Settings(
        data_dir=make_data_dir(Path(tempfile.mkdtemp(prefix="bertserve-jobs-schema-"))),
        default_model=BASE_MODEL,
        device="cpu",
        load="lazy",
        broker_url="redis://127.0.0.1:1/0",
        max_dataset_bytes=10_000,
    )
)
CONFIG = schemathesis.Config.from_dict({"phases": {"coverage": {"enabled": False}}})
schema = schemathesis.openapi.from_asgi("/openapi.json", APP, config=CONFIG).include(tag=["jobs", "datasets"])


@schema.parametrize()
@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
def test_training_routes_conform_to_their_schema(case):
    response = case.call_and_validate(checks=CHECKS)
    assert response.status_code < 500 or response.status_code == 503
