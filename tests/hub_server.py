"""A tiny Hugging Face Hub for tests: the HTTP endpoints the real huggingface_hub client calls to list a
repo and download its files, served from memory by a threading http.server on loopback.

    GET  /api/models/{repo}[/revision/{rev}]   model_info: sha, siblings (with sizes), cardData
    HEAD /{repo}/resolve/{rev}/{file}          X-Repo-Commit, ETag, Content-Length; weights (LFS on
                                               the Hub) answer 302 to a "CDN" on another host name
                                               (localhost) with X-Linked-Etag and X-Linked-Size
    GET  /{repo}/resolve/{rev}/{file}          the same, with the bytes
    GET  /api/datasets/{repo}[/revision/{rev}] dataset_info, the same for a dataset repo (cardData: its
                                               README.md's YAML); a revision may hold slashes, sent as %2F
                                               (refs/convert/parquet, the Hub's Parquet export)
    HEAD, GET /datasets/{repo}/resolve/{rev}/{file}   a dataset repo's files (Parquet files are LFS)
    GET  /cdn/{sha256}                          an LFS file's bytes

Failures answer as the Hub does: 401 + X-Error-Code RepoNotFound for a repo that does not exist, 404
RevisionNotFound, 404 EntryNotFound, and 401 GatedRepo for a gated repo's files without the token.
Point a process at it with HF_ENDPOINT=<url> (huggingface_hub reads it at import).
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

TOKEN = "hf_test_token_with_access"
LFS_SUFFIXES = (".safetensors", ".bin", ".parquet")


@dataclass
class Repo:
    refs: dict[str, str] = field(default_factory=dict)  # branch -> commit sha
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)  # sha -> {path: bytes}
    gated: bool = False
    license: str | None = "apache-2.0"

    def resolve(self, rev: str) -> str | None:
        return self.refs.get(rev) or (rev if rev in self.commits else None)


class HubServer:
    """The fake Hub: `add` repos, `start`, read `url`; `requests` logs (method, path) for assertions."""

    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.datasets: dict[str, Repo] = {}
        self.blobs: dict[str, bytes] = {}
        self.requests: list[tuple[str, str]] = []
        self._httpd: ThreadingHTTPServer | None = None

    def add(
        self,
        repo_id: str,
        revisions: dict[str, dict[str, bytes]],
        gated: bool = False,
        license: str | None = "apache-2.0",
        repo_type: str = "model",
    ) -> Repo:
        """Repo `repo_id` (a model's, or a dataset's) with one commit per branch name in `revisions`
        ({branch: {path: bytes}})."""
        repos = self.datasets if repo_type == "dataset" else self.repos
        repo = repos.setdefault(repo_id, Repo(gated=gated, license=license))
        for branch, files in revisions.items():
            sha = hashlib.sha1(repr((repo_id, branch, sorted(files.items()))).encode()).hexdigest()
            repo.refs[branch], repo.commits[sha] = sha, dict(files)
            for content in files.values():
                self.blobs[hashlib.sha256(content).hexdigest()] = content
        return repo

    def add_dir(self, repo_id: str, revisions: dict[str, Path], **kwargs) -> Repo:
        """Repo whose branches hold the files of local directories."""
        return self.add(
            repo_id,
            {
                b: {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}
                for b, d in revisions.items()
            },
            **kwargs,
        )

    @property
    def port(self) -> int:
        assert self._httpd is not None
        return self._httpd.server_address[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> HubServer:
        hub = self

        class Handler(_Handler):
            server_hub = hub

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        threading.Thread(target=self._httpd.serve_forever, daemon=True, name="test-hub").start()
        return self

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()


class _Handler(BaseHTTPRequestHandler):
    server_hub: HubServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args) -> None:  # quiet: tests read `requests` instead
        pass

    def do_HEAD(self) -> None:
        self._route(body=False)

    def do_GET(self) -> None:
        self._route(body=True)

    def _route(self, body: bool) -> None:
        raw = urlsplit(self.path).path
        path = unquote(raw)
        self.server_hub.requests.append((self.command, path))
        hub = self.server_hub
        if m := re.fullmatch(r"/api/datasets/([^/]+/[^/]+)(?:/revision/([^/]+))?", raw):
            return self._model_info(unquote(m[1]), unquote(m[2] or "main"), body, hub.datasets)
        if m := re.fullmatch(r"/datasets/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", raw):
            return self._resolve(unquote(m[1]), unquote(m[2]), unquote(m[3]), body, hub.datasets)
        if m := re.fullmatch(r"/api/models/(.+?)(?:/revision/([^/]+))?", path):
            return self._model_info(m[1], m[2] or "main", body)
        if m := re.fullmatch(r"/cdn/([0-9a-f]{64})", path):
            content = self.server_hub.blobs.get(m[1])
            if content is None:
                return self._error(404, "EntryNotFound", "no such blob", body)
            return self._send(200, content, {"ETag": f'"{m[1]}"'}, body)
        if m := re.fullmatch(r"/([^/]+(?:/[^/]+)?)/resolve/([^/]+)/(.+)", path):
            return self._resolve(m[1], m[2], m[3], body)
        self._error(404, None, "not found", body)

    def _model_info(self, repo_id: str, rev: str, body: bool, repos: dict[str, Repo] | None = None) -> None:
        is_dataset = repos is not None
        repo = (self.server_hub.repos if repos is None else repos).get(repo_id)
        if repo is None:
            return self._error(401, "RepoNotFound", "Repository not found", body)
        sha = repo.resolve(rev)
        if sha is None:
            return self._error(404, "RevisionNotFound", "Invalid rev id: " + rev, body)
        siblings = [_sibling(name, content) for name, content in sorted(repo.commits[sha].items())]
        info = {
            "_id": sha[:24],
            "id": repo_id,
            "modelId": repo_id,
            "sha": sha,
            "private": False,
            "gated": "auto" if repo.gated else False,
            "disabled": False,
            "tags": ["transformers", "bert"],
            "pipeline_tag": None,
            "library_name": "transformers",
            "cardData": {"license": repo.license} if repo.license else {},
            "siblings": siblings,
        }
        if is_dataset:
            for key in ("modelId", "pipeline_tag", "library_name"):
                del info[key]
            info["tags"] = []
            info["cardData"] = _front_matter(repo.commits[sha].get("README.md", b""))
        self._send(200, json.dumps(info).encode(), {"Content-Type": "application/json"}, body)

    def _resolve(self, repo_id: str, rev: str, name: str, body: bool, repos: dict[str, Repo] | None = None) -> None:
        repo = (self.server_hub.repos if repos is None else repos).get(repo_id)
        if repo is None:
            return self._error(401, "RepoNotFound", "Repository not found", body)
        if repo.gated and self.headers.get("Authorization") != f"Bearer {TOKEN}":
            return self._error(401, "GatedRepo", "Access to model is restricted. You must be authenticated.", body)
        sha = repo.resolve(rev)
        if sha is None:
            return self._error(404, "RevisionNotFound", "Invalid rev id: " + rev, body)
        content = repo.commits[sha].get(name)
        if content is None:
            return self._error(404, "EntryNotFound", f"{name} does not exist on {rev}", body)
        headers = {"X-Repo-Commit": sha}
        if name.endswith(LFS_SUFFIXES):  # the Hub sends LFS files to its CDN, another host
            digest = hashlib.sha256(content).hexdigest()
            headers.update(
                {
                    "Location": f"http://localhost:{self.server_hub.port}/cdn/{digest}",
                    "X-Linked-Etag": f'"{digest}"',
                    "X-Linked-Size": str(len(content)),
                    "ETag": f'"{_git_sha(content)}"',
                }
            )
            return self._send(302, b"", headers, body)
        headers["ETag"] = f'"{_git_sha(content)}"'
        self._send(200, content, headers, body)

    def _error(self, status: int, code: str | None, message: str, body: bool) -> None:
        headers = {"X-Error-Message": message, "Content-Type": "application/json"}
        if code:
            headers["X-Error-Code"] = code
        self._send(status, json.dumps({"error": message}).encode(), headers, body)

    def _send(self, status: int, content: bytes, headers: dict[str, str], body: bool) -> None:
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(content)))
        self.end_headers()
        if body:
            self.wfile.write(content)


def _front_matter(readme: bytes) -> dict | None:
    """A card's YAML, as the Hub's API gives it (cardData)."""
    import yaml

    m = re.match(rb"^---\n(.*?)\n---", readme, re.S)
    return yaml.safe_load(m[1]) if m else None


def _git_sha(content: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


def _sibling(name: str, content: bytes) -> dict:
    entry: dict = {"rfilename": name, "size": len(content), "blobId": _git_sha(content)}
    if name.endswith(LFS_SUFFIXES):
        entry["lfs"] = {"size": len(content), "sha256": hashlib.sha256(content).hexdigest(), "pointerSize": 134}
    return entry


# -- the tiny repos the tests import --------------------------------------------------------------

TINY_REPO = "google-bert/bert-tiny"  # main and branch "v2" (other weights)
BIN_REPO = "acme/bert-tiny-bin"  # pytorch_model.bin only
PICKLED_REPO = "acme/bert-pickled"  # a pytorch_model.bin that needs unpickling
GATED_REPO = "acme/bert-gated"
NOT_BERT_REPO = "acme/gpt-tiny"
NO_WEIGHTS_REPO = "acme/bert-no-weights"
SHARDED_REPO = "acme/bert-sharded"
# SPLADE checkpoints as the Hub has them: a BertForMaskedLM with a sentence-transformers SparseEncoder's files
# (MLMTransformer, SpladePooling), and a plain BertForMaskedLM with LayerNorm.gamma/beta names and no such files
SPLADE_REPO = "naver/splade-cocondenser-ensembledistil"
SPLADE_PLAIN_REPO = "prithivida/Splade_PP_en_v1"


def tiny_model_dir(root: Path, seed: int) -> Path:
    """A random tiny BertForPreTraining with its vocabulary, in HF's layout (safetensors)."""
    import torch

    from model.modeling import BertForPreTraining
    from model.tokenizer import BertTokenizer
    from tests.helpers import VOCAB, tiny_config

    torch.manual_seed(seed)
    path = root / f"tiny-{seed}"
    BertForPreTraining(tiny_config()).save_pretrained(path, tokenizer=BertTokenizer.from_vocab(VOCAB))
    return path


