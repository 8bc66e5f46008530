"""Service settings: one pydantic-settings object, read from BERT_* environment variables.

Every field's description is the documentation's configuration table (docs/tables.py writes it); the
limits are enforced where they are used (app/serving/engine.py, app/api/middleware.py,
app/serving/service.py, app/jobs/uploads.py). Reference:
https://docs.pydantic.dev/latest/concepts/pydantic_settings/
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, get_args

from pydantic import Field, SecretStr, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from datadir.scheduling import PRIORITY_MAX, PRIORITY_MIN
from model.compute.device import DEVICE_PATTERN
from model.config import MAX_LABELS
from model.options import PRECISIONS
from worker.queue import BrokerUrlSetting, DataDirSetting, LogFormatSetting

Precision = Literal["auto", "fp32", "bf16", "int8"]  # auto: app/serving/service.py's precision_choice
assert get_args(Precision) == ("auto", *PRECISIONS)


BERT_INIT_ONLY = ("bootstrap", "bootstrap_steps")  # settings of the first start, not of the running service


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="BERT_", extra="ignore", populate_by_name=True)

    data_dir: DataDirSetting = Field(
        description=(
            "Models in `DATA_DIR/models/<name>/` (Hugging Face layout), datasets in `datasets/`, jobs in `jobs/`. "
            "Shared with the workers."
        ),
    )
    default_model: str | None = Field(
        None,
        description=(
            "Model for requests that name none. Unset: the only model in the store, if there is exactly one. "
            "`bert up` sets `minilm`."
        ),
    )
    default_mlm_model: str | None = Field(
        None,
        description=(
            "Model for `/fill-mask` and `/nsp` requests that name none. Unset: the one the first start chose "
            "(`DATA_DIR/defaults.json`: the `BERT_MLM_MODEL` import, or `wiki-mlm`, the bootstrap job's model), "
            "else `BERT_DEFAULT_MODEL`."
        ),
    )
    mlm_model: str = Field(
        "google-bert/bert-base-uncased",
        description=(
            "Hugging Face Hub repo that `bert init` and `bert up` import for `/fill-mask` and `/nsp` when the Hub "
            "answers (within 3 s; never with `HF_HUB_OFFLINE=1`); otherwise they queue the bootstrap training job, "
            "and the next start tries the Hub again. Empty: always the bootstrap job."
        ),
    )
    bootstrap: bool = Field(
        True,
        description=(
            "Whether `bert init` queues the bootstrap job (`false`, `0`, `no` or `off` skip it, as `--no-bootstrap` "
            "does). Blank: `true`."
        ),
    )
    bootstrap_steps: int | None = Field(
        None,
        description=(
            "Steps the bootstrap job that `bert init` queues trains for (`--bootstrap-steps` wins). Unset or blank: "
            "the job's own length."
        ),
    )
    rerank_model: str | None = Field(
        None,
        description=(
            "Model for `/rerank` requests that name none (TEI clients never do): a one-label sequence classifier, "
            "a cross-encoder. Unset: `BERT_DEFAULT_MODEL`."
        ),
    )
    predict_model: str | None = Field(
        None,
        description=(
            "Model for `/predict` requests that name none: a sequence classifier. Unset: `BERT_DEFAULT_MODEL`."
        ),
    )
    api_key: SecretStr | None = Field(
        None,
        description=(
            "When set, every route except `/health`, `/ready` and the console's static files (and `/metrics` with "
            "`BERT_METRICS_PUBLIC`) needs `Authorization: Bearer <key>`; 401 otherwise, decided before the body is "
            "read. Surrounding whitespace is dropped; blank is no key. Beyond loopback it must be at least 16 "
            "characters (`bert serve` exits with code 2)."
        ),
    )
    keys_file: Path | None = Field(
        None,
        description=(
            "The keys file (TOML) that `bert keys` writes: named keys with scopes, allowed models and rate limits, "
            "secrets stored only as their sha256. Read at start (a file that cannot be read stops the service) and "
            "again within a second of any change. Unset: `DATA_DIR/keys.toml`. With at least one key in it, every "
            "route but `/health`, `/ready` and the console's files needs a key."
        ),
    )
    metrics_public: bool = Field(
        False, description="Serve `/metrics` without the API key (a Prometheus scraper on a trusted network)."
    )
    log_format: LogFormatSetting
    load: Literal["startup", "lazy"] = Field(
        "startup",
        description=(
            "`startup`: load and warm up every stored model in the background at start; `/ready` turns 200 when "
            "the default is warm. `lazy`: load each model on first use."
        ),
    )
    device: str = Field(
        "auto",
        pattern=DEVICE_PATTERN,
        description=(
            "`auto` (CUDA when torch sees a GPU), `cpu`, `cuda` or `cuda:N`. The device decides what "
            "`BERT_PRECISION=auto` means."
        ),
    )
    precision: Precision = Field(
        "auto",
        description=(
            "Inference precision of every model, applied to its weights once at load: `auto`, `fp32`, `bf16` or "
            "`int8` (the encoder's linear layers; CPU only). `auto` on a CPU: the fastest precision this CPU runs "
            "natively whose accuracy against fp32, measured on the model's card for this kind of CPU, keeps the "
            "`BERT_AUTO_MIN_*` bounds on every output its heads give (fp32 until it is measured); on a CUDA GPU "
            "with native bf16, bf16, else fp32. On a CPU without native bf16 (or VNNI) those two run emulated, "
            "slower than fp32."
        ),
    )
    tf32: bool = Field(True, description="A CUDA GPU's fp32 matmuls in TF32 (Ampere on); `false`: full fp32 GEMMs.")
    model_precision: dict[str, Precision] = Field(
        default_factory=dict,
        description=(
            'Per-model overrides as JSON, e.g. `{"minilm": "int8", "wiki-mlm": "bf16"}`; `auto` is allowed '
            "too. `GET /models` shows each model's precision, `auto` resolved."
        ),
    )
    # auto on a CPU (app/serving/auto_precision.py): the bounds a precision keeps against fp32 on every output
    auto_min_cosine: float = Field(
        0.999, ge=0, le=1, description="`auto` on a CPU: the least embedding cosine to fp32's, on every text measured."
    )
    auto_min_agreement: float = Field(
        0.995,
        ge=0,
        le=1,
        description="`auto` on a CPU: the least agreement with fp32's labels (classification, "
        "token labels, answer spans, next sentence) and with a cross-encoder's pairwise order.",
    )
    auto_min_top5_overlap: float = Field(
        0.99, ge=0, le=1, description="`auto` on a CPU: the least overlap of a masked-LM head's top 5 with fp32's."
    )
    max_batch_tokens: int = Field(
        4096,
        ge=1,
        description=(
            "Padded tokens (rows x longest row) in one forward pass. It bounds activation memory, and how long a "
            "small request can wait behind a large one (one pass). Unset on a CUDA device: 16384 (a GPU pass is so "
            "short that larger passes keep it busy)."
        ),
    )
    model_memory_gb: float | None = Field(
        None,
        gt=0,
        description=(
            "Memory the loaded models may take together, in GB (2^30 bytes): their weights at their precision plus "
            "one forward pass's working set at `BERT_MAX_BATCH_TOKENS` (estimates: see Using, Memory). A model that "
            "does not fit unloads others: those fewest other keys used in the last minute first (among equals, the "
            "loading key's own, then the least recently used); one that can never fit is a 507. Unset: 50% of the "
            "RAM (or of the container's memory limit) on a CPU, 80% of the GPU's memory on CUDA."
        ),
    )
    pinned_models: list[str] | None = Field(
        None,
        description=(
            'Models never unloaded to make room, as JSON, e.g. `["minilm", "wiki-mlm"]`; `[]` pins none. Unset: the '
            "default model (`BERT_DEFAULT_MODEL`, or the only stored model)."
        ),
    )
    max_loads_per_minute: int = Field(
        30,
        ge=0,
        description=(
            "Model loads one key may cause per minute (refilled continuously; the requests without a key share one "
            "such limit). A request that would load a model past it is a 429 naming this limit, with `Retry-After`. "
            "0: no limit."
        ),
    )
    load_wait_seconds: float = Field(
        5.0,
        ge=0,
        description=(
            "Seconds a model load may wait for room under `BERT_MODEL_MEMORY_GB` (models still loading, or unloaded "
            "ones that requests still run on); then it is a 503 with `Retry-After`."
        ),
    )
    max_inputs: int = Field(64, ge=1, description="Texts or pairs in one request; more is a 422.")
    max_request_tokens: int = Field(
        32768,
        ge=1,
        description=(
            "Tokens in one request, all inputs together, counted after tokenising; more is a 422 that never "
            "reaches the model."
        ),
    )
    max_masks_per_input: int = Field(32, ge=1, description="`[MASK]` tokens in one `/fill-mask` input; more is a 422.")
    max_fill_mask_candidates: int = Field(
        1024,
        ge=1,
        description=(
            "Candidates in one `/fill-mask` answer: inputs x masks x `top_k` (`top_k` capped by the number of "
            "`targets`); more is a 422."
        ),
    )
    max_label_scores: int = Field(
        100,
        ge=1,
        description=(
            "Label scores per input in a `/classify` or `/predict` answer without `top_k`: every label of a model "
            "with at most this many, else the best this many. A larger `top_k` is a 422."
        ),
    )
    max_answer_values: int = Field(
        4_194_304,
        ge=1,
        description=(
            "Numbers in one `/embed_all` answer (every input's tokens x the hidden size) or entries in one "
            "`/embed_sparse` answer (inputs x the vocabulary size, or x `top_k` when it is smaller); more is a 422 "
            "that never reaches the model."
        ),
    )
    max_queue: int = Field(
        256, ge=1, description="Requests waiting for the inference thread; one more is a 429 (with `Retry-After`)."
    )
    max_tokenizer_queue: int = Field(
        256,
        ge=1,
        description=(
            "Tokenising and decoding jobs waiting for (or on) a tokeniser thread; one more is a 429 (with "
            "`Retry-After`)."
        ),
    )
    request_timeout: float = Field(
        30.0,
        gt=0,
        description=(
            "Seconds an inference request may take, from its first byte to its answer. Past it the client gets a "
            "503 and the request's work is dropped (queued work unrun, running work between passes)."
        ),
    )
    max_wait_ms: float = Field(
        2.0,
        ge=0,
        description=(
            "How long the oldest queued request may wait for others to share its batch. It waits only while more "
            "requests are arriving."
        ),
    )
    max_body_bytes: int = Field(
        1_048_576,
        ge=1,
        description="Larger request bodies get a 413 before they are read whole. `POST /datasets` has its own limit.",
    )
    batching: bool = Field(
        True, description="`false`: each request's inputs run alone, with no batches across requests and no waiting."
    )
    host: str = Field("127.0.0.1", description="Bind address.")
    port: int = Field(8000, ge=0, le=65535, description="Port.")
    allow_public: bool = Field(
        False,
        description=(
            "Allow binding beyond loopback (anything but 127.0.0.0/8, `::1`, `localhost`) without `BERT_API_KEY`. "
            "Without it, `bert serve` refuses and exits with code 2."
        ),
    )
    published_host: str | None = Field(
        None,
        description=(
            "In a container: the host address its port is published on (`-p ADDR:8000:8000`; compose sets it from "
            "`BERT_BIND`). The service listens on 0.0.0.0 there, so the key guard judges this address instead: "
            "loopback serves without a key, anything else needs one."
        ),
    )
    drain_seconds: float = Field(
        5.0,
        ge=0,
        le=300,
        description=(
            "Seconds a replica keeps serving after SIGTERM while /ready answers 503 and each answer closes its "
            "connection, so a load balancer stops sending it requests before it stops accepting them; then "
            "`BERT_GRACEFUL_TIMEOUT` applies. Ctrl-C (SIGINT) does not wait."
        ),
    )
    graceful_timeout: float = Field(
        30.0,
        ge=0,
        description="Seconds that in-flight requests get to finish once the server stops accepting (after the drain).",
    )
    header_timeout: float = Field(
        10.0,
        gt=0,
        description=(
            "Seconds a connection has to send a request's headers (from connecting, or from the end of its previous "
            "answer on a kept-alive connection); then it is closed."
        ),
    )
    body_timeout: float = Field(
        30.0, gt=0, description="Seconds a request body may stall between two reads; then the connection is closed."
    )
    max_connections: int = Field(
        1000, ge=1, description="Open connections at once; one more gets a 503 (with `Retry-After`) and is closed."
    )
    tokenizer_threads: int = Field(2, ge=1, description="Threads that tokenise requests, off the event loop.")
    torch_threads: int = Field(
        0, ge=0, description="torch intra-op threads for forward passes; 0 means torch's default (one per core)."
    )

    # -- training jobs (/jobs, /datasets) ----------------------------------------------------------
    admin_key: SecretStr | None = Field(
        None,
        description=(
            "Opens `/jobs` and `/datasets` (`Authorization: Bearer <key>`); `BERT_API_KEY` does not. Unset: the API "
            "key guards them if there is one; with neither set they are open. Beyond loopback it must be at least "
            "16 characters."
        ),
    )
    broker_url: BrokerUrlSetting = Field(
        description="Where `POST /jobs` sends jobs; it must be the workers' broker.",
    )
    max_dataset_bytes: int = Field(
        100 * 1024 * 1024,
        ge=1,
        description=(
            "Largest dataset upload, in bytes. The upload is streamed to disk and stops with a 413 at the limit."
        ),
    )
    max_model_upload_bytes: int = Field(
        4 * 1024**3,
        ge=1,
        description=(
            "Largest model archive `POST /models` accepts, in bytes. The upload is streamed to disk and stops with a "
            "413 at the limit."
        ),
    )
    max_dataset_import_bytes: int = Field(
        1024**3,
        ge=1,
        description=(
            "Largest download of a dataset import from the Hugging Face Hub (`POST /datasets` with a repo id, `bert "
            "datasets import`): the files of the split it imports, by the sizes the Hub lists, refused before any of "
            "them downloads. The file the import writes is bounded by `BERT_MAX_DATASET_BYTES`, as an upload is."
        ),
    )
    dataset_check_seconds: float = Field(
        300.0,
        gt=0,
        description=(
            "Seconds of CPU time (and of waiting) the format check of an uploaded file may take; it runs in a "
            "separate process, and past this the upload is a 422."
        ),
    )
    max_labels: int = Field(
        MAX_LABELS,
        ge=2,
        le=MAX_LABELS,  # the most labels any model may have (model/config.py)
        description=(
            "Distinct labels (tags) of a labelled or token-labelled dataset; more is a 422 at upload and at "
            f"`POST /jobs`. Each label is a classifier output, scored at every evaluation. At most {MAX_LABELS:,}."
        ),
    )
    publish_retries: int = Field(
        2,
        ge=0,
        le=10,
        description="How many times publishing a job to the broker is retried before `POST /jobs` answers 503.",
    )
    # The defaults of the next two fit a 23 GB, CPU-only worker machine (BERT-large's AdamW state alone is 5.4 GB).
    job_max_params: int = Field(
        500_000_000,
        ge=1,
        description=(
            "A job whose model has more parameters (counted from its config) is a 422. BERT-large (335 M) fits."
        ),
    )
    job_max_memory_gb: float = Field(
        16.0,
        gt=0,
        description=(
            "A job whose estimated peak training memory is larger is a 422. The default fits a 23 GB worker "
            "machine; set it to the workers' RAM (or GPU memory) less a margin."
        ),
    )
    job_max_runtime: int = Field(
        3 * 24 * 3600,
        ge=1,
        description=(
            "Seconds: the most a job's `params.max_runtime` may be, and its default (3 days). Past it the job "
            'checkpoints and fails with "time limit".'
        ),
    )
    job_max_priority: int = Field(
        PRIORITY_MAX,
        ge=PRIORITY_MIN,
        le=PRIORITY_MAX,
        description=(
            f"The highest `priority` a job may ask for ({PRIORITY_MIN} to {PRIORITY_MAX}; more is a 422). A queued "
            "job of higher priority runs first, and makes the lowest-priority running job hand its worker back."
        ),
    )
    job_max_devices: int = Field(
        1,
        ge=1,
        le=64,
        description=(
            "The most processes (GPUs, or CPU processes) a job's `params.devices` may ask for; more is a 422. Set "
            "it to what every worker has: a worker with fewer fails the job."
        ),
    )
    max_event_streams: int = Field(
        64, ge=1, description="`GET /jobs/{id}/events` streams open at once; one more is a 429 (with `Retry-After`)."
    )
    max_event_streams_per_job: int = Field(
        4, ge=1, description="Event streams of one job open at once; one more is a 429 (with `Retry-After`)."
    )
    max_event_streams_per_key: int | None = Field(
        None,
        ge=1,
        description=(
            "Event streams one API key holds open at once; one more is a 429 naming the key and this limit, so one "
            "key cannot take every stream. Unset: a quarter of `BERT_MAX_EVENT_STREAMS` (at least 1)."
        ),
    )
    event_stream_max_seconds: float = Field(
        3600.0,
        gt=0,
        description=(
            "Seconds one event stream lasts; then the server closes it, and a client reconnects with "
            "`Last-Event-ID` (the curve goes on from where it was)."
        ),
    )
    batch_max_file_bytes: int = Field(
        100 * 1024 * 1024,
        ge=1,
        description=(
            "Largest `POST /v1/files` upload (a batch's input JSONL), in bytes: streamed to disk, a 413 at the "
            "limit. Each line's body is held to `BERT_MAX_BODY_BYTES` and its tokens to `BERT_MAX_REQUEST_TOKENS`, "
            "as the online route would; a line over them goes to the batch's error file."
        ),
    )
    batch_max_lines: int = Field(
        50_000,
        ge=1,
        description="Requests (lines) in one batch's input file; more is a 422 at `POST /v1/batches`.",
    )
    batch_chunk_lines: int = Field(
        256,
        ge=1,
        le=100_000,
        description=(
            "Lines a batch commits at once (appended to its output, fsynced, then counted in its record); a "
            "restart goes on after the last committed chunk."
        ),
    )
    batch_concurrency: int = Field(
        4096,
        ge=1,
        le=65_536,
        description=(
            "Lines of one batch sorted by length together (those for the same model with the same options) and "
            "cut into forward passes under `BERT_MAX_BATCH_TOKENS`; while their passes run, as many more lines "
            "are read and tokenised, so the next cut is ready (twice this many lines in flight). The batch keeps "
            "two passes in the batching engine (one running, one queued), so an online request waits for at most "
            "those two. Their tokenising takes at most a quarter of `BERT_MAX_TOKENIZER_QUEUE`, the rest stays "
            "for the online routes. 1: one line at a time, each answer identical to the online route's."
        ),
    )
    batch_pass_tokens: int = Field(
        384,
        ge=1,
        description=(
            "Padded tokens in a forward pass of batch lines while online requests come (one in the last second), "
            "at most `BERT_MAX_BATCH_TOKENS`: an online request waits behind at most such a pass. With no online "
            "traffic, batch lines fill passes of `BERT_MAX_BATCH_TOKENS`."
        ),
    )
    batch_max_running: int = Field(
        2,
        ge=1,
        le=64,
        description=(
            "Batches each replica runs at once; the others stay queued and start as those finish, oldest first "
            "(their lines go to the engine after every online request in any case)."
        ),
    )
    batch_retention_days: float = Field(
        30.0,
        ge=0,
        description="Days a `/v1/files` file (batch input, output or errors) is kept before it is deleted; 0: kept until deleted.",
    )
    # A mine-negatives job (app/jobs/mining.py) is sized from its datasets' meta.json before it is queued.
    mine_max_anchors: int = Field(
        100_000,
        ge=1,
        description=(
            "Distinct anchors of the pairs dataset a `mine-negatives` job mines negatives for; more is a 422 at "
            "`POST /jobs`."
        ),
    )
    mine_max_corpus: int = Field(
        1_000_000,
        ge=1,
        description=(
            "Texts a `mine-negatives` job searches, counted before duplicates go: the dataset's positives and "
            "negatives, or its `corpus` dataset's texts and the positives; more is a 422 at `POST /jobs`."
        ),
    )
    mine_max_negatives: int = Field(
        20,
        ge=1,
        le=100,
        description="The most `num_negatives` a `mine-negatives` job may ask for (at most 100, a pair's bound).",
    )
    mine_max_range: int = Field(
        1000,
        ge=1,
        description=(
            "The deepest rank a `mine-negatives` job looks at: its `range_max`, or the default (`range_min` + "
            "`num_negatives`, ten times `num_negatives` with a margin or `max_score`); more is a 422. Each anchor "
            "keeps that many candidates, and one more per positive, while it is mined."
        ),
    )
    mine_max_memory_gb: float = Field(
        4.0,
        gt=0,
        description=(
            "Memory a `mine-negatives` job's embeddings matrix (every anchor and corpus text, float32) and its "
            "candidate tables may take, estimated before it is queued; more is a 422. Its embeddings are also "
            "kept on disk while it runs, counted against its key's disk quota."
        ),
    )
    checkpoint_retention_days: float = Field(
        3.0,
        ge=0,
        description=(
            "Days the checkpoints of a cancelled or failed job are kept after it ended; then they are removed (its "
            "record, curve and any final model stay; a restart begins from scratch). 0: kept until the job is deleted."
        ),
    )

    @field_validator("bootstrap", "bootstrap_steps", mode="before")
    @classmethod
    def _as_bert_init_reads_it(cls, value: object, info: ValidationInfo) -> object:
        """A variable's text as `bert init` has always read it: blank is unset; a flag is 1/true/yes/on or
        0/false/no/off in any case; steps are a whole number (which `bert init` holds to >= 1, as its flag)."""
        if not isinstance(value, str):
            return value
        text, variable = value.strip(), f"{cls.model_config.get('env_prefix', '')}{info.field_name}".upper()
        if info.field_name == "bootstrap_steps":
            try:
                return int(text) if text else None
            except ValueError:
                raise ValueError(f"{variable} must be a whole number, got {text!r}") from None
        if text.lower() in ("", "1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{variable} must be true or false, got {text.lower()!r}")

    def event_streams_per_key(self) -> int:
        """BERT_MAX_EVENT_STREAMS_PER_KEY, or a quarter of BERT_MAX_EVENT_STREAMS when it is unset."""
        return self.max_event_streams_per_key or max(1, self.max_event_streams // 4)

    def keys_path(self) -> Path:
        return self.keys_file if self.keys_file is not None else self.data_dir / "keys.toml"

    def admin_key_value(self) -> str | None:
        return _key(self.admin_key)

    def public_dict(self) -> dict:
        """Settings that are safe to show on /info (the API key only as set / not set)."""
        d = self.model_dump(exclude={"api_key", "admin_key", "broker_url", *BERT_INIT_ONLY})
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
