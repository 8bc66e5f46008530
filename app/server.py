"""`bert serve`: run the app under uvicorn, on loopback unless told otherwise.

Listening beyond loopback without BERT_API_KEY is refused (exit code 2) unless allow_public. In a
container, the address judged is the one its port is published on (BERT_PUBLISHED_HOST), not 0.0.0.0.
On SIGTERM uvicorn stops accepting connections, lets in-flight requests finish (up to
BERT_GRACEFUL_TIMEOUT seconds), then runs the lifespan shutdown, which drains the engine's queue.
`python -m app.server` runs the same thing (for tests and the benchmark).
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import sys

import uvicorn

from .main import create_app
from .settings import Settings

REFUSAL = ("refusing to listen on {host}: it is reachable beyond this machine and BERT_API_KEY is not set. "
           "Set BERT_API_KEY, or pass --allow-public (BERT_ALLOW_PUBLIC=true) to serve without a key.")
PUBLISHED_REFUSAL = ("refusing to serve: the port is published on {host} (BERT_PUBLISHED_HOST, set from BERT_BIND "
                     "by compose), which is reachable beyond this machine, and BERT_API_KEY is not set. Set "
                     "BERT_API_KEY, or publish on 127.0.0.1.")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def exposure_refusal(settings: Settings, host: str, allow_public: bool = False) -> str | None:
    """Why serving on `host` with these settings would be unsafe, or None when it is not."""
    if settings.api_key_value() is not None or allow_public or settings.allow_public:
        return None
    if settings.published_host:
        return None if is_loopback(settings.published_host) else PUBLISHED_REFUSAL.format(host=settings.published_host)
    return None if is_loopback(host) else REFUSAL.format(host=host)


def serve(host: str | None = None, port: int | None = None, allow_public: bool = False,
          settings: Settings | None = None) -> int:
    """Run the service until SIGINT/SIGTERM; 0 after a clean stop. Exits with code 2 if the bind
    would be unsafe. Arguments left None come from `settings` (BERT_HOST, BERT_PORT, ...)."""
    settings = settings or Settings()
    host = host or settings.host
    port = settings.port if port is None else port
    refusal = exposure_refusal(settings, host, allow_public)
    if refusal:
        print(refusal, file=sys.stderr)
        raise SystemExit(2)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = uvicorn.Config(create_app(settings), host=host, port=port, log_level="info",
                            timeout_graceful_shutdown=settings.graceful_timeout, access_log=False)
    uvicorn.Server(config).run()
    return 0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="bert serve", description="Run the bertserve inference service.")
    parser.add_argument("--host", help="address to bind (default BERT_HOST, 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port (default BERT_PORT, 8000)")
    parser.add_argument("--allow-public", action="store_true",
                        help="allow binding beyond loopback without BERT_API_KEY")
    args = parser.parse_args(argv)
    sys.exit(serve(args.host, args.port, args.allow_public, Settings()))


if __name__ == "__main__":
    main()
