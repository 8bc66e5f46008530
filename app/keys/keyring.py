"""The keys a running service knows: the keys file's (re-read when it changes) and the two built-in
ones, BERT_API_KEY (named `api`) and BERT_ADMIN_KEY (named `admin`), and which scopes are open.

The file is checked at most every RECHECK_S seconds, on the requests that need a key: when its inode,
size or modification time changed it is read again, so a revoked key is refused within a second. A file
that cannot be read at start stops the service (KeyFileError); one that breaks later keeps the last
keys that were read, logs the error and shows it on /info (`keys.error`) until it is fixed.
Without any key (no keys file, neither built-in one) the service is open, as it always was: inference,
/metrics and /info open without BERT_API_KEY, jobs and management without either built-in key. Once the
keys file exists or has held a key, the service stays keyed (`keyed`) until it restarts: revoking the
last key, or deleting the file, refuses every request rather than opening the service.
"""

from __future__ import annotations

import hmac
import logging
import os
import threading
import time
from pathlib import Path

from app.errors import ServiceError
from app.keys.keyfile import BUILT_IN, SCOPES, Key, KeyFileError, hash_secret, read_keys
from app.keys.limits import TokenBucket, request_bucket, token_bucket
from app.settings import Settings

log = logging.getLogger("bertserve")
RECHECK_S = 0.5
ANY = ""  # the scope of /info, /docs and paths without a route: any key will do
ANONYMOUS = Key(name="anonymous", hash="", scopes=frozenset(SCOPES))  # a caller where no key is needed
KEYS_REFUSAL = (
    "missing, unknown or revoked key: this service requires a key, as it has a keys file (BERT_KEYS_FILE); "
    "send 'Authorization: Bearer <key>' with the secret `bert keys add` printed"
)
API_REFUSAL = "missing or wrong API key: send 'Authorization: Bearer <BERT_API_KEY>'"


ADMIN_HOLDS = frozenset({"jobs", "batch"})  # an admin sees every key's jobs, datasets, files and batches


def held_scopes(key: Key) -> frozenset[str]:
    """The scopes a key holds: its own, and with `admin` those it oversees (ADMIN_HOLDS)."""
    return key.scopes | ADMIN_HOLDS if key.is_admin else key.scopes


def built_in_keys(settings: Settings) -> list[Key]:
    """BERT_API_KEY opens inference and /metrics, and jobs and management too while there is no
    BERT_ADMIN_KEY; BERT_ADMIN_KEY opens jobs and management (every key's jobs). As they always did,
    a built-in key on a route it does not open is a 401, not a 403."""
    keys = []
    if (admin := settings.admin_key_value()) is not None:
        keys.append(Key(name="admin", hash=hash_secret(admin), scopes=frozenset({"jobs", "admin"})))
    if (api := settings.api_key_value()) is not None:
        scopes = {"inference", "metrics"} if admin is not None else set(SCOPES)
        keys.append(Key(name="api", hash=hash_secret(api), scopes=frozenset(scopes)))
    return keys


def _signature(path: Path) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)


