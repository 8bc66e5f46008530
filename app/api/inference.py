"""What the inference routers share: their router type, whose routes are the ones under the request
deadline (app/api/middleware.py's deadline_paths reads them off it, as key_guards reads the scopes off
the routers' dependencies), the errors every inference route can answer, and OpenAPI's 200 example.
"""

from typing import Any

from fastapi import APIRouter

from app.errors import responses


class InferenceRouter(APIRouter):
    """A router of routes whose work is a forward pass or tokenising: they get BERT_REQUEST_TIMEOUT and
    stop when their client goes (DeadlineMiddleware). Safe to repeat, so the balancer may retry them
    (deploy/compose/haproxy.cfg's `acl inference`)."""


INFERENCE_ERRORS = responses("validation", "unauthorized", "not_found", "too_large", "overloaded", "unavailable")


def ok(example: Any) -> dict[int | str, dict[str, Any]]:
    """OpenAPI's 200 with an example body, for routes whose response model has none."""
    return {200: {"content": {"application/json": {"example": example}}}}
