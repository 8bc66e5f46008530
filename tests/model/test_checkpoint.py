"""Checkpoints (model/training/checkpoint.py): layout, round trip, no pickle, and crashes mid-write — an
exception inside the atomic write and a process SIGKILLed while writing — never cost the previous one."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch

import model.training.checkpoint as ckpt
from model.config import BertConfig
from model.modeling import BertForPreTraining, load_model
from model.tokenizer import BertTokenizer
from model.training.checkpoint import (
    checkpoint_dir,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)
from model.training.trainer import TrainConfig, Trainer, configure_optimizer
from tests.conftest import TINY_VOCAB, tiny_config_dict


def trained_objects(seed=0):
    """A tiny model and an AdamW that has taken one step, so its state is not empty."""
    torch.manual_seed(seed)
    model = BertForPreTraining(BertConfig(**tiny_config_dict()))
    optimizer = configure_optimizer(model, lr=1e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (s + 1))
    ids = torch.randint(5, 40, (2, 8))
    model(ids, labels=ids, next_sentence_label=torch.tensor([0, 1])).loss.backward()
    optimizer.step()
    scheduler.step()
    return model, optimizer, scheduler


def save(run_dir, step, model, optimizer, scheduler=None, tokenizer=None):
    return save_checkpoint(
        checkpoint_dir(run_dir, step),
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        trainer_state={"step": step},
        data_state={"epoch": 1, "batch": 2},
        tokenizer=tokenizer,
    )


def test_round_trip_restores_weights_optimizer_scheduler_rng_and_positions(tmp_path, tiny_tokenizer):
    model, optimizer, scheduler = trained_objects()
    torch.manual_seed(5), np.random.seed(6), random.seed(7)
    path = save(tmp_path, 3, model, optimizer, scheduler, tiny_tokenizer)
    expected = (torch.rand(3), np.random.rand(3), random.random())

    other, other_opt, other_sched = trained_objects(seed=1)
    state = load_checkpoint(path, model=other, optimizer=other_opt, scheduler=other_sched)
    assert state == {"trainer": {"step": 3}, "data": {"epoch": 1, "batch": 2}}
    assert all(torch.equal(v, other.state_dict()[k]) for k, v in model.state_dict().items())
    a, b = optimizer.state_dict(), other_opt.state_dict()
    assert a["param_groups"] == b["param_groups"]
    assert all(torch.equal(a["state"][i][k], b["state"][i][k]) for i in a["state"] for k in a["state"][i])
    assert other_sched.state_dict() == scheduler.state_dict()
    got = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(got[0], expected[0]) and np.array_equal(got[1], expected[1]) and got[2] == expected[2]


def test_a_checkpoint_is_a_model_directory_and_holds_no_pickles(tmp_path, tiny_tokenizer):
    model, optimizer, _ = trained_objects()
    path = save(tmp_path, 1, model, optimizer, tokenizer=tiny_tokenizer)
    assert sorted(p.name for p in path.iterdir()) == [
        "COMPLETE",
        "config.json",
        "model.safetensors",
        "optimizer.safetensors",
        "rng.safetensors",
        "state.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "vocab.txt",
    ]
    loaded = load_model(path)
    assert type(loaded) is BertForPreTraining
    assert BertTokenizer.from_pretrained(path).vocab_size == len(TINY_VOCAB)
    manifest = json.loads((path / "COMPLETE").read_text())
    assert set(manifest["files"]) == {p.name for p in path.iterdir()} - {"COMPLETE"}
    # Everything but safetensors is JSON; nothing a pickle loader would be needed for.
    for p in path.iterdir():
        if p.suffix in (".json", "") and p.name != "vocab.txt":
            json.loads(p.read_text())


def test_exception_mid_write_keeps_the_previous_checkpoint_and_resume_uses_it(tmp_path, monkeypatch, tiny_tokenizer):
    model, optimizer, _ = trained_objects()
    save(tmp_path, 2, model, optimizer)

    def disk_full():
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckpt, "_rng_state", disk_full)  # model and optimizer files are already written
    with pytest.raises(OSError, match="No space left"):
        save(tmp_path, 4, model, optimizer)
    monkeypatch.undo()
    assert latest_checkpoint(tmp_path) == checkpoint_dir(tmp_path, 2)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-2"]  # temp dir removed

    other, other_opt, _ = trained_objects(seed=1)
    assert load_checkpoint(latest_checkpoint(tmp_path), model=other, optimizer=other_opt)["trainer"]["step"] == 2


def test_latest_ignores_temp_dirs_missing_markers_and_truncated_files(tmp_path):
    model, optimizer, _ = trained_objects()
    good = save(tmp_path, 2, model, optimizer)
    for step in (5, 7, 9):
        save(tmp_path, step, model, optimizer)
    os.remove(checkpoint_dir(tmp_path, 5) / "COMPLETE")  # never finished
    with open(checkpoint_dir(tmp_path, 7) / "model.safetensors", "r+b") as f:
        f.truncate(100)  # a file that does not match the manifest
    os.rename(checkpoint_dir(tmp_path, 9), tmp_path / "checkpoints" / ".tmp-step-9-abcdef12")  # not renamed into place
    assert list_checkpoints(tmp_path) == [good]
    assert latest_checkpoint(tmp_path) == good
    assert latest_checkpoint(tmp_path / "nowhere") is None


_KILLED_WRITER = textwrap.dedent("""
    import os, sys, time, torch
    sys.path.insert(0, sys.argv[2])
    import model.training.checkpoint as ckpt
    from tests.model.test_checkpoint import trained_objects, save
    run = sys.argv[1]
    model, optimizer, _ = trained_objects()
    save(run, 1, model, optimizer)
    def hang():
        open(os.path.join(run, "writing"), "w").close()  # model + optimizer files of step 2 are on disk
        time.sleep(120)
    ckpt._rng_state = hang
    torch.nn.init.zeros_(model.cls.seq_relationship.weight)
    save(run, 2, model, optimizer)
