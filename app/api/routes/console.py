"""GET /console: the web console, static files from app/console/ (HTML, CSS, JavaScript and the
vendored uPlot; no build step), and GET /console/job-form.json, the training parameters the
new-job form offers, read off the request types of app/schemas/jobs.py (built from model/options.py) so
its defaults and bounds are the API's and the `bert` command's, and the dataset kinds each task trains on
(datadir/datasets.py's KINDS_OF_TASK).

Open without a key: none of this carries data. The page asks for the keys and sends them itself,
as `Authorization: Bearer`, to the routes that need them. A Content-Security-Policy keeps every
script, style, image and request on the page's own origin.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

from fastapi import APIRouter
from fastapi.responses import FileResponse, JSONResponse, RedirectResponse, Response

from app.errors import ServiceError, responses
from app.schemas.jobs import FinetuneParams, PretrainParams
from datadir.datasets import KINDS_OF_TASK

router = APIRouter(tags=["console"])

ROOT = Path(__file__).resolve().parents[2] / "console"
# Every file the console serves, and its type: a fixed table, so no path outside it can be asked for.
ASSETS = {
    "console.js": "text/javascript",
    "console.css": "text/css",
    "vendor/uPlot.iife.min.js": "text/javascript",
    "vendor/uPlot.min.css": "text/css",
}
HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",  # revalidated on every load, so an upgraded service serves its own console
}


@router.get("/console", response_class=FileResponse, include_in_schema=False)
async def console() -> FileResponse:
    """The console's page."""
    return FileResponse(ROOT / "index.html", media_type="text/html", headers=HEADERS)


@router.get("/console/job-form.json", include_in_schema=False)
async def job_form() -> JSONResponse:
    """The new-job form's parameters per kind: name, type, default (and per task), bounds, description; and
    `dataset_kinds`, the kinds of dataset each task trains on (`pretrain`: a corpus)."""
    kinds = {"pretrain": ["corpus"], **{task: list(k) for task, k in KINDS_OF_TASK.items()}}
    return JSONResponse({**form_fields(), "dataset_kinds": kinds}, headers=HEADERS)


@router.get(
    "/console/{asset:path}", response_class=FileResponse, include_in_schema=False, responses=responses("not_found")
)
async def console_asset(asset: str) -> Response:
    """One of the console's static files; `/console/` (a trailing slash) leads to the page."""
    if asset == "":
        return RedirectResponse("/console", status_code=308)
    if asset not in ASSETS:
        raise ServiceError("not_found", f"no route /console/{asset}")
    return FileResponse(ROOT / asset, media_type=ASSETS[asset], headers=HEADERS)


@cache
def form_fields() -> dict[str, list[dict[str, Any]]]:
    return {
        "finetune": _fields(FinetuneParams.model_json_schema()),
        "pretrain": _fields(PretrainParams.model_json_schema()),
    }


def _fields(schema: dict, prefix: str = "", defs: dict | None = None) -> list[dict[str, Any]]:
    """The leaves of a JSON schema's properties, nested objects (params.config) flattened to dotted names."""
    defs = schema.get("$defs", {}) if defs is None else defs
    fields = []
    for name, prop in schema["properties"].items():
        variants = [defs[v["$ref"].rsplit("/", 1)[1]] if "$ref" in v else v for v in prop.get("anyOf", [prop])]
        variants = [v for v in variants if v.get("type") != "null"]
        nested = next((v for v in variants if v.get("type") == "object"), None)
        if nested is not None:
            fields += _fields(nested, f"{prefix}{name}.", defs)
            continue
        types = {v.get("type") for v in variants}
        kind = "enum" if "enum" in prop else types.pop() if len(types) == 1 else "duration"
        description = prop.get("description") or (schema.get("description") if prefix else None)
        field = {"name": prefix + name, "type": kind, "default": prop.get("default"), "description": description}
        for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "enum"):
            if key in prop:
                field[key] = prop[key]
        array = next((v for v in variants if v.get("type") == "array"), None)
        if array is not None:  # a list option: its items' type, bounds or choices (the form splits on commas)
            field["items"] = array["items"]
        if "x-task-defaults" in prop:  # a fine-tuning option whose default depends on the task
            field["task_defaults"] = prop["x-task-defaults"]
        fields.append(field)
    return fields
