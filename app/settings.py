"""Service settings: one pydantic-settings object, read from BERT_* environment variables.

Every field is documented in the README's configuration table; the limits are enforced where
they are used (app/serving/engine.py, app/api/middleware.py, app/serving/service.py, app/jobs/uploads.py). Reference:
https://docs.pydantic.dev/latest/concepts/pydantic_settings/
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import AliasChoices, Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from model.device import DEVICE_PATTERN
from model.options import PRECISIONS

Precision = Literal[("auto", *PRECISIONS)]  # auto: recommended_precision of the device (model/precision.py)


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="BERT_", extra="ignore", populate_by_name=True)

    # Models live in DATA_DIR/models/<name>/ (HF layout).
    data_dir: Path = Path("./data")
    # Model used when a request names none; unset = the only model in the store, if there is one.
    default_model: str | None = None
    # Model /fill-mask and /nsp use when a request names none; unset = BERT_DEFAULT_MODEL. (`make run`
    # sets it to the bootstrap job's model while BERT_DEFAULT_MODEL stays the MiniLM encoder.)
    default_mlm_model: str | None = None
    # Models the text-embeddings-inference routes use when a request names none (TEI's clients never
    # do): /rerank a one-label sequence classifier (a cross-encoder), /predict a classifier. Unset =
    # BERT_DEFAULT_MODEL.
    rerank_model: str | None = None
    predict_model: str | None = None
    # When set, every route except /health and /ready (and /metrics if BERT_METRICS_PUBLIC) needs
    # `Authorization: Bearer <key>`. Surrounding whitespace is dropped; blank is no key. Beyond
    # loopback `bert serve` refuses a key shorter than 16 characters.
    api_key: SecretStr | None = None
    # Serve /metrics without the API key (a Prometheus scraper on a trusted network).
    metrics_public: bool = False
    # startup: load (and warm up) every stored model when the service starts; lazy: on first use.
    load: Literal["startup", "lazy"] = "startup"
    # auto (CUDA when torch sees a GPU), cpu, cuda or cuda:N (one GPU of several).
    device: str = Field("auto", pattern=DEVICE_PATTERN)
    # Inference precision of every model (model/precision.py), applied to its weights once at load:
    # auto (model.precision.recommended_precision: bf16 on a CUDA GPU with native bf16, else fp32),
    # fp32, bf16, or int8 (CPU; the encoder's linear layers). Their measured accuracy cost is in the
    # README's benchmarks.
    precision: Precision = "auto"
    # Per-model overrides, JSON: BERT_MODEL_PRECISION='{"minilm": "int8", "wiki-mlm": "bf16"}'.
    model_precision: dict[str, Precision] = Field(default_factory=dict)
    # Padded tokens (batch rows x longest row) in one forward pass; bounds activation memory, and how
    # long a small request can wait behind a large one (one pass; bench/bounds_bench.py).
    max_batch_tokens: int = Field(4096, ge=1)
    # Texts (or pairs) in one request.
    max_inputs: int = Field(64, ge=1)
    # Tokens in one request, all its inputs together (cost known after tokenising); more is a 422.
    max_request_tokens: int = Field(32768, ge=1)
    # [MASK] tokens in one /fill-mask input; more is a 422.
    max_masks_per_input: int = Field(32, ge=1)
    # /fill-mask candidates in one request: inputs x masks x top_k (top_k capped by the targets); more
    # is a 422. Bounds the answer's size and the decoding behind it.
    max_fill_mask_candidates: int = Field(1024, ge=1)
    # Label scores per input in a /classify or /predict answer when the request sets no top_k: every
    # label of a model with at most this many, else the best this many. A larger top_k is a 422.
    max_label_scores: int = Field(100, ge=1)
    # Requests waiting for the inference thread; one more is answered 429.
    max_queue: int = Field(256, ge=1)
    # Tokenising and decoding jobs waiting for (or on) a tokeniser thread; one more is answered 429.
    max_tokenizer_queue: int = Field(256, ge=1)
    # Seconds an inference request may take, from its first byte to its answer; past it the client
    # gets 503 and the request's work is dropped (queued work unrun, running work between batches).
    request_timeout: float = Field(30.0, gt=0)
    # How long the first waiting request may wait for others to share its batch.
    max_wait_ms: float = Field(2.0, ge=0)
    # Request bodies above this are answered 413 without being read whole.
    max_body_bytes: int = Field(1_048_576, ge=1)
    # Off: each request's inputs run alone (no cross-request batches, no waiting).
    batching: bool = True
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    # Allow listening beyond loopback without BERT_API_KEY.
    allow_public: bool = False
    # The host address a container's port is published on (`-p ADDR:8000:8000`; compose sets it from
    # BERT_BIND). In a container the service must listen on 0.0.0.0, so the key guard judges this
    # address instead of the bind address: loopback serves without a key, anything else needs one.
    published_host: str | None = None
    # Seconds in-flight requests get to finish after SIGTERM.
    graceful_timeout: float = Field(30.0, ge=0)
    # Seconds a client has to send a request's headers (from connecting, or from the end of the
    # previous answer on a kept-alive connection); then the connection is closed.
    header_timeout: float = Field(10.0, gt=0)
    # Seconds a request body may stall between two reads; then the connection is closed.
    body_timeout: float = Field(30.0, gt=0)
    # Open connections at once; one more is answered 503 (Retry-After) and closed.
    max_connections: int = Field(1000, ge=1)
    # Threads that tokenise requests (off the event loop).
    tokenizer_threads: int = Field(2, ge=1)
    # torch intra-op threads for forward passes; 0 = torch's default (one per core).
    torch_threads: int = Field(0, ge=0)

    # -- training jobs (/jobs, /datasets) ----------------------------------------------------------
    # Opens /jobs and /datasets (Authorization: Bearer <key>); BERT_API_KEY does not. Unset: the
    # API key guards them when there is one, else they are open (the service listens on loopback).
    admin_key: SecretStr | None = None
    # Where jobs are sent; must be the workers' broker. REDIS_URL is accepted too.
    broker_url: str = Field("redis://127.0.0.1:6379/0", validation_alias=AliasChoices("BERT_BROKER_URL", "REDIS_URL"))
    # Largest dataset upload, in bytes (streamed to disk; the upload stops at the limit with 413).
    max_dataset_bytes: int = Field(100 * 1024 * 1024, ge=1)
    # Seconds of CPU time (and of waiting) the format check of an uploaded dataset may take; it
    # runs in a child process, and past this the upload is a 422.
    dataset_check_seconds: float = Field(300.0, gt=0)
    # Distinct labels (classes, or tags) of a labelled or token-labelled dataset: more is a 422 at
    # upload and at POST /jobs. Each label is a classifier output, scored at every evaluation.
    max_labels: int = Field(10_000, ge=2)
    # Publishing a job retries this many times before answering 503 (broker unreachable).
    publish_retries: int = Field(2, ge=0, le=10)
    # Jobs are sized before they are queued (model/sizing.py): a model with more parameters than
    # this, or a run whose estimated peak training memory is above the next, is a 422. The defaults
    # fit a 23 GB, CPU-only worker machine (BERT-large, 335 M, fits; its AdamW state alone is 5.4 GB).
    job_max_params: int = Field(500_000_000, ge=1)
    job_max_memory_gb: float = Field(16.0, gt=0)
    # Seconds of training a job may take (params.max_runtime, at most this; also the default). Past
    # it the job checkpoints and fails with "time limit". 3 days, the worker's BERT_JOB_SOFT_TIME_LIMIT.
    job_max_runtime: int = Field(3 * 24 * 3600, ge=1)
    # The most processes (GPUs, or CPU processes) a job may train on (params.devices, data parallel
    # through torchrun). Set it to what every worker has: a worker with fewer fails the job.
    job_max_devices: int = Field(1, ge=1, le=64)

    # GET /jobs/{id}/events: streams open at once, in all and per job (one more is a 429 with
    # Retry-After), and the seconds one stream lasts before the server closes it (a client then
    # reconnects with Last-Event-ID, and the curve goes on from where it was).
    max_event_streams: int = Field(64, ge=1)
    max_event_streams_per_job: int = Field(4, ge=1)
    event_stream_max_seconds: float = Field(3600.0, gt=0)

    def admin_key_value(self) -> str | None:
        return _key(self.admin_key)

    def public_dict(self) -> dict:
        """Settings that are safe to show on /info (the API key only as set / not set)."""
        d = self.model_dump(exclude={"api_key", "admin_key", "broker_url"})
        d["data_dir"] = str(self.data_dir)
        d["api_key_set"] = self.api_key_value() is not None
        d["admin_key_set"] = self.admin_key_value() is not None
        return d

    def api_key_value(self) -> str | None:
        return _key(self.api_key)


def _key(secret: SecretStr | None) -> str | None:
    """A key's value without surrounding whitespace (HTTP drops it from headers); blank is no key."""
    value = secret.get_secret_value().strip() if secret is not None else ""
    return value or None
