"""`bert serve`: run the app under uvicorn, on loopback unless told otherwise.

Listening beyond loopback (127.0.0.0/8, ::1, localhost) without BERT_API_KEY is refused (exit code
2) unless allow_public, and so is a key (API or admin) shorter than MIN_PUBLIC_KEY_LENGTH there; so is
an address uvicorn could not listen on (a port in use), before the slow start rather than after it. In
a container the address judged is the one its port is published on (BERT_PUBLISHED_HOST), not the
0.0.0.0 it must listen on. uvicorn runs with the client limits it lacks itself (GuardedHttpProtocol):
a deadline for a request's headers, an idle timeout while its body arrives, and a cap on open
connections. On SIGTERM the replica first drains for BERT_DRAIN_SECONDS (DrainingServer): it serves on,
but /ready answers 503 and every answer closes its connection, so a load balancer takes it out of
rotation and clients move on; then uvicorn stops accepting connections, lets in-flight requests finish
(up to BERT_GRACEFUL_TIMEOUT seconds), ends event streams (their clients reconnect elsewhere) and runs
the lifespan shutdown, which drains the engine's queue. Ctrl-C (SIGINT) skips the drain.
`python -m app.launcher.server` runs the same thing (for tests and the benchmark).
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import gc
import ipaddress
import json
import logging
import signal
import socket
import sys
import time
from types import FrameType

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from app.errors import RETRY_AFTER_S, error_body
from app.keys.keyfile import KeyFileError, read_keys
from app.main import create_app
from app.serving.service import Service
from app.settings import Settings
from worker.telemetry import logs

log = logging.getLogger("bertserve")

REFUSAL = (
    "refusing to listen on {host}: it is reachable beyond this machine and BERT_API_KEY is not set. "
    "Set BERT_API_KEY, or pass --allow-public (BERT_ALLOW_PUBLIC=true) to serve without a key."
)
PUBLISHED_REFUSAL = (
    "refusing to serve: the port is published on {host} (BERT_PUBLISHED_HOST, set from BERT_BIND "
    "by compose), which is reachable beyond this machine, and BERT_API_KEY is not set. Set "
    "BERT_API_KEY, or publish on 127.0.0.1."
)
MIN_PUBLIC_KEY_LENGTH = 16
SHORT_KEY = (
    "refusing to listen on {host}: it is reachable beyond this machine and {name} is shorter than "
    f"{MIN_PUBLIC_KEY_LENGTH} characters. Use a long random key, e.g. `openssl rand -hex 32`."
)


def is_loopback(host: str) -> bool:
    """127.0.0.0/8 in any form the resolver takes ("127.1", "127.0.0.2"), ::1 (also IPv4-mapped), localhost."""
    if host.lower() == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        try:  # the short IPv4 forms getaddrinfo accepts too ("127.1" is 127.0.0.1)
            address = ipaddress.ip_address(socket.inet_aton(host))
        except OSError:
            return False  # a host name: it may resolve to anything
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


def has_file_keys(settings: Settings) -> bool:
    """Whether the keys file holds a key (one that cannot be read stops the service later, at start)."""
    try:
        return bool(read_keys(settings.keys_path()))
    except KeyFileError:
        return False


def exposure_refusal(settings: Settings, host: str, allow_public: bool = False) -> str | None:
    """Why serving on `host` with these settings would be unsafe, or None. The address judged is
    where clients reach the service: BERT_PUBLISHED_HOST when set (in a container), else `host`."""
    exposed = settings.published_host or host
    if is_loopback(exposed):
        return None
    if settings.api_key_value() is None and not has_file_keys(settings) and not (allow_public or settings.allow_public):
        return (PUBLISHED_REFUSAL if settings.published_host else REFUSAL).format(host=exposed)
    for name, key in (("BERT_API_KEY", settings.api_key_value()), ("BERT_ADMIN_KEY", settings.admin_key_value())):
        if key is not None and len(key) < MIN_PUBLIC_KEY_LENGTH:
            return SHORT_KEY.format(host=exposed, name=name)
    return None


def listen_refusal(host: str, port: int) -> str | None:
    """Why uvicorn could not listen on host:port (a port in use, an address not this machine's), or None: a
    bind as asyncio's create_server makes for uvicorn (SO_REUSEADDR, IPv6 only on an IPv6 socket), tried
    before the slow start (model loads, the Hub) rather than after it. Another process may still take the
    port in between; uvicorn's own error says so then."""
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        for family, kind, proto, _, address in addresses:
            with socket.socket(family, kind, proto) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind(address)
    except OSError as e:  # socket.gaierror too: a host name that does not resolve
        another_port = "choose another port with --port or BERT_PORT"
        if e.errno == errno.EADDRINUSE:
            return f"refusing to start: {where} is already in use; {another_port}"
        fix = another_port if e.errno == errno.EACCES else "choose an address of this machine with --host or BERT_HOST"
        return f"refusing to start: cannot listen on {where}: {e.strerror}; {fix}"  # EACCES: a port below 1024
    return None


class GuardedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the limits uvicorn lacks (nginx's client_header_timeout,
    client_body_timeout and limit_conn): a client has `header_timeout` seconds for a request's
    headers (from connecting, or from the end of its previous answer), may pause at most
    `body_timeout` seconds between two reads of a body, and one connection past `max_connections`
    is answered 503 and closed. A timed-out connection is closed; a handler still reading that body
    sees the client disconnect. A request answered before its body was read (a 401, a 429 from the
    headers alone) keeps its connection, as nginx's discarded body does: the rest of a body of a declared
    length up to `max_body_bytes` is read and dropped, within `body_timeout` in all, and the next request
    follows on the same connection; a client that keeps its connection (httpx, requests, the openai
    client) gets the answer and goes on. Any other body (larger, chunked, or awaiting 100-continue) is
    discarded for a moment and its connection closed, as nginx's lingering close does, so a client
    cannot keep it open by trickling the body it declared. `serving(settings)` makes the subclass with
    the settings' values. While the service drains (SIGTERM), each answer closes its connection, so a
    balancer's next request opens a new one, to a replica still in rotation."""

    header_timeout = 10.0
    body_timeout = 30.0
    max_connections = 1000
    max_body_bytes = 1 << 20
    service: Service | None = None
    _timer: asyncio.TimerHandle | None = None
    _reading_body = False

    @classmethod
    def serving(cls, settings: Settings, service: Service | None = None) -> type[GuardedHttpProtocol]:
        return type(
            cls.__name__,
            (cls,),
            {
                "header_timeout": settings.header_timeout,
                "body_timeout": settings.body_timeout,
                "max_connections": settings.max_connections,
                "max_body_bytes": settings.max_body_bytes,
                "service": service,
            },
        )

    _closing = False  # answered for good: what the client still sends is read and dropped
    _discarding = False  # answered before its body was read: the rest is read and dropped, the connection kept
    _declared: int | None = None  # the request body's Content-Length, when it declares one it may send

    # (the signature of uvicorn's HttpToolsProtocol, narrower than asyncio's BaseProtocol)
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            log.warning("refused a connection: %d are open (BERT_MAX_CONNECTIONS)", len(self.connections) - 1)
            transport.write(_connection_limit_answer(self.max_connections))
            self._linger_and_close()
            return
        self._arm(self.header_timeout)

    def data_received(self, data: bytes) -> None:
        if not self._closing:
            super().data_received(data)

    def _linger_and_close(self) -> None:
        """Half-close, drop what still arrives for a second, then close: closing at once with the
        client's bytes unread would reset the connection before the client reads our answer."""
        self._closing = True
        self._arm(None)
        if not self.transport.is_closing():
            self.transport.write_eof()
            self.loop.call_later(1.0, self.transport.close)

    def connection_lost(self, exc: Exception | None) -> None:
        self._arm(None)
        super().connection_lost(exc)

    def on_headers_complete(self) -> None:
        self._unset_keepalive_if_required()  # (armed by _await_next_request: this request came in the same read)
        super().on_headers_complete()
        if self.service is not None and self.service.draining:
            self.cycle.keep_alive = False  # uvicorn answers with `connection: close` and closes
        self._reading_body = True
        self._declared = _discardable_length(self.headers)
        self._arm(self.body_timeout)

    def on_body(self, body: bytes) -> None:
        super().on_body(body)  # (dropped by uvicorn once the answer is complete)
        if not self._discarding:  # a discarded rest has one deadline in all
            self._arm(self.body_timeout)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._reading_body = False
        if self._discarding:  # the rest of an answered request's body is read: the connection is ready again
            self._discarding = False
            self._await_next_request()
        else:
            self._arm(None)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._closing or self.transport.is_closing():
            return
        if not self._reading_body:
            self._arm(self.header_timeout)
        elif self._declared is not None and self._declared <= self.max_body_bytes:
            self._discarding = True  # answered before the body was read: read the rest and drop it
            self._arm(self.body_timeout)
        else:  # a body too large to read in vain, or one that may never come
            self._linger_and_close()

    def _await_next_request(self) -> None:
        """The connection's next request: headers within header_timeout, and uvicorn's keep-alive timeout."""
        self._arm(self.header_timeout)
        self._unset_keepalive_if_required()
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)

    def _arm(self, seconds: float | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = None if seconds is None else self.loop.call_later(seconds, self._timed_out)

    def _timed_out(self) -> None:
        self._timer = None
        if not self.transport.is_closing():
            log.info(
                "closed a connection from %s: %s",
                self.client,
                "its body stalled" if self._reading_body else "its request headers were too slow",
            )
            self.transport.close()


def _discardable_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    """The body's declared Content-Length, or None when the rest of it cannot be read and dropped: no length
    (chunked), or a client waiting for `100 Continue` before it sends the body (it may never send it)."""
    fields = dict(headers)  # (uvicorn's names, lowercased)
    length = fields.get(b"content-length", b"")
    if not length.isdigit() or fields.get(b"expect", b"").lower() == b"100-continue":
        return None
    return int(length)


def _connection_limit_answer(limit: int) -> bytes:
    """The raw HTTP 503 for one connection too many (no request has been read: no app to ask)."""
    body = json.dumps(error_body("unavailable", f"too many open connections (at most {limit}); retry later")).encode()
    head = (
        f"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nretry-after: {RETRY_AFTER_S[503]}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


class DrainingServer(uvicorn.Server):
    """uvicorn's server with a drain before its graceful shutdown. The first SIGTERM marks the service
    draining (/ready: 503; answers close their connections) for `drain_s` seconds while it serves on;
    then uvicorn's shutdown runs as on any signal. SIGINT (Ctrl-C), a second SIGTERM or `drain_s` 0:
    the shutdown at once."""

    def __init__(self, config: uvicorn.Config, service: Service, drain_s: float):
        super().__init__(config)
        self.service, self.drain_s = service, drain_s
        self.leave_at: float | None = None
        self.marked = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGTERM and self.drain_s > 0 and self.leave_at is None and not self.should_exit:
            self.leave_at = time.monotonic() + self.drain_s  # (a signal handler: no logging here)
            self.service.draining = True
            return
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        if self.leave_at is not None and not self.marked:
            self.marked = True  # the requests that were in flight at SIGTERM close their connections too
            for connection in list(self.server_state.connections):
                cycle = getattr(connection, "cycle", None)
                if cycle is not None and not cycle.response_complete:
                    cycle.keep_alive = False
        if self.leave_at is not None and not self.service.leaving:
            if counter % 10 == 0 and time.monotonic() < self.leave_at:
                log.info("SIGTERM: draining, %.0f s left (/ready answers 503)", self.leave_at - time.monotonic())
            if time.monotonic() >= self.leave_at:
                log.info("drained: no longer accepting connections; finishing the requests in flight")
                self.service.leaving = True
                self.should_exit = True
        if self.should_exit:
            self.service.leaving = True  # event streams end: their clients reconnect to another replica
        return await super().on_tick(counter)


def freeze_startup_heap() -> None:
    """What the imports and create_app have made lives as long as the server: collected once, then frozen
    (gc.freeze), so the collector's full passes no longer walk it. A pass over it took 0.1-0.2 s, the
    event loop and the engine's Python stalled meanwhile, several times a minute while a batch runs. The
    models load after (the app's start), unfrozen, so one unloaded later is freed as before."""
    gc.collect()
    gc.freeze()


def serve(
    host: str | None = None, port: int | None = None, allow_public: bool = False, settings: Settings | None = None
) -> int:
    """Run the service until SIGINT/SIGTERM; 0 after a clean stop. Exits with code 2 if the bind would be
    unsafe or cannot be made (the port in use). Arguments left None come from `settings` (BERT_HOST, ...)."""
    settings = settings or Settings()
    host = host or settings.host
    port = settings.port if port is None else port
    if (why := exposure_refusal(settings, host, allow_public) or listen_refusal(host, port)) is not None:
        print(why, file=sys.stderr)
        raise SystemExit(2)
    logs.install(settings.log_format)  # BERT_LOG_FORMAT: text or JSON lines (worker/telemetry/logs.py)
    try:
        app = create_app(settings)
    except ValueError as e:  # a device torch cannot see, int8 on a GPU: one line, not a traceback
        print(f"refusing to start: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    freeze_startup_heap()
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="info",
        # JSON lines: uvicorn's own loggers reach the root's handler too, not their own text one
        log_config=None if settings.log_format == "json" else uvicorn.config.LOGGING_CONFIG,
        # (uvicorn types it int; it is awaited as a float of seconds)
        timeout_graceful_shutdown=settings.graceful_timeout,  # type: ignore[arg-type]
        access_log=False,
        http=GuardedHttpProtocol.serving(settings, app.state.service),
    )
    DrainingServer(config, app.state.service, settings.drain_seconds).run()
    return 0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="bert serve", description="Run the bertserve inference service.")
    parser.add_argument("--host", help="address to bind (default BERT_HOST, 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port (default BERT_PORT, 8000)")
    parser.add_argument(
        "--allow-public", action="store_true", help="allow binding beyond loopback without BERT_API_KEY"
    )
    args = parser.parse_args(argv)
    sys.exit(serve(args.host, args.port, args.allow_public, Settings()))


if __name__ == "__main__":
    main()
