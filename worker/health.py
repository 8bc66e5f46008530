"""`python -m worker.health`: exit 0 when this machine's worker answers a ping through the broker.

The compose worker's healthcheck. A reply means the worker's main process is connected to the
broker and its consumer is running: it answers between (and during) training steps, since the job
runs in a pool process. It imports Celery and worker.queue only, never torch or the worker's app,
so a check costs a fraction of a second of CPU. Remote control needs a broker with fanout
exchanges (Redis, AMQP); the embedded transports have none, and the check says so (exit 2).

    python -m worker.health                 # node celery@<hostname>, as `bert worker` names it
    python -m worker.health --node gpu@%h   # a worker started with --hostname gpu@%h
"""

from __future__ import annotations

import argparse
import socket
import sys

from worker.queue import has_fanout, producer
from worker.settings import WorkerSettings


def node_name(pattern: str) -> str:
    """Celery's %h (full host name), %n (its first label) and %d (the rest), as the worker expands them."""
    host = socket.gethostname()
    name, _, domain = host.partition(".")
    return pattern.replace("%h", host).replace("%n", name).replace("%d", domain)


def ping(node: str, timeout_s: float, settings: WorkerSettings) -> bool:
    app = producer(settings.broker_url, settings.data_dir, connect_timeout_s=timeout_s)
    try:
        replies = app.control.ping(destination=[node], timeout=timeout_s)
    finally:
        app.close()
    return any(node in reply for reply in replies or [])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m worker.health", description=__doc__.split("\n")[0])
    parser.add_argument("--node", default="celery@%h", help="the worker's node name (default celery@%%h)")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the reply (default 5)")
    args = parser.parse_args(argv)
    settings = WorkerSettings()
    if not has_fanout(settings.broker_url):
        print(
            f"cannot ping a worker over {settings.broker_url.split('://', 1)[0]}://: it has no remote control",
            file=sys.stderr,
        )
        return 2
    node = node_name(args.node)
    try:
        alive = ping(node, args.timeout, settings)
    except Exception as e:  # the broker is unreachable: unhealthy, with the reason
        print(f"{node}: broker unreachable: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(f"{node}: {'ok' if alive else f'no reply within {args.timeout:g} s'}")
    return 0 if alive else 1


if __name__ == "__main__":
    sys.exit(main())
