"""Pure ASGI middleware: the key check and the key's request rate before anything of the body is read,
the body cap, and the deadline of inference requests.

KeyMiddleware finds the route of a request's path and method (any route of the path, for a method
none has) and the scope its dependencies demand (app/api/deps.py), and answers 401 (no key, or an
unknown one) or 403 (a key without the scope) from the headers alone: an anonymous client never has
its body read or parsed, whatever it sends. A path no route has needs a key, so nothing about the
routes leaks. A key with a request rate takes one from its bucket (app/keys/limits.py) or gets a 429;
its answers carry X-RateLimit-Limit and X-RateLimit-Remaining. The request's key then travels with
it (CALLER), for its token rate, its models and its ownership of jobs.

BodyLimitMiddleware caps request bodies (413) without reading them whole. A declared Content-Length over the limit is refused before a byte of the body is read. Otherwise
(chunked or lying clients) the bytes are counted as the app receives them; the moment the count
passes the limit the app's reads fail, whatever it tries to answer is dropped, and the client gets
the 413. Pure ASGI rather than BaseHTTPMiddleware so the body is streamed, never buffered here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import re

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.api.deps import CALLER_KEY, SCOPE_OF, bearer_token
from app.api.inference import InferenceRouter
from app.errors import ServiceError, error_response
from app.keys.keyfile import Key
from app.keys.keyring import ANONYMOUS, ANY, Keyring
from app.keys.limits import CALLER, Caller, TokenBucket
from app.prometheus import DISCONNECTED, Metrics
from worker.telemetry import logs

log = logging.getLogger("bertserve")
Guard = tuple[re.Pattern, frozenset[str], str | None]  # a route's path regex, its methods, the scope it needs


class KeyMiddleware:
    def __init__(self, app: ASGIApp, keyring: Keyring, guards: list[Guard], metrics: Metrics):
        self.app = app
        self.keyring = keyring
        self.guards = guards  # (a route's path regex, its methods, the scope it needs; None: open), from key_guards()
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or (needed := self.scope_for(scope["path"], scope["method"])) is None:
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        token = bearer_token(Headers(scope=scope).get("authorization"))
        try:
            key = self.keyring.authorize(token, needed, f"{scope['method']} {path}")
        except ServiceError as e:
            log.info("%s %s: %s", scope["method"], path, e.message)  # names a key, never a secret
            await error_response(e.error_type, e.message, path=path)(scope, receive, send)
            return
        if key is ANONYMOUS:
            await self.app(scope, receive, send)
            return
        scope[CALLER_KEY] = key  # before its rate is checked: a 429 is counted against it too
        logs.note(key=key.name)
        self.metrics.key_requests.labels(key.name).inc()
        requests, tokens = self.keyring.buckets(key)
        headers = []
        if requests is not None:
            wait = requests.take()
            limit = [(b"x-ratelimit-limit", f"{key.rps:g}".encode())]
            headers = [*limit, (b"x-ratelimit-remaining", str(requests.remaining()).encode())]
            if wait > 0:
                await self._rate_limited(key, requests, wait, path)(scope, receive, send)
                return
        reset = CALLER.set(Caller(key, tokens, self._count_tokens, self._count_refusal))
        try:
            await self.app(scope, receive, _adding_headers(send, headers))
        finally:
            CALLER.reset(reset)

    def _count_tokens(self, name: str, n: int) -> None:
        self.metrics.key_tokens.labels(name).inc(n)

    def _count_refusal(self, name: str, limit: str) -> None:
        self.metrics.key_rate_limited.labels(name, limit).inc()

    def _rate_limited(self, key: Key, bucket: TokenBucket, wait: float, path: str) -> JSONResponse:
        self._count_refusal(key.name, "requests")
        retry = max(1, math.ceil(wait))
        message = (
            f"key '{key.name}' is over its request rate of {key.rps:g} per second (bursts of {bucket.capacity:g}); "
            f"retry in {retry} s"
        )
        headers = {"Retry-After": str(retry), "X-RateLimit-Limit": f"{key.rps:g}", "X-RateLimit-Remaining": "0"}
        return error_response("overloaded", message, headers=headers, path=path)

    def scope_for(self, path: str, method: str = "GET") -> str | None:
        """The scope the route of a path and method needs (a path's first route for a method none has: its
        405 answers after the same check); any key for a path no route has."""
        routes = [(methods, needed) for regex, methods, needed in self.guards if regex.match(path)]
        method = "GET" if method == "HEAD" else method
        return next((needed for methods, needed in routes if method in methods), routes[0][1] if routes else ANY)


def _adding_headers(send: Send, headers: list[tuple[bytes, bytes]]) -> Send:
    if not headers:
        return send

    async def adding(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), *headers]}
        await send(message)

    return adding


def key_guards(routers: list[tuple[APIRouter, list]]) -> list[Guard]:
    """(path regex, methods, scope) of every route of these routers, each with the extra dependencies it is
    included with, as the scope dependencies of app/api/deps.py declare it."""
    guards: list[Guard] = []
    for router, dependencies in routers:
        needed = next(
            (SCOPE_OF[d.dependency] for d in [*router.dependencies, *dependencies] if d.dependency in SCOPE_OF), None
        )
        # (starlette's BaseRoute does not declare path_regex; every route an APIRouter holds has one)
        guards += [
            (route.path_regex, frozenset(getattr(route, "methods", None) or ()), needed)  # type: ignore[attr-defined]
            for route in router.routes
        ]
    return guards


def deadline_paths(routers: list[tuple[APIRouter, list]]) -> frozenset[str]:
    """The paths of the inference routers' routes (app/api/inference.py): the ones DeadlineMiddleware covers."""
    return frozenset(
        route.path
        for router, _ in routers
        if isinstance(router, InferenceRouter)
        for route in router.routes
        if isinstance(route, APIRoute)
    )


