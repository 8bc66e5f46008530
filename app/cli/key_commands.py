"""`bert keys add | list | revoke | rotate`: the keys file (BERT_KEYS_FILE, else DATA_DIR/keys.toml)
that the service re-reads within a second of a change. A new secret is printed once, alone on the last
line, and only its sha256 is stored (app/keys/keyfile.py); every change is a line in the audit log. The
file's first key comes with a warning on stderr: the service now refuses requests without a key."""

from __future__ import annotations

import argparse
import getpass
import shlex
import sys
from pathlib import Path

from model.errors import UserError


def _paths(args: argparse.Namespace) -> tuple[Path, Path]:
    """(the keys file, the data directory whose audit log records the change)."""
    from app.settings import Settings

    settings = Settings(**({"data_dir": args.data_dir} if args.data_dir else {}))
    return (Path(args.file) if args.file else settings.keys_path()), settings.data_dir


def _change(path: Path, data_dir: Path, action: str, name: str, edit):
    """Apply `edit` to the keys file (keyfile.change: locked, atomic), then record it in the audit log;
    what `edit` returned. A refusal is the command's error."""
    from app.keys.keyfile import KeyFileError, change
    from datadir import audit

    try:
        result = change(path, edit)
    except KeyFileError as e:
        raise UserError(str(e)) from None
    audit.append(data_dir, "cli", action, f"key {name}", user=getpass.getuser(), source="cli")
    return result


def _describe(key) -> str:
    from app.keys.keyfile import SCOPES

    limits = ", ".join(f"{k}={v:g}" for k, v in key.limits().items()) or "no limits"
    models = f"; models {', '.join(key.models)}" if key.models is not None else ""
    return f"scopes {', '.join(s for s in SCOPES if s in key.scopes)}{models}; {limits}"


def cmd_keys_add(args: argparse.Namespace) -> int:
    from app.keys.keyfile import Key, KeyFileError, check_key, check_name, hash_secret, new_secret, now_iso

    path, data_dir = _paths(args)
    secret = new_secret()
    try:
        key = check_key(
            Key(
                name=check_name(args.name),
                hash=hash_secret(secret),
                scopes=frozenset(args.scope or ["inference"]),
                models=tuple(args.model) if args.model else None,
                rps=args.rps,
                burst=args.burst,
                tokens_per_min=args.tokens_per_min,
                max_jobs=args.max_jobs,
                max_priority=args.max_priority,
                worker_share=args.worker_share,
                disk_gb=args.disk_gb,
                created_at=now_iso(),
            )
        )
    except KeyFileError as e:
        raise UserError(str(e)) from None

    def add(keys: dict) -> bool:
        """Add the key; whether it is the file's first."""
        if key.name in keys:
            raise KeyFileError(f"key '{key.name}' exists: `bert keys rotate {key.name}` gives it a new secret")
        keys[key.name] = key
        return len(keys) == 1

    first = _change(path, data_dir, "key.add", key.name, add)
    print(f"added key '{key.name}' to {path}: {_describe(key)}", flush=True)
    if first:
        print(first_key_warning(key, path, args), file=sys.stderr)
    print("its secret, shown only this once (send it as 'Authorization: Bearer <secret>'):")
    print(secret)
    return 0


def first_key_warning(key, path: Path, args: argparse.Namespace) -> str:
    """What `bert keys add` says on stderr when the file had no key: the service it keys now refuses every
    request without one, its owner's included, so the owner needs a key too."""
    lines = [
        f"bert keys: warning: '{key.name}' is the first key in {path}: a service that reads this file (BERT_KEYS_FILE, "
        "by default DATA_DIR/keys.toml) now needs a key on every route but /health and /ready, within a second and "
        "without a restart; a request without one gets 401"
    ]
    if not key.is_admin:
        owner = "owner" if key.name != "owner" else "owner-admin"
        options = (("--file", args.file), ("--data-dir", args.data_dir))
        where = "".join(f" {option} {shlex.quote(value)}" for option, value in options if value)
        lines.append(
            f"bert keys: '{key.name}' lacks the scope admin, so it opens no /jobs, /datasets or model management; "
            f"make yourself a key that does: bert keys add {owner} --scope admin --scope inference --scope metrics"
            f"{where}"
        )
    return "\n".join(lines)