""")


@pytest.mark.slow
def test_sigkill_mid_write_leaves_the_previous_checkpoint_loadable(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED_WRITER, str(tmp_path), root], env=env, stderr=subprocess.PIPE
    )
    deadline = time.monotonic() + 60
    while not (tmp_path / "writing").exists():
        assert proc.poll() is None, proc.stderr.read().decode()
        assert time.monotonic() < deadline, "the writer never reached the middle of its second checkpoint"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    leftovers = [p for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".tmp-step-2")]
    assert leftovers and (leftovers[0] / "model.safetensors").exists()  # the half-written one
    assert latest_checkpoint(tmp_path) == checkpoint_dir(tmp_path, 1)

    expected, _, _ = trained_objects()
    other, other_opt, _ = trained_objects(seed=1)
    load_checkpoint(latest_checkpoint(tmp_path), model=other, optimizer=other_opt)
    assert all(torch.equal(v, other.state_dict()[k]) for k, v in expected.state_dict().items())
    ckpt.remove_stale_temp_dirs(tmp_path)
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-1"]


def test_trainer_resumes_from_the_last_complete_checkpoint_after_a_crashed_save(tmp_path, monkeypatch):
    """A run that crashes while saving step 4 resumes from step 2 and ends where a clean run ends."""
    from model.data.corpus import load_corpus
    from model.data.pretraining import PretrainingData

    tok = BertTokenizer.from_vocab(TINY_VOCAB)
    corpus_path = tmp_path / "pairs.tsv"
    corpus_path.write_text("the cat sat\tthe dog ran\na man eats food\tthe sky is blue\nshe reads\tit is red\n")
    corpus = load_corpus(corpus_path, tok, cache_dir=tmp_path / "cache")

    def trainer(run_dir):
        torch.manual_seed(0)
        model = BertForPreTraining(BertConfig(**tiny_config_dict()))
        data = PretrainingData(corpus, tok, batch_size=2, max_seq_len=16, seed=0)
        return Trainer(model, data, TrainConfig(max_steps=6, save_every=2, lr=1e-3), run_dir=run_dir)

    clean = trainer(tmp_path / "clean")
    clean.fit()
    real_rng_state, calls = ckpt._rng_state, []

    def crash_on_second_save():  # step 2 saves; step 4 dies after writing its model and optimizer files
        calls.append(1)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real_rng_state()

    monkeypatch.setattr(ckpt, "_rng_state", crash_on_second_save)
    with pytest.raises(OSError, match="No space left"):
        trainer(tmp_path / "crashed").fit()
    monkeypatch.undo()
    assert latest_checkpoint(tmp_path / "crashed").name == "step-2"
    resumed = trainer(tmp_path / "crashed")
    assert resumed.fit(resume=True).step == 6
    a, b = clean.model.state_dict(), resumed.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