class BodyTooLarge(Exception):
    pass


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int, exempt: tuple[str, ...] = ()):
        self.app = app
        self.max_bytes = max_bytes
        self.exempt = exempt  # paths that enforce a limit of their own while streaming

    def _too_large(self, path: str) -> JSONResponse:
        return error_response(
            "too_large", f"request body is larger than the limit of {self.max_bytes} bytes", path=path
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.exempt:
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._too_large(scope["path"])(scope, receive, send)
            return
        received, exceeded, started = 0, False, False

        async def counting_receive() -> Message:
            nonlocal received, exceeded
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    exceeded = True
                    raise BodyTooLarge()
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if exceeded:  # the app's own answer to the failed read; ours goes out instead
                return
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counting_receive, guarded_send)
        except BodyTooLarge:
            pass
        except Exception:
            if not exceeded:
                raise
        if exceeded and not started:
            await self._too_large(scope["path"])(scope, receive, send)


class DeadlineMiddleware:
    """Inference requests get `seconds` from their first byte to their answer, and stop when their
    client goes.

    The handler runs as a task. Past the deadline it is cancelled and the client gets 503; once the
    body has been read the connection is watched, and a disconnect cancels the handler too, with
    nothing to answer. Cancelling the handler drops its work: a tokeniser job not yet started, a
    work item still queued, or the rows of a running one not yet in a pass (app/serving/service.py,
    app/serving/engine.py). References: Starlette's StreamingResponse (listen_for_disconnect), vLLM's
    `with_cancellation`.
    """

    def __init__(self, app: ASGIApp, seconds: float, paths: frozenset[str]):
        self.app = app
        self.seconds = seconds
        self.paths = paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in self.paths:
            await self.app(scope, receive, send)
            return
        body_read, gone = asyncio.Event(), asyncio.Event()
        started = False

        async def app_receive() -> Message:
            if body_read.is_set():  # only a disconnect can follow the body, and the watcher takes it
                await gone.wait()
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.disconnect":
                gone.set()
            elif not message.get("more_body", False):
                body_read.set()
            return message

        async def app_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        async def watch() -> None:
            await body_read.wait()
            while (await receive())["type"] != "http.disconnect":
                pass
            gone.set()

        handler = asyncio.ensure_future(self.app(scope, app_receive, app_send))
        others = [asyncio.ensure_future(watch()), asyncio.ensure_future(gone.wait())]
        try:
            await asyncio.wait([handler, others[1]], timeout=self.seconds, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in others:
                task.cancel()
            if not handler.done():
                handler.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await handler
        if not handler.cancelled():
            handler.result()  # the answer was sent; re-raise what the app raised
        elif gone.is_set():
            scope[DISCONNECTED] = True
            log.info("%s %s: the client went away; its work was dropped", scope["method"], scope["path"])
        elif not started:
            await error_response(
                "unavailable",
                f"the request took longer than BERT_REQUEST_TIMEOUT ({self.seconds:g} s); its work was dropped",
                path=scope["path"],
            )(scope, receive, send)
