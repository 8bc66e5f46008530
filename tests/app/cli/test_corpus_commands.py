"""`bert corpus build` as a user runs it (a subprocess): the summary, the errors, and a build killed with
SIGKILL midway that a rerun finishes into exactly the store an uninterrupted build writes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from model.data.corpus_build import BuildOptions, build_store
from model.tokenizer import BertTokenizer
from tests.conftest import TINY_VOCAB
from tests.model.test_corpus_build import manifest_without_time, paragraphs, read_store, store_files, write_inputs

pytestmark = pytest.mark.slow  # the bert command in subprocesses


def bert(*args, check=True):
    proc = subprocess.run([sys.executable, "-m", "app.cli", *map(str, args)], capture_output=True, text=True)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


@pytest.fixture
def vocab_dir(tmp_path):
    path = tmp_path / "vocab"
    path.mkdir()
    BertTokenizer.from_vocab(TINY_VOCAB).save_pretrained(path)
    return path


def test_build_prints_a_summary_and_writes_a_store(tmp_path, vocab_dir):
    inputs = write_inputs(tmp_path / "in")
    out = bert(
        "corpus",
        "build",
        inputs / "a_text.txt",
        str(inputs / "*.gz"),
        "--tokenizer",
        vocab_dir,
        "--out",
        tmp_path / "store",
        "--shard-tokens",
        400,
    ).stdout
    manifest, documents = read_store(tmp_path / "store")
    assert [Path(s["path"]).name for s in manifest["sources"]] == ["a_text.txt", "b_google.txt.gz"]
    assert out.startswith(f"{tmp_path / 'store'}: {len(manifest['shards'])} shards, {len(documents)} documents, ")
    assert out.rstrip().endswith("dropped 0 duplicate paragraphs, 0 near-empty and 0 non-text sentences")


def test_errors_are_one_line_and_status_2(tmp_path, vocab_dir):
    proc = bert(
        "corpus", "build", tmp_path / "missing.txt", "--tokenizer", vocab_dir, "--out", tmp_path / "s", check=False
    )
    assert (proc.returncode, proc.stderr) == (2, f"bert corpus: error: input not found: {tmp_path / 'missing.txt'}\n")
    proc = bert("corpus", "build", vocab_dir, "--tokenizer", tmp_path, "--out", tmp_path / "s", check=False)
    assert (proc.returncode, proc.stderr) == (2, f"bert corpus: error: no tokenizer.json or vocab.txt in {tmp_path}\n")


def test_kill_9_midway_then_rerun_gives_the_uninterrupted_store(tmp_path, vocab_dir):
    inputs = write_inputs(tmp_path / "in")
    for i in range(12):
        (inputs / f"g_{i:02d}.txt").write_text("\n\n".join(paragraphs(100 + i, 2500)) + "\n")
    options = ["--shard-tokens", 20000, "--unit-mb", 0.25, "--workers", 2]
    cmd = [
        sys.executable,
        "-m",
        "app.cli",
        "corpus",
        "build",
        inputs,
        "--tokenizer",
        vocab_dir,
        "--out",
        tmp_path / "killed",
        *options,
    ]
    proc = subprocess.Popen(
        list(map(str, cmd)), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    done = tmp_path / "killed" / ".build"
    deadline = time.monotonic() + 120
    while len(list(done.glob("*.done.json"))) < 3 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # the command and its worker processes, as a machine crash would
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the build finished before it could be killed"
    assert not (tmp_path / "killed" / "manifest.json").exists()
    first = (tmp_path / "killed" / "shard-00000.tokens.npy").stat()

    bert(*cmd[3:])
    kept = (tmp_path / "killed" / "shard-00000.tokens.npy").stat()
    assert (kept.st_ino, kept.st_mtime_ns) == (first.st_ino, first.st_mtime_ns)  # resumed, not rebuilt
    tokenizer = BertTokenizer.from_pretrained(vocab_dir)
    build_store(
        [inputs], tokenizer, tmp_path / "whole", options=BuildOptions(shard_tokens=20000, unit_bytes=int(0.25 * 2**20))
    )
    assert store_files(tmp_path / "killed") == store_files(tmp_path / "whole")
    assert manifest_without_time(tmp_path / "killed") == manifest_without_time(tmp_path / "whole")
    assert len(json.loads((tmp_path / "whole" / "manifest.json").read_text())["shards"]) > 6
