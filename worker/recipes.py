"""From a job record to a run spec of model/training/runs.py, and the run itself.

The worker runs the same code as `bert pretrain` / `bert finetune` (model/training/runs.py); only the
callbacks differ. This module translates the record the API validated into a PretrainSpec or
FinetuneSpec whose run directory is the job directory, so checkpoints land in
DATA_DIR/jobs/<id>/checkpoints/ and a second attempt resumes from the latest complete one.

Pretraining from scratch also needs a vocabulary and a config file: the vocabulary is learnt from the
corpus on the first attempt and kept in the job directory (a resumed attempt reuses it, so token
ids never change under a checkpoint), and params["config"] is written next to it as config.json.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from datadir import DataDir, dataset_file, model_dir_for
from datadir.files import atomic_dir, atomic_write_bytes
from model.data.corpus import read_documents
from model.errors import UserError
from model.options import job_keys
from model.tokenizer import BertTokenizer
from model.training.callbacks import Callback
from model.training.runs import FinetuneSpec, PretrainSpec, run_finetuning, run_pretraining
from model.training.trainer import TrainResult

TOKENIZER_DIR = "tokenizer"  # DATA_DIR/jobs/<id>/tokenizer: a from-scratch run's vocabulary
SCRATCH_CONFIG = "scratch_config.json"

# Job params passed through unchanged (model/options.py's job options): TrainConfig fields, and each
# kind's spec fields. A job stores only the params its request set, so the specs' defaults apply to the
# rest, as they do for `bert pretrain` / `bert finetune`.
TRAIN_KEYS = tuple(dict.fromkeys(job_keys("pretrain", trainer=True) + job_keys("finetune", trainer=True)))
SPEC_KEYS = {kind: job_keys(kind, trainer=False) for kind in ("pretrain", "finetune")}


def train_overrides(params: dict, device: str) -> dict:
    return {**_pick(params, TRAIN_KEYS), "device": device}


def spec_params(params: dict, kind: str) -> dict:
    return _pick(params, SPEC_KEYS[kind])


def _pick(params: dict, keys: Sequence[str]) -> dict:
    """The params the job set among `keys` (a null it set is kept: it can mean "use the other option")."""
    return {k: params[k] for k in keys if k in params}


def pretrain_spec(
    record: Mapping[str, Any], data_dir: Path, job_dir: Path, device: str, callbacks: Sequence[Callback] = ()
) -> PretrainSpec:
    p = record["params"]
    corpus, meta = dataset_file(data_dir, record["dataset"])
    spec = dict(
        corpus=str(corpus),
        out=str(job_dir),
        corpus_format=meta.get("format"),
        **spec_params(p, "pretrain"),
        train=train_overrides(p, device),
    )
    if record.get("base_model"):
        spec["from_model"] = str(base_model_dir(data_dir, record["base_model"]))
    else:
        spec["vocab"] = str(corpus_tokenizer(job_dir / TOKENIZER_DIR, corpus, meta, p, callbacks))
        config = job_dir / SCRATCH_CONFIG
        atomic_write_bytes(config, json.dumps(p["config"], indent=1).encode())
        spec["config"] = str(config)
    return PretrainSpec.from_dict(spec)


def finetune_spec(record: Mapping[str, Any], data_dir: Path, job_dir: Path, device: str) -> FinetuneSpec:
    p = record["params"]
    table, _ = dataset_file(data_dir, record["dataset"])
    eval_file = dataset_file(data_dir, record["eval_dataset"])[0] if record.get("eval_dataset") else None
    spec = dict(
        train_file=str(table),
        eval_file=str(eval_file) if eval_file is not None else None,
        from_model=str(base_model_dir(data_dir, record["base_model"])),
        out=str(job_dir),
        **spec_params(p, "finetune"),
        train=train_overrides(p, device),
    )
    if p.get("retriever_model"):  # a model's name in the job, its directory in the run
        spec["retriever_model"] = str(retriever_dir(data_dir, p["retriever_model"]))
    if p.get("teacher_model"):  # the same for a late-interaction job's teacher
        spec["teacher_model"] = str(retriever_dir(data_dir, p["teacher_model"], "teacher_model"))
    return FinetuneSpec.from_dict(spec)


def base_model_dir(data_dir: Path, name: str) -> Path:
    """The directory of the base model's promoted version (datadir.versions)."""
    found = model_dir_for(data_dir, name)
    if found is None:
        raise FileNotFoundError(f"base model '{name}' not found in {DataDir(data_dir).models}")
    return found


def retriever_dir(data_dir: Path, name: str, field: str = "retriever_model") -> Path:
    """The directory of a cross-encoder job's first-stage model (or a late-interaction job's teacher_model); a
    UserError (the job fails before its first step) when it is gone: the API checked it at submission, and refuses
    to delete it while the job waits."""
    found = model_dir_for(data_dir, name)
    if found is None:
        needs = (
            "the reranking evaluation needs it as its first stage"
            if field == "retriever_model"
            else ("the distillation needs its scores")
        )
        raise UserError(
            f"{field}: model '{name}' is no longer in {DataDir(data_dir).models}; {needs} "
            "(restart the job once it is back)"
        )
    return found


def prepare(record: Mapping[str, Any], data_dir: Path, job_dir: Path) -> None:
    """What a run writes into the job directory before it trains (a from-scratch run's vocabulary and
    config), done once here before a data-parallel job's ranks start, so they do not race to write it."""
    if record["kind"] == "pretrain":
        pretrain_spec(record, Path(data_dir), Path(job_dir), "cpu")


def run(
    record: Mapping[str, Any], data_dir: Path, job_dir: Path, device: str, callbacks: Sequence[Callback]
) -> TrainResult:
    """Train (or resume) the job in `job_dir`; raises model.errors.UserError for bad data or options."""
    if record["kind"] == "pretrain":
        return run_pretraining(pretrain_spec(record, Path(data_dir), Path(job_dir), device, callbacks), callbacks)
    if record["kind"] == "finetune":
        return run_finetuning(finetune_spec(record, Path(data_dir), Path(job_dir), device), callbacks)
    raise ValueError(f"unknown job kind {record['kind']!r}")


def corpus_tokenizer(out: Path, corpus: Path, meta: dict, params: dict, callbacks: Sequence[Callback] = ()) -> Path:
    """The job's own WordPiece vocabulary: learnt from the corpus on the first attempt, then reused."""
    if (out / "vocab.txt").is_file():
        return out
    for cb in callbacks:
        cb.on_prepare("learning the vocabulary")
    with atomic_dir(out) as tmp:
        text = tmp / "corpus.txt"  # plain text for the WordPiece trainer (a JSONL corpus is not)
        with open(text, "w", encoding="utf-8") as f:
            for document in read_documents(corpus, meta.get("format")):
                f.write("\n".join(document) + "\n\n")
        tokenizer = BertTokenizer.train([text], vocab_size=params["vocab_size"], lowercase=params["lowercase"])
        text.unlink()
        tokenizer.save_pretrained(tmp)
    return out
