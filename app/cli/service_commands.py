"""`bert serve`, `bert up` and `bert worker`: the service, the whole system on one machine, a worker.

`serve` runs the FastAPI app under uvicorn. `worker` execs a `celery worker` process on the training
queue; it names the Celery app by its module path (worker.celery_app) and imports nothing of it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

from model.errors import UserError


def cmd_serve(args: argparse.Namespace) -> int:
    from ..server import serve
    from ..settings import Settings

    overrides = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
    if args.data_dir:
        overrides["data_dir"] = args.data_dir
    if args.allow_public:
        overrides["allow_public"] = True
    return serve(settings=Settings(**overrides))


def cmd_up(args: argparse.Namespace) -> int:
    from ..local import up

    if args.bootstrap_steps is not None and args.bootstrap_steps < 1:
        raise UserError(f"--bootstrap-steps must be >= 1, got {args.bootstrap_steps}")
    return up(args.data_dir, args.host, args.port, bootstrap=not args.no_bootstrap, bootstrap_steps=args.bootstrap_steps)


def cmd_worker(args: argparse.Namespace) -> int:
    celery = shutil.which("celery", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    if celery is None:
        raise UserError("the `celery` command is not installed in this environment")
    argv = [celery, "-A", "worker.celery_app", "worker", "--loglevel", args.loglevel,
            "--concurrency", str(args.concurrency), "-Q", args.queues, "--without-gossip", "--without-mingle"]
    if args.hostname:
        argv += ["--hostname", args.hostname]
    os.execv(celery, argv)


def add_commands(sub) -> None:
    """Register serve, up and worker on the `bert` command's subparsers."""
    p = sub.add_parser("serve", help="run the HTTP service (uvicorn)")
    p.add_argument("--host", help="address to bind (default BERT_HOST or 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (default BERT_PORT or 8000)")
    p.add_argument("--data-dir", help="models live in DATA_DIR/models (default BERT_DATA_DIR or ./data)")
    p.add_argument("--allow-public", action="store_true",
                   help="listen beyond loopback even without BERT_API_KEY (not recommended)")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("up", help="everything on this machine, no Docker or Redis: API + one worker (make run)")
    p.add_argument("--data-dir", default=os.environ.get("BERT_DATA_DIR", "data"),
                   help="models, datasets, jobs and the broker's sqlite file (default BERT_DATA_DIR or ./data)")
    p.add_argument("--host", help="address to bind (default BERT_HOST or 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (default BERT_PORT or 8000)")
    p.add_argument("--no-bootstrap", action="store_true", help="do not queue the bootstrap fill-mask/NSP job")
    p.add_argument("--bootstrap-steps", type=int, help="train the bootstrap model for N steps instead of the default")
    p.set_defaults(func=cmd_up)

    p = sub.add_parser("worker", help="run a Celery worker for training jobs")
    p.add_argument("--concurrency", type=int, default=1, help="jobs at once (default 1: one job owns the CPU/GPU)")
    p.add_argument("--queues", default="training", help="comma-separated queues (default: training)")
    p.add_argument("--hostname", help="worker node name (default: celery@HOST)")
    p.add_argument("--loglevel", default="INFO")
    p.set_defaults(func=cmd_worker)