COLBERT_REPO = "lightonai/colbert-tiny"  # PyLate's layout: Transformer + pylate Dense, [Q] / [D] markers
COLBERT_IR_REPO = "colbert-ir/colbert-tiny"  # colbert-ir's: a BertModel with linear.weight, artifact.metadata
COLBERT_DIM = 16
COLBERT_MARKERS = ["[unused0]", "[unused1]", "[Q] ", "[D] "]  # after the tiny vocabulary


def tiny_colbert_dir(
    root: Path, layout: str, seed: int = 0, dim: int = COLBERT_DIM, positions: int = 64, **settings
) -> Path:
    """A random tiny ColBERT in PyLate's layout ("pylate") or colbert-ir's ("colbert-ir"): a BertModel of the
    tiny config (with `positions` positions) whose vocabulary has both layouts' markers, and a (dim, 32)
    projection; `settings` change the ColBERT options (query_length 8 and document_length 12 unless given)."""
    import torch
    from safetensors.torch import save_file

    from model.late_interaction import ColBERTSettings, LateInteraction, write_late_interaction
    from model.modeling import BertModel
    from model.tokenizer import BertTokenizer
    from tests.helpers import VOCAB, tiny_config

    torch.manual_seed(seed)
    vocab = VOCAB + COLBERT_MARKERS
    path = root / f"colbert-{layout}-{seed}"
    model = BertModel(tiny_config(vocab_size=len(vocab), max_position_embeddings=positions), add_pooling_layer=False)
    model.save_pretrained(path, tokenizer=BertTokenizer.from_vocab(vocab))
    weight = torch.randn(dim, model.config.hidden_size) / model.config.hidden_size**0.5
    options = {"query_length": 8, "document_length": 12, **settings}
    if layout == "pylate":
        write_late_interaction(path, LateInteraction(ColBERTSettings(**options), weight))
        return path
    from safetensors.torch import load_file

    state = {f"bert.{k}": v for k, v in load_file(path / "model.safetensors").items()}
    save_file({**state, "linear.weight": weight.contiguous()}, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "architectures": ["HF_ColBERT"]}, indent=2))
    meta = {
        "query_token_id": "[unused0]",
        "doc_token_id": "[unused1]",
        "query_maxlen": options["query_length"],
        "doc_maxlen": options["document_length"],
        "dim": dim,
        "attend_to_mask_tokens": options.get("attend_to_expansion_tokens", False),
        "similarity": "cosine",
        "mask_punctuation": True,
    }
    (path / "artifact.metadata").write_text(json.dumps(meta, indent=2))
    return path


