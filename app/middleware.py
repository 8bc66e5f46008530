"""Pure ASGI middleware that caps request bodies (413) without reading them whole.

A declared Content-Length over the limit is refused before a byte of the body is read. Otherwise
(chunked or lying clients) the bytes are counted as the app receives them; the moment the count
passes the limit the app's reads fail, whatever it tries to answer is dropped, and the client gets
the 413. Pure ASGI rather than BaseHTTPMiddleware so the body is streamed, never buffered here.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import error_response


class BodyTooLarge(Exception):
    pass


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int, exempt: tuple[str, ...] = ()):
        self.app = app
        self.max_bytes = max_bytes
        self.exempt = exempt  # paths that enforce a limit of their own while streaming

    def _too_large(self):
        return error_response("too_large", f"request body is larger than the limit of {self.max_bytes} bytes")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.exempt:
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._too_large()(scope, receive, send)
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
            await self._too_large()(scope, receive, send)
