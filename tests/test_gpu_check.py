"""bench/gpu_check.py stays runnable: its cheap checks on the CPU (tiny configs), its isolation of a
failing check, its files; the CUDA pieces run only where torch sees a GPU."""

import json

import pytest
import torch

from bench import gpu_check
from bench.gpu_check import Context, Row

TINY = {"vocab_size": 100, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64}


def context(tmp_path, device="cpu") -> Context:
    return Context(torch.device(device), quick=True, out=tmp_path, work=tmp_path)


def test_parity_passes_on_cpu_for_the_three_classes(tmp_path):
    rows = gpu_check.check_parity(context(tmp_path), cfg=TINY, batch=3, seq=16)
    assert [r.check for r in rows] == [
        f"parity {p} {name}" for name in gpu_check.PARITY_CLASSES for p in ("fp32", "bf16")
    ]
    assert [r.verdict for r in rows] == ["PASS"] * 6, rows


def test_parity_catches_a_model_that_differs(tmp_path, monkeypatch):
    real_twin = gpu_check.twin

    def twin_with_a_nudge(name, cfg, device, seed=0):
        hf, ours = real_twin(name, cfg, device, seed)
        with torch.no_grad():
            getattr(ours, "bert", ours).encoder.layer[0].output.dense.weight.mul_(-1)
        return hf, ours

    monkeypatch.setattr(gpu_check, "twin", twin_with_a_nudge)
    rows = gpu_check.check_parity(context(tmp_path), cfg=TINY, batch=3, seq=16)
    assert {r.verdict for r in rows if "fp32" in r.check} == {"FAIL"}, rows


def test_odd_head_sizes_run_in_padded_bf16_eval(tmp_path):
    rows = gpu_check.odd_head_rows(context(tmp_path))
    assert [r.check for r in rows] == ["head_dim 25, padded batch, bf16 eval", "head_dim 512, padded batch, bf16 eval"]
    assert [r.verdict for r in rows] == ["PASS", "PASS"], rows


def test_a_failing_check_is_a_row_and_the_others_run(tmp_path, monkeypatch, capsys):
    def broken(ctx):
        raise RuntimeError("CUDA error: device-side assert | triggered")

    monkeypatch.setattr(gpu_check, "CHECKS", {"broken": broken, "fine": lambda ctx: [Row("fine", "ok", "-", "PASS")]})
    rows = [row for name in ("broken", "fine") for row in gpu_check.run_check(name, context(tmp_path))]
    assert rows == [
        Row("broken", "error: RuntimeError: CUDA error: device-side assert / triggered", "runs", "FAIL"),
        Row("fine", "ok", "-", "PASS"),
    ]


def test_main_prints_one_table_and_writes_its_files(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(gpu_check, "CHECKS", {"parity": lambda ctx: gpu_check.check_parity(ctx, cfg=TINY)})
    assert gpu_check.main(["--device", "cpu", "--quick", "--checks", "parity", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "| check | result | target | verdict |" in printed and printed.count("| PASS |") == 6
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu_check.json", "gpu_check.md"]
    record = json.loads((tmp_path / "gpu_check.json").read_text())
    assert record["quick"] is True and len(record["rows"]) == 6
    assert (tmp_path / "gpu_check.md").read_text().count("| PASS |") == 6


def test_cpu_has_no_mfu_nor_gpu_memory(tmp_path):
    assert gpu_check.peak_flops(torch.device("cpu")) is None
    assert gpu_check.memory_row(context(tmp_path)).verdict == "n/a"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_parity_on_cuda(tmp_path):
    rows = gpu_check.check_parity(context(tmp_path, "cuda"), cfg=TINY, batch=3, seq=16)
    assert [r.verdict for r in rows] == ["PASS"] * 6, rows


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_memory_is_measured_on_cuda(tmp_path):
    row = gpu_check.memory_row(context(tmp_path, "cuda"))
    assert row.verdict == "info" and "MiB" in row.result


def test_the_review_names_the_kernel_paths_it_runs_through(tmp_path):
    rows = gpu_check.kernel_rows(context(tmp_path))
    assert [r.check for r in rows] == [
        "kernel path onednn-fp32",
        "kernel path onednn-bf16",
        "kernel path int8-vnni",
        "bf16 model's kernels",
    ]
    assert all(r.result.startswith(("on: ", "off: ")) for r in rows[:3]), rows
    assert rows[3].result.startswith(("onednn-bf16", "bf16-emulated")), rows


def test_rows_are_written_as_each_check_ends(tmp_path, monkeypatch):
    """A run cut short (a call's time limit) leaves the rows of the checks it finished."""

    def second(ctx):
        record = json.loads((tmp_path / "gpu_check.json").read_text())
        assert [r["check"] for r in record["rows"]] == ["first"] and record["done"] is False
        assert "| first | ok | - | PASS |" in (tmp_path / "gpu_check.md").read_text()
        return [Row("second", "ok", "-", "PASS")]

    monkeypatch.setattr(gpu_check, "CHECKS", {"first": lambda ctx: [Row("first", "ok", "-", "PASS")], "second": second})
    assert gpu_check.main(["--device", "cpu", "--checks", "first", "second", "--out", str(tmp_path)]) == 0
    assert json.loads((tmp_path / "gpu_check.json").read_text())["done"] is True


def test_our_training_batch_is_the_trainers_layout(tmp_path):
    """Item B of the read-through: ours gets the host mask and host masked positions, as Trainer._to_device
    leaves them; transformers gets its own batch (it takes no masked_positions)."""
    hf, ours = gpu_check.pretraining_batch(2, 16, 2000, torch.device("cpu"))  # ids from 1000 (train_bench)
    assert "masked_positions" not in hf and torch.equal(ours["masked_positions"], ours["labels"] != -100)
    assert all(torch.equal(hf[k], ours[k]) for k in hf)


def test_the_fill_mask_sync_row_runs_a_pass_as_the_service_does(tmp_path, monkeypatch):
    """Its CUDA path on the CPU (pinning and the sync count faked): the pass runs and the row is named."""
    assert gpu_check.fill_mask_sync_row(context(tmp_path)).verdict == "n/a"
    ctx = context(tmp_path)
    ctx.tiny = True
    passes = []
    monkeypatch.setattr(Context, "cuda", property(lambda self: True))
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)
    monkeypatch.setattr(gpu_check, "count_syncs", lambda fn, times: [fn() for _ in range(times)] and 0)
    monkeypatch.setattr(gpu_check, "apply_precision", lambda model, p: passes.append(p) or model)
    row = gpu_check.fill_mask_sync_row(ctx)
    assert row == Row(
        "host syncs in a fill-mask pass (the service's)", "0.0 per pass (3 passes)", "<= 2 per pass", "PASS"
    )