def tiny_hub(root: Path) -> HubServer:
    """A started HubServer holding the test repos above (built in `root`)."""
    import argparse

    import torch
    from safetensors.torch import load_file

    main, v2 = tiny_model_dir(root, 0), tiny_model_dir(root, 1)
    text = {p.name: p.read_bytes() for p in main.iterdir() if p.name != "model.safetensors"}
    buf = root / "weights.bin"
    torch.save(load_file(main / "model.safetensors"), buf)
    pickled = root / "pickled.bin"  # the weights, and an object that only unpickling code would rebuild
    torch.save({**load_file(main / "model.safetensors"), "args": argparse.Namespace(lr=1)}, pickled)
    hub = HubServer()
    hub.add_dir(TINY_REPO, {"main": main, "v2": v2})
    hub.add(BIN_REPO, {"main": {**text, "pytorch_model.bin": buf.read_bytes()}}, license="mit")
    hub.add(PICKLED_REPO, {"main": {**text, "pytorch_model.bin": pickled.read_bytes()}})
    hub.add_dir(GATED_REPO, {"main": main}, gated=True)
    gpt = json.dumps({"model_type": "gpt2", "n_layer": 2}).encode()
    hub.add(
        NOT_BERT_REPO, {"main": {"config.json": gpt, "model.safetensors": (main / "model.safetensors").read_bytes()}}
    )
    hub.add(NO_WEIGHTS_REPO, {"main": text})
    hub.add(SHARDED_REPO, {"main": {**text, "model.safetensors.index.json": b'{"weight_map": {}}'}})
    sparse, plain = splade_dirs(root)
    hub.add_dir(SPLADE_REPO, {"main": sparse})
    hub.add_dir(SPLADE_PLAIN_REPO, {"main": plain})
    hub.add_dir(COLBERT_REPO, {"main": tiny_colbert_dir(root, "pylate")})
    hub.add_dir(COLBERT_IR_REPO, {"main": tiny_colbert_dir(root, "colbert-ir")})
    add_dataset_repos(hub)
    return hub.start()


