"""Typed dependencies shared by the routers: the running service and the API-key check."""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from .errors import ServiceError
from .service import Service

_bearer = HTTPBearer(auto_error=False, description="BERT_API_KEY, when the service has one.")


def get_service(request: Request) -> Service:
    return request.app.state.service


ServiceDep = Annotated[Service, Depends(get_service)]


async def require_api_key(
    service: ServiceDep, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> None:
    """When BERT_API_KEY is set, demand `Authorization: Bearer <key>` (compared in constant time)."""
    key = service.settings.api_key_value()
    if key is None:
        return
    given = credentials.credentials if credentials is not None else ""
    if not hmac.compare_digest(given.encode(), key.encode()):
        raise ServiceError("unauthorized", "missing or wrong API key: send 'Authorization: Bearer <BERT_API_KEY>'")
