"""Lists of routes that follow from the routers rather than being kept by hand: the paths under the request
deadline (app/api/middleware.py's deadline_paths, over app/api/inference.py's InferenceRouter), and the
routes the balancer may repeat on another replica (deploy/compose/haproxy.cfg's `acl inference`)."""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

import pytest
from fastapi import FastAPI

import app.api.routes
from app.api.inference import InferenceRouter
from app.api.middleware import DeadlineMiddleware
from app.main import create_app
from tests.app.conftest import settings_for

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def service_app(tmp_path_factory) -> FastAPI:
    return create_app(settings_for(tmp_path_factory.mktemp("data")))


def deadline_paths_of(service_app: FastAPI) -> frozenset[str]:
    (paths,) = [m.kwargs["paths"] for m in service_app.user_middleware if m.cls is DeadlineMiddleware]
    return paths


def inference_routers() -> dict[str, InferenceRouter]:
    """Every route module's router that is an inference router, by module name."""
    modules = {
        m.name: importlib.import_module(f"app.api.routes.{m.name}")
        for m in pkgutil.iter_modules(app.api.routes.__path__)
    }
    return {
        name: module.router
        for name, module in modules.items()
        if isinstance(getattr(module, "router", None), InferenceRouter)
    }


def test_the_deadline_covers_the_routes_of_the_inference_routers_and_nothing_else(service_app):
    routers = inference_routers()
    assert set(routers) == {"fill_mask", "nsp", "embeddings", "classify", "token_tasks", "tei", "embed_multi"}
    routes = [route for router in routers.values() for route in router.routes]
    assert all(route in service_app.state.routes for route in routes)  # every one of them is served
    assert all(route.methods == {"POST"} for route in routes)
    paths = deadline_paths_of(service_app)
    assert paths == {route.path for route in routes}
    assert {"/embeddings", "/v1/embeddings", "/fill-mask", "/tokenize", "/"} <= paths  # "/": TEI's
    assert not {"/jobs", "/models", "/v1/models", "/datasets", "/v1/batches", "/health", "/metrics"} & paths


def test_the_balancer_repeats_exactly_the_inference_routes(service_app):
    """haproxy.cfg's rule: a request that did not reach a replica is repeated on another only when that is
    safe, for reads (GET, HEAD) and inference; never what creates something (jobs, uploads, imports, batches)."""
    lines = [
        line.split("#")[0].split() for line in (ROOT / "deploy" / "compose" / "haproxy.cfg").read_text().splitlines()
    ]
    assert ["http-request", "disable-l7-retry", "unless", "inference", "or", "reading"] in lines
    assert ["acl", "reading", "method", "GET", "HEAD"] in lines
    (acl,) = [line[3:] for line in lines if line[:3] == ["acl", "inference", "path"]]
    assert len(acl) == len(set(acl))
    assert set(acl) == deadline_paths_of(service_app)