def splade_dirs(root: Path) -> tuple[Path, Path]:
    """(a tiny BertForMaskedLM with a SparseEncoder's files, the same weights as a plain checkpoint whose
    LayerNorms are named gamma and beta); root/splade-mlm holds the weights as saved."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from model.modeling import BertForMaskedLM
    from model.sentence_modules import SentenceModules, Splade, write_sentence_modules
    from model.tokenizer import BertTokenizer
    from tests.helpers import VOCAB, tiny_config

    torch.manual_seed(5)
    saved, sparse, plain = root / "splade-mlm", root / "splade-st", root / "splade-plain"
    BertForMaskedLM(tiny_config()).save_pretrained(saved, tokenizer=BertTokenizer.from_vocab(VOCAB))
    shutil.copytree(saved, sparse)
    write_sentence_modules(sparse, SentenceModules(normalize=False, splade=Splade()))
    shutil.copytree(saved, plain)
    weights = load_file(saved / "model.safetensors")
    legacy = {
        k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
        for k, v in weights.items()
    }
    save_file(legacy, plain / "model.safetensors")
    return sparse, plain


# -- the repos the documentation imports, as tiny models with the real ones' heads, labels and casing --

NER_LABELS = ["O", "B-MISC", "I-MISC", "B-PER", "I-PER", "B-ORG", "I-ORG", "B-LOC", "I-LOC"]
NLI_LABELS = ["entailment", "neutral", "contradiction"]


def docs_hub(root: Path) -> HubServer:
    """A started HubServer holding tiny stand-ins for the Hub models docs/models.md and docs/retrieval.md import."""
    import torch

    from model.modeling import (
        BertForPreTraining,
        BertForQuestionAnswering,
        BertForSequenceClassification,
        BertForTokenClassification,
    )
    from model.tokenizer import BertTokenizer
    from tests.helpers import VOCAB, tiny_config

    def save(repo: str, model, lowercase: bool) -> None:
        path = root / repo.replace("/", "--")
        model.save_pretrained(path, tokenizer=BertTokenizer.from_vocab(VOCAB, lowercase=lowercase))
        hub.add_dir(repo, {"main": path})

    def labelled(labels: list[str]) -> dict:
        return {"id2label": dict(enumerate(labels))}

    hub = HubServer()
    torch.manual_seed(0)
    save("google-bert/bert-base-cased", BertForPreTraining(tiny_config()), lowercase=False)
    save("deepset/bert-base-cased-squad2", BertForQuestionAnswering(tiny_config()), lowercase=False)
    ner = BertForTokenClassification(tiny_config(**labelled(NER_LABELS)))
    with torch.no_grad():  # every token a B-PER: the example's entities, whatever the random encoder says
        ner.classifier.bias[NER_LABELS.index("B-PER")] = 20.0
    save("dslim/bert-base-NER", ner, lowercase=False)
    ranker = BertForSequenceClassification(tiny_config(**labelled(["LABEL_0"])))
    with torch.no_grad():  # one score for every pair: the rerank example's order is the ranking's tie order
        ranker.classifier.weight.zero_()
    save("cross-encoder/ms-marco-MiniLM-L-6-v2", ranker, lowercase=True)
    nli = BertForSequenceClassification(tiny_config(**labelled(NLI_LABELS)))
    save("ynie/bert-large-uncased-snli_mnli_fever_anli_R1_R2_R3-nli", nli, lowercase=True)
    sparse, plain = splade_dirs(root)  # docs/retrieval.md's SPLADE models
    hub.add_dir(SPLADE_REPO, {"main": sparse})
    hub.add_dir(SPLADE_PLAIN_REPO, {"main": plain})
    real = {"dim": 128, "positions": 512, "query_length": 32, "document_length": 180}  # colbertv2.0's shapes
    for repo, layout in (("lightonai/colbertv2.0", "pylate"), ("colbert-ir/colbertv2.0", "colbert-ir")):
        hub.add_dir(repo, {"main": tiny_colbert_dir(root, layout, **real)})  # type: ignore[arg-type]
    add_dataset_repos(hub)
    return hub.start()


# -- dataset repos: stand-ins for the Hub datasets the documentation imports (their layout, cards, columns and
# ClassLabel names, the rows of examples/data), and repos for the import's other paths ---------------------

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "data"
IMDB_REPO = "stanfordnlp/imdb"  # a card with configs (plain_text: train, test, unsupervised) and ClassLabel names
CONLL_REPO = "eriktks/conll2003"  # a loading script on main, the data in refs/convert/parquet; names on the card
SQUAD_REPO = "rajpurkar/squad"  # answers as datasets has them: {text: [...], answer_start: [...]}
NLI_REPO = "sentence-transformers/all-nli"  # four subsets, none the default
NQ_REPO = "sentence-transformers/natural-questions"  # pairs under other names: query, answer
JSONL_DATASET = "acme/reviews-jsonl"  # no card: JSON Lines and CSV named by split; branches main, v2 and broken
GATED_DATASET = "acme/gated-reviews"
SCRIPT_DATASET = "acme/script-only"  # a loading script and no Parquet export
IMDB_LABELS = ["neg", "pos"]
CONLL_TAGS = ["O", "B-PER", "I-PER", "B-ORG", "I-ORG", "B-LOC", "I-LOC", "B-MISC", "I-MISC"]
PARQUET_EXPORT = "refs/convert/parquet"


def parquet_bytes(rows: list[dict], features: dict | None = None) -> bytes:
    """A Parquet file of `rows`, with `datasets`' features in its schema metadata when given."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist(rows)
    if features is not None:
        table = table.replace_schema_metadata({"huggingface": json.dumps({"info": {"features": features}})})
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    return sink.getvalue().to_pybytes()


