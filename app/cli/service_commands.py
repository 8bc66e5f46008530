"""`bert serve`, `bert up`, `bert init` and `bert worker`: the service, the whole system on one
machine, a first start, a worker.

`serve` runs the FastAPI app under uvicorn. `init` fills an empty DATA_DIR as `up` does on its first
start (app/launcher/bootstrap.py); the compose stack runs it once before the api and the worker. `worker`
execs a `celery worker` process on the training queue; it names the Celery app by its module path
(worker.celery_app) and imports nothing of it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

from model.errors import UserError


def cmd_serve(args: argparse.Namespace) -> int:
    from app.launcher.server import serve
    from app.settings import Settings

    overrides = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
    if args.data_dir:
        overrides["data_dir"] = args.data_dir
    if args.allow_public:
        overrides["allow_public"] = True
    return serve(settings=Settings(**overrides))


def cmd_up(args: argparse.Namespace) -> int:
    from app.launcher.local import up
    from app.settings import Settings

    steps = _positive_steps(args.bootstrap_steps)
    data_dir = args.data_dir or Settings().data_dir
    return up(data_dir, args.host, args.port, bootstrap=not args.no_bootstrap, bootstrap_steps=steps)


def cmd_init(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from app.errors import ServiceError
    from app.launcher.bootstrap import initialize
    from app.launcher.demo_data import AssetMissingError
    from app.launcher.server import exposure_refusal
    from app.settings import BERT_INIT_ONLY, Settings

    try:
        settings = Settings(**({"data_dir": args.data_dir} if args.data_dir else {}))
    except ValidationError as e:  # BERT_BOOTSTRAP or BERT_BOOTSTRAP_STEPS: this command's one line
        error = e.errors()[0]
        if error["loc"][0] not in BERT_INIT_ONLY or "error" not in error.get("ctx", {}):
            raise
        raise UserError(str(error["ctx"]["error"])) from None
    # The stack's first container: refuse here too, so a stack that would serve the network without a
    # key stops before anything starts (the api refuses the same way).
    refusal = exposure_refusal(settings, settings.host)
    if refusal:
        print(refusal, file=sys.stderr)
        return 2
    # The flags, else the settings (the compose file passes .env's values as BERT_BOOTSTRAP*).
    bootstrap = not args.no_bootstrap and settings.bootstrap
    steps = _positive_steps(args.bootstrap_steps if args.bootstrap_steps is not None else settings.bootstrap_steps)
    try:
        initialize(settings, bootstrap=bootstrap, steps=steps)
    except AssetMissingError as e:
        raise UserError(str(e)) from None
    except ServiceError as e:
        raise UserError(f"cannot queue the bootstrap job: {e.message}") from None
    return 0


def _positive_steps(value: int | None) -> int | None:
    if value is not None and value < 1:
        raise UserError(f"--bootstrap-steps must be >= 1, got {value}")
    return value


def cmd_worker(args: argparse.Namespace) -> int:
    celery = shutil.which("celery", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    if celery is None:
        raise UserError("the `celery` command is not installed in this environment")
    argv = [
        celery,
        "-A",
        "worker.celery_app",
        "worker",
        "--loglevel",
        args.loglevel,
        "--concurrency",
        str(args.concurrency),
        "-Q",
        args.queues,
        "--without-gossip",
        "--without-mingle",
    ]
    if args.hostname:
        argv += ["--hostname", args.hostname]
    from app.settings import Settings

    if Settings().log_format == "json":
        argv.insert(1, "--quiet")  # JSON lines only: Celery prints its start-up banner, it does not log it
    os.execv(celery, argv)


def add_commands(sub) -> None:
    """Register serve, up, init and worker on the `bert` command's subparsers."""
    p = sub.add_parser("serve", help="run the HTTP service (uvicorn)")
    p.add_argument("--host", help="address to bind (default BERT_HOST or 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (default BERT_PORT or 8000)")
    p.add_argument("--data-dir", help="models live in DATA_DIR/models (default BERT_DATA_DIR or ./data)")
    p.add_argument(
        "--allow-public", action="store_true", help="listen beyond loopback even without BERT_API_KEY (not recommended)"
    )
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("up", help="everything on this machine, no Docker or Redis: API + one worker (make run)")
    p.add_argument(
        "--data-dir", help="models, datasets, jobs and the broker's sqlite file (default BERT_DATA_DIR or ./data)"
    )
    p.add_argument("--host", help="address to bind (default BERT_HOST or 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (default BERT_PORT or 8000)")
    p.add_argument("--no-bootstrap", action="store_true", help="do not queue the bootstrap fill-mask/NSP job")
    p.add_argument("--bootstrap-steps", type=int, help="train the bootstrap model for N steps instead of the default")
    p.set_defaults(func=cmd_up)

    p = sub.add_parser(
        "init", help="fill an empty DATA_DIR as `bert up` does on first start (the compose `init` service)"
    )
    p.add_argument("--data-dir", help="default BERT_DATA_DIR or ./data")
    p.add_argument(
        "--no-bootstrap",
        action="store_true",
        help="do not queue the bootstrap fill-mask/NSP job (or BERT_BOOTSTRAP=false)",
    )
    p.add_argument(
        "--bootstrap-steps",
        type=int,
        help="train the bootstrap model for N steps instead of the default (or BERT_BOOTSTRAP_STEPS)",
    )
    p.set_defaults(func=cmd_init)

    p = sub.add_parser("worker", help="run a Celery worker for training jobs")
    p.add_argument("--concurrency", type=int, default=1, help="jobs at once (default 1: one job owns the CPU/GPU)")
    p.add_argument("--queues", default="training", help="comma-separated queues (default: training)")
    p.add_argument("--hostname", help="worker node name (default: celery@HOST)")
    p.add_argument("--loglevel", default="INFO", help="Celery's log level: DEBUG, INFO, WARNING, ERROR")
    p.set_defaults(func=cmd_worker)