class Keyring:
    def __init__(self, settings: Settings):
        self.settings = settings
        self.path = settings.keys_path()
        self.error: str | None = None  # why the file's last change was not taken, if it was not
        self._lock = threading.Lock()
        self._built_in = built_in_keys(settings)
        self.keyed = False  # the file exists or held a key since the start: never open again (fail closed)
        self._signature = _signature(self.path)
        self._set(read_keys(self.path))  # KeyFileError: the service does not start
        self._checked = time.monotonic()
        self._buckets: dict[str, tuple[Key, TokenBucket | None, TokenBucket | None]] = {}

    def _set(self, file_keys: dict[str, Key]) -> None:
        self.file_keys = file_keys
        self.keyed = self.keyed or bool(file_keys) or self._signature is not None
        self.by_hash = {k.hash: k for k in [*self._built_in, *file_keys.values()]}

    def refresh(self, force: bool = False) -> None:
        """Read the file again if it changed since it was last read (at most every RECHECK_S)."""
        now = time.monotonic()
        if not force and now - self._checked < RECHECK_S:
            return
        with self._lock:
            self._checked = now
            signature = _signature(self.path)
            if signature == self._signature:
                return
            try:
                keys = read_keys(self.path)
            except KeyFileError as e:
                if self.error != str(e):
                    log.error("%s; the keys read before stay in use until it is fixed", e)
                self.error = str(e)
                return
            self._signature, self.error = signature, None
            self._set(keys)
            log.info("keys file %s read again: %d keys", self.path, len(keys))

    def has_keys(self) -> bool:
        return bool(self.by_hash)

    def is_open(self, scope: str) -> bool:
        """Whether a request needing `scope` goes through without a key."""
        if self.keyed:
            return False
        if scope in ("inference", "metrics", ANY):
            return self.settings.api_key_value() is None
        return self.settings.api_key_value() is None and self.settings.admin_key_value() is None

    def refusal(self, scope: str) -> str:
        if self.keyed:
            return KEYS_REFUSAL
        if scope in ("inference", "metrics", ANY):
            return API_REFUSAL
        which = "BERT_ADMIN_KEY" if self.settings.admin_key_value() is not None else "BERT_API_KEY"
        return f"missing or wrong key: send 'Authorization: Bearer <{which}>'"

    def find(self, token: str | None) -> Key | None:
        """The key whose secret `token` is, else None (the hashes compared in constant time)."""
        if not token:
            return None
        digest = hash_secret(token)
        key = self.by_hash.get(digest)
        return key if key is not None and hmac.compare_digest(key.hash, digest) else None

    def named(self, name: str) -> Key | None:
        """The key called `name` (as the keys file has it now), else None: for work a key started that runs on
        after its request (a job's disk quota when it publishes)."""
        self.refresh()
        return next((key for key in self.by_hash.values() if key.name == name), None)

    def authorize(self, token: str | None, scope: str, what: str) -> Key:
        """The caller's key for a request needing `scope` (`what` names the request in a 403);
        401 for a missing or unknown key, 403 for a key without the scope."""
        self.refresh()
        key = self.find(token)
        if key is None:
            if self.is_open(scope):
                return ANONYMOUS
            raise ServiceError("unauthorized", self.refusal(scope))
        if scope != ANY and scope not in held_scopes(key) and not self.is_open(scope):
            if key.name in BUILT_IN:
                raise ServiceError("unauthorized", self.refusal(scope))
            raise ServiceError(
                "forbidden",
                f"key '{key.name}' lacks the scope '{scope}' that {what} needs "
                f"(its scopes: {', '.join(s for s in SCOPES if s in key.scopes)})",
            )
        return key

    def buckets(self, key: Key) -> tuple[TokenBucket | None, TokenBucket | None]:
        """The key's request and token buckets; new ones when its limits changed."""
        held = self._buckets.get(key.name)
        if held is None or held[0] != key:
            held = self._buckets[key.name] = (key, request_bucket(key), token_bucket(key))
        return held[1], held[2]

    def describe(self) -> str:
        """The start log's line: whether requests need a key, and which keys there are (never a secret)."""
        where = f"{self.path} (BERT_KEYS_FILE{'' if self.settings.keys_file else ' unset'})"
        built_in = " and ".join(f"BERT_{k.name.upper()}_KEY" for k in self._built_in)
        if self.keyed:
            count = f"{len(self.file_keys)} key{'' if len(self.file_keys) == 1 else 's'}"
            also = f", plus {built_in}" if built_in else ""
            return f"keys: required on every route but /health and /ready: {count} from {where}{also}"
        if built_in:
            return f"keys: {built_in} only, no keys file at {where}"
        return f"keys: none, every route is open: no keys file at {where}, BERT_API_KEY and BERT_ADMIN_KEY unset"

    def summary(self) -> dict:
        """What /info shows: the file, how many keys, and the error of its last change if any."""
        return {
            "file": str(self.path),
            "keys": len(self.file_keys),
            "built_in": [k.name for k in self._built_in],
            "error": self.error,
        }