def _card(yaml_text: str, title: str) -> bytes:
    return f"---\n{yaml_text.strip()}\n---\n\n# {title}\n".encode()


def _class_label_yaml(names: list[str], indent: int) -> str:
    pad = " " * indent
    return "".join(f"{pad}'{i}': {name}\n" for i, name in enumerate(names))


def imdb_rows() -> dict[str, list[dict]]:
    import csv

    with open(EXAMPLES / "reviews.csv", newline="") as f:
        train = [{"text": r["text"], "label": 0 if r["label"] == "negative" else 1} for r in csv.DictReader(f)]
    unlabelled = [{"text": r["text"], "label": -1} for r in train[:4]]
    return {"train": train, "test": train[:10], "unsupervised": unlabelled}


def conll_rows() -> list[dict]:
    """ner.conll's sentences, and two with CoNLL-2003's fourth type (MISC), so every one of its tags is there."""
    from model.data.token_classification import read_tagged

    tagged = [(s.tokens, s.tags) for s in read_tagged(EXAMPLES / "ner.conll")]
    tagged += [
        (["Dutch", "cheese", "sells", "well", "."], ["B-MISC", "O", "O", "O", "O"]),
        (["Anna", "won", "the", "Tour", "de", "France", "."], ["B-PER", "O", "O", "B-MISC", "I-MISC", "I-MISC", "O"]),
    ]
    return [
        {
            "id": str(i),
            "tokens": tokens,
            "pos_tags": [0] * len(tokens),
            "chunk_tags": [0] * len(tokens),
            "ner_tags": [CONLL_TAGS.index(t) for t in tags],
        }
        for i, (tokens, tags) in enumerate(tagged)
    ]


