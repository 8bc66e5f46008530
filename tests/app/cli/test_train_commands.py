"""`bert pretrain`, `bert finetune`, `bert evaluate` (app/cli/train_commands.py over model/training/runs.py) end to
end on tiny files: run directories, metrics.jsonl, the SVG plot, resuming, and one-line user errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from app.cli import main
from model.data.corpus import load_corpus
from model.modeling import BertForPreTraining, BertForSequenceClassification, load_model
from model.tokenizer import BertTokenizer
from model.training.checkpoint import list_checkpoints
from tests.conftest import TINY_VOCAB, make_training_files
from tests.model.store_helpers import write_store

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


pytestmark = pytest.mark.slow  # subprocesses of the bert command, real training


def bert(*args):
    return subprocess.run([sys.executable, "-m", "app.cli", *map(str, args)], capture_output=True, text=True, env=ENV)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return make_training_files(tmp_path_factory.mktemp("cli"))


PRETRAIN = [
    "--config",
    "{root}/tiny.json",
    "--vocab",
    "{root}/vocab",
    "--corpus",
    "{root}/corpus.txt",
    "--batch-size",
    "4",
    "--max-seq-len",
    "32",
    "--save-every",
    "4",
    "--eval-every",
    "4",
    "--eval-fraction",
    "0.2",
    "--log-every",
    "2",
    "--lr",
    "1e-3",
    "--warmup",
    "2",
    "--eval-on-start",
    "--threads",
    "1",
]


def pretrain_args(root, out, *extra):
    return ["pretrain", *(a.format(root=root) for a in PRETRAIN), "--out", str(out), *map(str, extra)]


@pytest.fixture(scope="module")
def pretrained_run(files):
    """`bert pretrain` from scratch, as a user runs it."""
    out = files / "run"
    proc = bert(*pretrain_args(files, out, "--max-steps", 8))
    assert proc.returncode == 0, proc.stderr
    assert "done: 8 steps" in proc.stdout
    return out


def test_pretrain_writes_metrics_plot_checkpoints_and_a_loadable_model(pretrained_run):
    records = [json.loads(line) for line in (pretrained_run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["type"] == "train"]
    evals = [r for r in records if r["type"] == "eval"]
    assert [r["step"] for r in train] == [2, 4, 6, 8]
    assert {"loss", "mlm_loss", "nsp_loss", "lr", "tokens_per_s", "eta_s", "epoch"} <= train[0].keys()
    assert [r["step"] for r in evals] == [0, 4, 8]  # 0: --eval-on-start, the baseline
    assert {"mlm_loss", "mlm_accuracy", "perplexity", "nsp_accuracy"} <= evals[0].keys()

    svg = ET.parse(pretrained_run / "training.svg").getroot()
    assert svg.tag == "{http://www.w3.org/2000/svg}svg"
    assert len(svg.findall(".//{http://www.w3.org/2000/svg}polyline")) >= 3  # train loss, eval loss, accuracies

    assert [p.name for p in list_checkpoints(pretrained_run)] == ["step-4", "step-8"]
    model = load_model(pretrained_run / "model")
    assert type(model) is BertForPreTraining
    assert BertTokenizer.from_pretrained(pretrained_run / "model").vocab_size == len(TINY_VOCAB)


def test_evaluate_prints_mlm_and_nsp_metrics(pretrained_run, files):
    proc = bert(
        "evaluate",
        "--model",
        pretrained_run,
        "--data",
        files / "corpus.txt",
        "--json",
        "--batch-size",
        4,
        "--max-seq-len",
        32,
    )
    assert proc.returncode == 0, proc.stderr
    metrics = json.loads(proc.stdout)
    assert metrics["model"] == str(pretrained_run / "model")
    assert 0 <= metrics["mlm_accuracy"] <= 1 and 0 <= metrics["nsp_accuracy"] <= 1
    assert metrics["perplexity"] == pytest.approx(2.718281828 ** metrics["mlm_loss"], rel=1e-6)


def test_running_again_with_more_steps_resumes(pretrained_run, files, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(pretrain_args(files, out, "--max-steps", 8)) == 0
    assert main(pretrain_args(files, out, "--max-steps", 10)) == 0
    assert "resuming from" in capsys.readouterr().err
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 2, 4, 4, 6, 8, 8, 10, 10]  # train and eval records, each step once
    # The last two, plus step-4 if its evaluation is still the best (checkpoints and evals at 4, 8, 10).
    records = map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
    evals = {r["step"]: r["loss"] for r in records if r["type"] == "eval" and r["step"] in (4, 8, 10)}
    kept = ["step-4"] if min(evals, key=evals.get) == 4 else []
    assert [p.name for p in list_checkpoints(out)] == kept + ["step-8", "step-10"]


def test_pretrain_from_a_token_store_directory(files, tmp_path, capsys):
    tok = BertTokenizer.from_pretrained(files / "vocab")
    store = write_store(tmp_path / "store", load_corpus(files / "corpus.txt", tok, cache_dir=tmp_path), tok, [6])
    args = [a.replace(str(files / "corpus.txt"), str(store)) for a in pretrain_args(files, tmp_path / "run")]
    assert main([*args, "--max-steps", "4"]) == 0
    assert type(load_model(tmp_path / "run" / "model")) is BertForPreTraining
    evals = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if '"eval"' in x]
    assert [e["step"] for e in evals] == [0, 4]  # on the store's last documents, held out


def test_finetune_from_the_pretrained_model_then_evaluate(pretrained_run, files, tmp_path, capsys):
    out = tmp_path / "ft"
    code = main(
        [
            "finetune",
            "--from",
            str(pretrained_run / "model"),
            "--train",
            str(files / "reviews.csv"),
            "--out",
            str(out),
            "--max-steps",
            "6",
            "--eval-every",
            "3",
            "--batch-size",
            "4",
            "--max-seq-len",
            "16",
            "--lr",
            "1e-3",
            "--log-every",
            "3",
        ]
    )
    assert code == 0
    model = load_model(out / "model")
    assert type(model) is BertForSequenceClassification
    assert model.config.id2label == {0: "neg", 1: "pos"}
    evals = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"eval"' in x]
    assert [e["step"] for e in evals] == [3, 6] and {"accuracy", "macro_f1"} <= evals[0].keys()
    capsys.readouterr()
    assert main(["evaluate", "--model", str(out), "--data", str(files / "reviews.csv"), "--max-seq-len", "16"]) == 0
    printed = capsys.readouterr().out
    assert "accuracy" in printed and "macro_f1" in printed


@pytest.mark.parametrize(
    "args, message",
    [
        (["pretrain", "--corpus", "nope.txt", "--out", "x", "--config", "tiny"], "no such file or directory: nope.txt"),
        (
            ["pretrain", "--corpus", "{root}/vocab", "--out", "{out}", "--config", "tiny", "--vocab", "{root}/vocab"],
            "{root}/vocab is not a complete token store: no manifest.json (the builder writes it last)",
        ),
        (
            [
                "pretrain",
                "--corpus",
                "{root}/vocab",
                "--format",
                "google",
                "--out",
                "{out}",
                "--config",
                "tiny",
                "--vocab",
                "{root}/vocab",
            ],
            "--format google is for text corpora, but {root}/vocab is a directory (read as a token store)",
        ),
        (
            ["pretrain", "--corpus", "{root}/corpus.txt", "--out", "{out}", "--config", "tiny"],
            "--config needs --vocab DIR (a tokenizer directory; make one with `bert vocab`)",
        ),
        (
            ["pretrain", "--corpus", "{root}/corpus.txt", "--out", "{out}"],
            "say where the model comes from: --from MODEL_DIR (warm start) or --config tiny|small|base|FILE",
        ),
        (
            [
                "pretrain",
                "--corpus",
                "{root}/corpus.txt",
                "--out",
                "{out}",
                "--config",
                "{root}/tiny.json",
                "--vocab",
                "{root}/vocab",
                "--max-seq-len",
                "100",
            ],
            "--max-seq-len 100 exceeds the model's max_position_embeddings 64",
        ),
        (
            [
                "pretrain",
                "--corpus",
                "{root}/corpus.txt",
                "--out",
                "{out}",
                "--config",
                "tiny",
                "--vocab",
                "{root}/vocab",
                "--warmup",
                "abc",
            ],
            "--warmup must be a number of steps or a fraction below 1, got 'abc'",
        ),
        (
            ["finetune", "--train", "{root}/reviews.csv", "--from", "{root}/nomodel", "--out", "{out}"],
            "tokenizer directory {root}/nomodel does not exist",
        ),
        (
            [
                "finetune",
                "--train",
                "{root}/reviews.csv",
                "--from",
                "{root}/run/model",
                "--out",
                "{out}",
                "--label-column",
                "stars",
            ],
            "{root}/reviews.csv: missing column(s) ['stars']; found ['label', 'text']",
        ),
        (
            ["evaluate", "--model", "{root}", "--data", "{root}/corpus.txt"],
            "{root} has no config.json: not a model directory",
        ),
    ],
)
def test_user_errors_are_one_line_and_exit_2(pretrained_run, files, tmp_path, capsys, args, message):
    fill = {"root": files, "out": tmp_path / "out"}
    assert main([a.format(**fill) for a in args]) == 2
    err = capsys.readouterr().err
    assert err == f"bert {args[0]}: error: {message.format(**fill)}\n"


def test_no_resume_refuses_a_run_directory_with_checkpoints(pretrained_run, files, capsys):
    assert main(pretrain_args(files, pretrained_run, "--max-steps", 8, "--no-resume")) == 2
    assert capsys.readouterr().err == (
        f"bert pretrain: error: {pretrained_run} already has checkpoints "
        "(latest: step-8); resume it, or choose another output directory\n"
    )


def test_mlm_only_pretraining_makes_a_masked_lm_and_evaluates_without_nsp(files, tmp_path, capsys):
    from model.modeling import BertForMaskedLM

    out = tmp_path / "mlm"
    assert main(pretrain_args(files, out, "--max-steps", 2, "--no-nsp")) == 0
    assert type(load_model(out / "model")) is BertForMaskedLM
    capsys.readouterr()
    assert (
        main(["evaluate", "--model", str(out), "--data", str(files / "corpus.txt"), "--json", "--max-seq-len", "32"])
        == 0
    )
    metrics = json.loads(capsys.readouterr().out)
    assert "mlm_accuracy" in metrics and "nsp_accuracy" not in metrics


def test_freeze_encoder_needs_a_warm_start(files, tmp_path, capsys):
    assert main(pretrain_args(files, tmp_path / "x", "--freeze-encoder")) == 2
    assert "--freeze-encoder needs --from MODEL_DIR" in capsys.readouterr().err
