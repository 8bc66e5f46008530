"""Per-key rates: token buckets for requests per second and for tokens per minute, kept in this
process (each replica limits on its own), and the caller of the request being served.

A bucket holds up to `capacity` and refills at `rate` per second. A request takes one from its key's
request bucket before its body is read (app/api/middleware.py). Its tokens are counted once it is
tokenised (Service.check_tokens) and taken from the token bucket before it reaches the model; the
bucket may go below zero for one large request, and the key waits until it is back above zero.

A model load is work too, charged to the request that causes it: one of the key's loads per minute
(LoadLimits, BERT_MAX_LOADS_PER_MINUTE; the requests without a key share one such limit), and, where
the key has a token rate, load_tokens(parameters) of its tokens.
Reference: https://en.wikipedia.org/wiki/Token_bucket
"""

from __future__ import annotations

import contextvars
import dataclasses
import math
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from app.errors import ServiceError
from app.keys import ownership
from app.keys.keyfile import Key
from datadir.jobs import owner_of
from datadir.versions import Access

# A model load costs its caller one token per this many parameters: loading reads and converts every weight,
# so its cost grows with the model's size (22,714 tokens for all-MiniLM-L6-v2, 109,483 for bert-base).
PARAMETERS_PER_LOAD_TOKEN = 1_000


def load_tokens(parameters: int) -> int:
    """What loading a model of `parameters` parameters takes from its caller's token rate."""
    return max(1, math.ceil(parameters / PARAMETERS_PER_LOAD_TOKEN))


class TokenBucket:
    def __init__(self, rate: float, capacity: float):
        self.rate, self.capacity = rate, capacity
        self.level, self.stamp = capacity, time.monotonic()
        self._lock = threading.Lock()  # token charges come from the tokeniser threads

    def _refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
        self.stamp = now

    def take(self, amount: float = 1.0, overdraw: bool = False) -> float:
        """Take `amount` and answer 0, or take nothing and answer the seconds until it could. With
        `overdraw`, any level above zero admits the whole amount."""
        with self._lock:
            self._refill(time.monotonic())
            needed = min(amount, 1e-9) if overdraw else amount
            if self.level >= needed:
                self.level -= amount
                return 0.0
            return (needed - self.level) / self.rate

    def give(self, amount: float = 1.0) -> None:
        """Give back what `take` took for work that was not done."""
        with self._lock:
            self._refill(time.monotonic())
            self.level = min(self.capacity, self.level + amount)

    def remaining(self) -> int:
        with self._lock:
            self._refill(time.monotonic())
            return max(0, math.floor(self.level))


@dataclasses.dataclass
class Caller:
    """Who makes the request being served: its key, and the key's token bucket."""

    key: Key
    tokens: TokenBucket | None
    on_tokens: Callable[[str, int], None]  # counts a key's tokens for /metrics and /usage
    on_refused: Callable[[str, str], None]  # counts a 429 of the key's (its name, the limit)

    def charge_tokens(self, n: int, why: str = "") -> None:
        """Count `n` tokens against the key's token rate (a tokenised request's; `why`: anything else they
        pay for, in words after the limit); a 429 when the rate is spent."""
        if self.tokens is not None:
            wait = self.tokens.take(n, overdraw=True)
            if wait > 0:
                self.on_refused(self.key.name, "tokens")
                raise ServiceError(
                    "overloaded",
                    f"key '{self.key.name}' is over its token rate of {self.key.tokens_per_min} tokens per minute"
                    f"{why}; retry in {math.ceil(wait)} s",
                    headers={"Retry-After": str(math.ceil(wait))},
                )
        self.on_tokens(self.key.name, n)

    def sees_job(self, record: Mapping[str, Any]) -> bool:
        """Whether an answer to this caller may name the job of `record` by its id (Key.sees_jobs_of)."""
        return self.key.sees_jobs_of(owner_of(record))

    def usable(self, names: list[str]) -> list[str]:
        """Those of `names` the key may use (its `models` list; all without one)."""
        return names if self.key.models is None else [n for n in names if n in self.key.models]

    def charge_load(self, model: str, tokens: int) -> None:
        """Charge a model load this key's request causes as `tokens` of its token rate (load_tokens); a 429
        when the rate is spent."""
        self.charge_tokens(tokens, f", and loading model '{model}' costs {tokens:,}")

    def refund_load(self, tokens: int) -> None:
        """Give back a load's tokens when the load did not happen."""
        if self.tokens is not None:
            self.tokens.give(tokens)

    def check_model(self, name: str, access: Access) -> None:
        """403 when the key may not use model `name` (its `models` list, the model's owner: ownership.py)."""
        ownership.check_model(self.key, name, access)


# The caller of the request this task serves; the middleware sets it, and it travels with the
# request's context into the tokeniser threads (Service.off_loop copies the context).
CALLER: contextvars.ContextVar[Caller | None] = contextvars.ContextVar("bertserve_caller", default=None)


def request_bucket(key: Key) -> TokenBucket | None:
    if key.rps is None:
        return None
    return TokenBucket(key.rps, key.burst if key.burst is not None else max(1.0, key.rps))


def token_bucket(key: Key) -> TokenBucket | None:
    if key.tokens_per_min is None:
        return None
    return TokenBucket(key.tokens_per_min / 60.0, key.tokens_per_min)


class LoadLimits:
    """Model loads per minute, per caller (BERT_MAX_LOADS_PER_MINUTE): a bucket of `per_minute` loads for
    each key name, refilled in a minute; 0 is no limit."""

    def __init__(self, per_minute: int):
        self.per_minute = per_minute
        self._buckets: dict[str | None, TokenBucket] = {}

    def take(self, who: str | None, model: str) -> None:
        """Count one load by key `who` (None: a request without a key), or refuse it with a 429 that names the
        limit and says when to retry."""
        if not self.per_minute:
            return
        bucket = self._buckets.get(who)
        if bucket is None:
            bucket = self._buckets[who] = TokenBucket(self.per_minute / 60.0, self.per_minute)
        wait = bucket.take()
        if wait > 0:
            retry = max(1, math.ceil(wait))
            whose = "requests without a key are" if who is None else f"key '{who}' is"
            they = "they" if who is None else "a key"
            raise ServiceError(
                "overloaded",
                f"{whose} over BERT_MAX_LOADS_PER_MINUTE={self.per_minute}, the model loads {they} may cause per "
                f"minute; model '{model}' is not loaded; retry in {retry} s",
                headers={"Retry-After": str(retry)},
            )

    def give(self, who: str | None) -> None:
        """Give back a load that did not happen."""
        if (bucket := self._buckets.get(who)) is not None:
            bucket.give()