def squad_rows(path: Path) -> list[dict]:
    """The answerable questions of a SQuAD file, one row each, as rajpurkar/squad's Parquet holds them."""
    doc = json.loads(path.read_text())
    return [
        {
            "id": qa["id"],
            "title": article["title"],
            "context": paragraph["context"],
            "question": qa["question"],
            "answers": {
                "text": [a["text"] for a in qa["answers"]],
                "answer_start": [a["answer_start"] for a in qa["answers"]],
            },
        }
        for article in doc["data"]
        for paragraph in article["paragraphs"]
        for qa in paragraph["qas"]
        if qa["answers"]
    ]


def table_rows(name: str) -> list[dict]:
    import csv

    with open(EXAMPLES / name, newline="") as f:
        return list(csv.DictReader(f))


def add_dataset_repos(hub: HubServer) -> None:
    """The dataset repos above, in `hub`."""
    _add_imdb(hub)
    _add_conll(hub)
    _add_squad(hub)
    _add_nli(hub)
    nq = [{"query": r["anchor"], "answer": r["positive"]} for r in table_rows("pairs.csv")]
    nq_card = "configs:\n- config_name: pair\n  data_files:\n  - split: train\n    path: pair/train-*\n"
    files = {"README.md": _card(nq_card, "Natural Questions"), "pair/train-00000-of-00001.parquet": parquet_bytes(nq)}
    hub.add(NQ_REPO, {"main": files}, repo_type="dataset")
    _add_jsonl(hub)


def _add_imdb(hub: HubServer) -> None:
    features = {"text": {"dtype": "string", "_type": "Value"}, "label": {"names": IMDB_LABELS, "_type": "ClassLabel"}}
    card = f"""
license: other
dataset_info:
  config_name: plain_text
  features:
  - name: text
    dtype: string
  - name: label
    dtype:
      class_label:
        names:
{_class_label_yaml(IMDB_LABELS, 10)}configs:
- config_name: plain_text
  data_files:
  - split: train
    path: plain_text/train-*
  - split: test
    path: plain_text/test-*
  - split: unsupervised
    path: plain_text/unsupervised-*
  default: true
"""
    files = {"README.md": _card(card, "IMDB")}
    for split, rows in imdb_rows().items():
        files[f"plain_text/{split}-00000-of-00001.parquet"] = parquet_bytes(rows, features)
    hub.add(IMDB_REPO, {"main": files}, repo_type="dataset")


def _add_conll(hub: HubServer) -> None:
    card = f"""
license: other
dataset_info:
  config_name: conll2003
  features:
  - name: id
    dtype: string
  - name: tokens
    sequence: string
  - name: pos_tags
    sequence:
      class_label:
        names:
          '0': NN
  - name: chunk_tags
    sequence:
      class_label:
        names:
          '0': O
  - name: ner_tags
    sequence:
      class_label:
        names:
{_class_label_yaml(CONLL_TAGS, 10)}"""
    main = {"README.md": _card(card, "CoNLL-2003"), "conll2003.py": b"# a loading script: never run\n"}
    rows = conll_rows()
    export = {
        f"conll2003/{split}/0000.parquet": parquet_bytes(part)
        for split, part in (("train", rows), ("validation", rows[:6]), ("test", rows[-6:]))
    }
    hub.add(CONLL_REPO, {"main": main, PARQUET_EXPORT: export}, repo_type="dataset")


