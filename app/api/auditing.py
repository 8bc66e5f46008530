"""`async with audited(request, action, target) as entry:` around a route's change: one line in the
audit log (datadir/audit.py) naming the request's key, whether the change went through or the error
type it was refused with. The route may sharpen `entry["target"]` once it knows more (a new job's id)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import uuid
from collections.abc import AsyncIterator

from fastapi import Request

from app.api.deps import CALLER_KEY
from app.errors import ServiceError
from app.keys.keyring import ANONYMOUS
from datadir import audit

log = logging.getLogger("bertserve")
REQUEST_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")  # fullmatch: `$` would let a final newline in
REQUEST_ID_KEY = (
    "bertserve.request_id"  # scope key: the id the outermost middleware gave the request (app/api/tracing.py)
)


def request_id(request: Request) -> str:
    """The request's id (app/api/tracing.py): the client's X-Request-ID when it is a plain one, else a new id."""
    if (known := request.scope.get(REQUEST_ID_KEY)) is not None:
        return known
    given = request.headers.get("x-request-id", "")
    return given if REQUEST_ID.fullmatch(given) else uuid.uuid4().hex


@contextlib.asynccontextmanager
async def audited(request: Request, action: str, target: str) -> AsyncIterator[dict]:
    entry = {"target": target}
    outcome = "internal"
    try:
        yield entry
        outcome = "ok"
    except ServiceError as e:
        outcome = e.error_type
        raise
    finally:
        key = request.scope.get(CALLER_KEY, ANONYMOUS).name
        data_dir = request.app.state.settings.data_dir
        rid = request_id(request)
        log.info("%s of %s by key '%s': %s (request %s)", action, entry["target"], key, outcome, rid)
        await asyncio.to_thread(
            audit.append, data_dir, key, action, entry["target"], outcome, request_id=rid, source="api"
        )