def cmd_keys_list(args: argparse.Namespace) -> int:
    from app.keys.keyfile import KeyFileError, read_keys

    path, _ = _paths(args)
    try:
        keys = read_keys(path)
    except KeyFileError as e:
        raise UserError(str(e)) from None
    if not keys:
        print(f"no keys in {path}")
        return 0
    width = max(len(name) for name in keys)
    for key in keys.values():
        print(f"{key.name:<{width}}  created {key.created_at or 'unknown'}  {_describe(key)}")
    return 0


def cmd_keys_revoke(args: argparse.Namespace) -> int:
    from app.keys.keyfile import KeyFileError

    path, data_dir = _paths(args)

    def revoke(keys: dict) -> None:
        if keys.pop(args.name, None) is None:
            raise KeyFileError(f"no key '{args.name}' in {path}")

    _change(path, data_dir, "key.revoke", args.name, revoke)
    print(f"revoked key '{args.name}': the service refuses it within a second")
    return 0


def cmd_keys_rotate(args: argparse.Namespace) -> int:
    import dataclasses

    from app.keys.keyfile import KeyFileError, hash_secret, new_secret

    path, data_dir = _paths(args)
    secret = new_secret()

    def rotate(keys: dict) -> None:
        if args.name not in keys:
            raise KeyFileError(f"no key '{args.name}' in {path}")
        keys[args.name] = dataclasses.replace(keys[args.name], hash=hash_secret(secret))

    _change(path, data_dir, "key.rotate", args.name, rotate)
    print(f"rotated key '{args.name}': the old secret stops working within a second")
    print("its new secret, shown only this once:")
    print(secret)
    return 0


def add_commands(sub) -> None:
    """Register `keys` (add, list, revoke, rotate) on the `bert` command's subparsers."""
    from app.keys.keyfile import SCOPES

    keys = sub.add_parser("keys", help="manage the service's API keys (the keys file)")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True, metavar="SUBCOMMAND")

    def parser(name: str, help: str, func, named: bool = True) -> argparse.ArgumentParser:
        p = keys_sub.add_parser(name, help=help, description=help[0].upper() + help[1:] + ".")
        if named:
            p.add_argument("name", metavar="NAME", help="the key's name (what logs, /metrics and /usage show)")
        p.add_argument("--file", help="the keys file (default: BERT_KEYS_FILE, else DATA_DIR/keys.toml)")
        p.add_argument(
            "--data-dir", help="the data directory, for the keys file and the audit log (default BERT_DATA_DIR)"
        )
        p.set_defaults(func=func)
        return p

    p = parser("add", "add a key and print its secret once", cmd_keys_add)
    p.add_argument(
        "--scope", action="append", choices=SCOPES, help="what the key may do; repeat for more (default: inference)"
    )
    p.add_argument("--model", action="append", help="a model its inference requests may use; repeat (default: any)")
    p.add_argument("--rps", type=float, help="requests per second (default: no limit)")
    p.add_argument("--burst", type=int, help="requests at once above the rate (default: the rate, at least 1)")
    p.add_argument("--tokens-per-min", type=int, help="tokens of inference requests per minute (default: no limit)")
    p.add_argument("--max-jobs", type=int, help="its jobs queued or running at once (default: no limit)")
    p.add_argument("--max-priority", type=int, help="the highest job priority it may ask for (default: no limit)")
    p.add_argument("--worker-share", type=float, help="its share of worker time, in (0, 1] (default: no limit)")
    p.add_argument(
        "--disk-gb", type=float, help="GB its jobs, datasets and models may hold on disk (default: no limit)"
    )
    parser("list", "list the keys: names, scopes, limits, when made (never secrets)", cmd_keys_list, named=False)
    parser("revoke", "remove a key: the service refuses it within a second", cmd_keys_revoke)
    parser("rotate", "give a key a new secret (printed once); the old one stops working", cmd_keys_rotate)