def _add_squad(hub: HubServer) -> None:
    card = """
license: cc-by-sa-4.0
dataset_info:
  config_name: plain_text
  features:
  - name: id
    dtype: string
  - name: title
    dtype: string
  - name: context
    dtype: string
  - name: question
    dtype: string
  - name: answers
    sequence:
    - name: text
      dtype: string
    - name: answer_start
      dtype: int32
configs:
- config_name: plain_text
  data_files:
  - split: train
    path: plain_text/train-*
  - split: validation
    path: plain_text/validation-*
  default: true
"""
    files = {
        "README.md": _card(card, "SQuAD"),
        "plain_text/train-00000-of-00001.parquet": parquet_bytes(squad_rows(EXAMPLES / "squad-train.json")),
        "plain_text/validation-00000-of-00001.parquet": parquet_bytes(squad_rows(EXAMPLES / "squad-dev.json")),
    }
    hub.add(SQUAD_REPO, {"main": files}, repo_type="dataset")


def _add_nli(hub: HubServer) -> None:
    triplets = table_rows("pairs.csv")
    scored = [{**r, "score": float(r["score"])} for r in table_rows("stsb.csv")]
    classes = [{"premise": r["sentence1"], "hypothesis": r["sentence2"], "label": i % 3} for i, r in enumerate(scored)]
    subsets = {
        "pair": [{"anchor": r["anchor"], "positive": r["positive"]} for r in triplets],
        "pair-class": classes,
        "pair-score": scored,
        "triplet": triplets,
    }
    card = f"""
dataset_info:
- config_name: pair-class
  features:
  - name: premise
    dtype: string
  - name: hypothesis
    dtype: string
  - name: label
    dtype:
      class_label:
        names:
{_class_label_yaml(NLI_LABELS, 10)}configs:
"""
    files = {}
    for subset, rows in subsets.items():
        card += f"- config_name: {subset}\n  data_files:\n"
        for split, part in (("train", rows), ("dev", rows[:3]), ("test", rows[-3:])):
            card += f"  - split: {split}\n    path: {subset}/{split}-*\n"
            files[f"{subset}/{split}-00000-of-00001.parquet"] = parquet_bytes(part)
    hub.add(NLI_REPO, {"main": {"README.md": _card(card, "AllNLI"), **files}}, repo_type="dataset")


def _add_jsonl(hub: HubServer) -> None:
    rows = table_rows("reviews.csv")

    def jsonl(part: list[dict]) -> bytes:
        return "".join(json.dumps(r) + "\n" for r in part).encode()

    def csv_bytes(part: list[dict]) -> bytes:
        import csv
        import io

        out = io.StringIO()
        writer = csv.DictWriter(out, fieldnames=["text", "label"])
        writer.writeheader()
        writer.writerows(part)
        return out.getvalue().encode()

    main = {"data/train.jsonl": jsonl(rows[:30]), "data/dev.csv": csv_bytes(rows[30:]), "notes.md": b"no card\n"}
    v2 = {"data/train.jsonl": jsonl(rows[:20]), "data/test.jsonl": jsonl(rows[20:])}
    broken = {"data/train.jsonl": jsonl([*rows[:3], {"text": "", "label": "positive"}, *rows[3:6]])}  # row 3
    hub.add(JSONL_DATASET, {"main": main, "v2": v2, "broken": broken}, repo_type="dataset")
    hub.add(GATED_DATASET, {"main": main}, gated=True, repo_type="dataset")
    script = {"README.md": _card("license: mit", "A script"), "loader.py": b"# never run\n"}
    hub.add(SCRIPT_DATASET, {"main": script}, repo_type="dataset")


if __name__ == "__main__":  # a docs Hub to try the pages by hand: python -m tests.hub_server DIR
    import sys
    import time

    server = docs_hub(Path(sys.argv[1]))
    print(f"HF_ENDPOINT={server.url}", flush=True)
    while True:
        time.sleep(3600)
