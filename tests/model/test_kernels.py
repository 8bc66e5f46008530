"""model/compute/kernels.py: each fast path is chosen from what torch reports, confirmed by a probe, switched off
(with one warning) when it raises or disagrees, and the plain path then gives the same answers. Every
kind of CPU is covered on this one: the probes and ops are made to fail as they do elsewhere
(tests/cpu_kinds.py), and child processes run with ATen and oneDNN held to lesser instruction sets."""

from __future__ import annotations

import logging
import textwrap

import pytest
import torch
import torch.nn.functional as F

from model.compute import kernels, onednn
from model.compute.kernels import CpuInfo
from model.compute.precision import apply_precision
from model.config import BertConfig
from model.modeling import BertForMaskedLM, BertModel
from tests.conftest import tiny_config_dict
from tests.cpu_kinds import AVX2_BF16_ERROR, RaisingOnBf16, pretend_avx2, run_as


def model_and_batch(cls=BertModel, seed=0):
    torch.manual_seed(seed)
    model = cls(BertConfig(**tiny_config_dict(hidden_size=64, intermediate_size=128))).eval()
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, model.config.vocab_size, (3, 10), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    return model, ids, mask


def hidden(model, ids, mask) -> torch.Tensor:
    with torch.inference_mode():
        out = model(ids, mask)
    return (out.last_hidden_state if hasattr(out, "last_hidden_state") else out.logits).float()[mask.bool()]


def plain_fp32(model, ids, mask) -> torch.Tensor:
    """The model with every fast path off: F.linear, no oneDNN."""
    old = onednn.use_onednn(False)
    try:
        return hidden(model, ids, mask)
    finally:
        onednn.use_onednn(old)


@pytest.fixture
def every_size(monkeypatch):
    """oneDNN for every matmul, however small (tiny models normally fall under its threshold)."""
    monkeypatch.setattr(onednn, "_MIN_MACS", 0)


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "bertserve.kernels" and r.levelno == logging.WARNING]


# -- asked ------------------------------------------------------------------------------------


def test_the_cpu_is_what_torch_reports():
    info = kernels.cpu()
    assert info.capability == torch.backends.cpu.get_cpu_capability()
    assert info.mkldnn_bf16 == torch.ops.mkldnn._is_mkldnn_bf16_supported()
    caps = torch.cpu.get_capabilities()
    assert info.flags == {f for f in (*kernels.BF16_FLAGS, *kernels.VNNI_FLAGS, "avx2") if caps.get(f)}
    assert info.summary().startswith(f"cpu {info.capability}, ")


def test_onednn_isa_limit_and_the_flags_decide_bf16_and_vnni():
    def cpu_with(flags, limit=None, mkldnn_bf16=True):
        return CpuInfo("x", "AVX512", frozenset(flags), limit, mkldnn_bf16, 2)

    zen4 = {"avx2", "avx512_bf16", "avx512_vnni"}
    assert cpu_with(zen4).bf16_native and cpu_with(zen4).vnni
    assert cpu_with(zen4).summary() == "cpu AVX512, native bf16, VNNI"
    held = cpu_with(zen4, "AVX512_CORE")  # oneDNN told to stay below bf16 and VNNI
    assert not held.bf16_native and not held.vnni and held.onednn_allows("AVX2")
    assert held.summary() == "cpu AVX512, no native bf16, no VNNI, ONEDNN_MAX_CPU_ISA=AVX512_CORE"
    assert not cpu_with(zen4, "SSE41").onednn_allows("AVX2")
    assert cpu_with(zen4, "SOMETHING_NEW").onednn_allows("AVX512_CORE_AMX")  # unknown: no limit
    assert not cpu_with(zen4, mkldnn_bf16=False).bf16_native  # oneDNN says no: not native to us
    assert not cpu_with({"avx2"}).bf16_native and not cpu_with({"avx2"}).vnni
    assert cpu_with({"avx2", "avx_vnni"}).vnni and not cpu_with({"avx2", "avx_vnni"}, "AVX2").vnni


def test_a_path_the_machine_lacks_is_off_without_a_probe(kernel_paths, monkeypatch, caplog):
    ran = []
    monkeypatch.setattr(kernels.PATHS["int8-vnni"], "needs", lambda: "no VNNI: slower")
    monkeypatch.setattr(kernels.PATHS["int8-vnni"], "probe", lambda: ran.append(1))
    monkeypatch.setattr(kernels.PATHS["int8-vnni"], "decided", None)
    assert kernels.status("int8-vnni") == (False, "no VNNI: slower") and ran == []
    assert warnings_of(caplog) == []  # what the machine lacks is no surprise: the summary says it


# -- confirmed ---------------------------------------------------------------------------------


@pytest.mark.parametrize("broken", ["raises", "disagrees"])
def test_a_probe_that_fails_turns_the_path_off_with_one_warning(kernel_paths, every_size, monkeypatch, caplog, broken):
    real = torch.ops.mkldnn._linear_pointwise
    for name in kernels.PATHS:  # the other paths decided first, on the real op: only onednn-fp32 sees the bad one
        if name != "onednn-fp32":
            kernels.status(name)
    caplog.clear()

    def bad(*args):
        if broken == "raises":
            raise RuntimeError("could not create a primitive descriptor")
        return real(*args) + 1

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", bad)
    monkeypatch.setattr(kernels.PATHS["onednn-fp32"], "needs", lambda: None)  # as a machine that has it
    monkeypatch.setattr(kernels.PATHS["onednn-fp32"], "decided", None)
    model, ids, mask = model_and_batch()
    out = hidden(model, ids, mask)
    on, why = kernels.status("onednn-fp32")
    assert not on and why.startswith("its probe failed: ")
    assert ("RuntimeError: could not create" if broken == "raises" else "disagrees with plain torch") in why
    assert warnings_of(caplog) == [f"kernel path onednn-fp32 is off for this process: {why}"]
    torch.testing.assert_close(out, plain_fp32(model, ids, mask), atol=1e-6, rtol=0)
    hidden(model, ids, mask)
    assert len(warnings_of(caplog)) == 1


@pytest.mark.skipif(not onednn.available(), reason="no oneDNN fp32 path on this machine")
def test_a_kernel_that_raises_on_a_real_call_is_switched_off_and_that_call_answered(
    kernel_paths, every_size, monkeypatch, caplog
):
    model, ids, mask = model_and_batch(BertForMaskedLM)
    assert kernels.enabled("onednn-fp32")  # decided (its probe passed) before the op goes bad

    def raising(*args):
        raise RuntimeError("oneDNN: unsupported shape")

    raising.binary = raising
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", raising)
    out = hidden(model, ids, mask)  # the call that hits it is answered, through F.linear
    assert kernels.status("onednn-fp32") == (False, "raised RuntimeError: oneDNN: unsupported shape")
    assert warnings_of(caplog) == [
        "kernel path onednn-fp32 is off for this process: it raised RuntimeError: "
        "oneDNN: unsupported shape; the plain path answers instead"
    ]
    torch.testing.assert_close(out, plain_fp32(model, ids, mask), atol=1e-6, rtol=0)


def test_bad_inputs_are_the_callers_error_not_the_kernels(kernel_paths, every_size):
    layer = torch.nn.Linear(8, 4)
    with torch.inference_mode(), pytest.raises(RuntimeError):
        onednn.dense(layer, torch.randn(2, 5))  # wrong width: F.linear raises too
    assert not kernels.PATHS["onednn-fp32"].why.startswith("raised")  # not switched off for it
    assert kernels.enabled("onednn-fp32") == (kernels.PATHS["onednn-fp32"].needs() is None)


# -- every fallback gives the same answers ------------------------------------------------------


def test_bf16_without_bf16_kernels_is_emulated_close_to_fp32(kernel_paths, every_size, monkeypatch, caplog):
    pretend_avx2(monkeypatch.setattr)
    model, ids, mask = model_and_batch(BertForMaskedLM)
    ref = plain_fp32(model, ids, mask)
    bf16 = apply_precision(model, "bf16")
    out = hidden(bf16, ids, mask)
    assert kernels.status("onednn-bf16") == (False, "oneDNN has no bf16 kernels for this CPU")
    assert out.dtype == torch.float32 and F.cosine_similarity(out, ref).min() > 0.99
    top2 = ref.topk(2).values
    clear = top2[:, 0] - top2[:, 1] > 0.05  # random weights: some top-1s are near ties that bf16 may swap
    assert clear.sum() >= 10 and torch.equal(out.argmax(-1)[clear], ref.argmax(-1)[clear])
    plan = kernels.describe("bf16")
    assert plan == {
        "kernels": "bf16-emulated (onednn-fp32)" if onednn.available() else "bf16-emulated (torch-fp32)",
        "why": "cpu AVX2, no native bf16, no VNNI: bf16 weights, GEMMs in fp32, emulated and slower than fp32",
    }
    assert warnings_of(caplog) == []  # the machine lacks it: no probe ran, no surprise to report
    kernels.warn_if_emulated("bf16")
    kernels.warn_if_emulated("bf16")
    assert warnings_of(caplog) == [f"bf16 is emulated on this machine, and slower than fp32: {plan['why']}"]


def test_bf16_kernels_that_claim_support_but_raise_fall_back(kernel_paths, every_size, monkeypatch, caplog):
    """torch says oneDNN has bf16, but its ops raise (the failure this module was written for)."""
    for name in ("_linear_pointwise", "_reorder_linear_weight"):
        monkeypatch.setattr(torch.ops.mkldnn, name, RaisingOnBf16(getattr(torch.ops.mkldnn, name)))
    monkeypatch.setattr(kernels.PATHS["onednn-bf16"], "needs", lambda: None)
    monkeypatch.setattr(kernels.PATHS["onednn-bf16"], "decided", None)
    model, ids, mask = model_and_batch()
    ref = plain_fp32(model, ids, mask)
    out = hidden(apply_precision(model, "bf16"), ids, mask)
    assert kernels.status("onednn-bf16") == (False, f"its probe failed: RuntimeError: {AVX2_BF16_ERROR}")
    assert F.cosine_similarity(out, ref).min() > 0.99
    assert kernels.describe("bf16")["why"].endswith(
        f"; onednn-bf16 off: its probe failed: RuntimeError: {AVX2_BF16_ERROR}"
    )
    assert len(warnings_of(caplog)) == 1


def test_int8_is_the_same_with_and_without_int8_dot_products(kernel_paths, monkeypatch, caplog):
    model, ids, mask = model_and_batch()
    int8 = apply_precision(model, "int8")
    kernels.override("int8-vnni", False)
    emulated = hidden(int8, ids, mask)
    kernels.override("int8-vnni", True)  # torch._int_mm, whatever the CPU (only slow without VNNI)
    exact = hidden(int8, ids, mask)
    torch.testing.assert_close(emulated, exact, atol=1e-5, rtol=1e-5)

    def raising(*args):
        raise RuntimeError("_int_mm: not implemented for this CPU")

    monkeypatch.setattr(torch, "_int_mm", raising)
    torch.testing.assert_close(hidden(int8, ids, mask), exact, atol=1e-5, rtol=1e-5)
    assert kernels.status("int8-vnni") == (False, "raised RuntimeError: _int_mm: not implemented for this CPU")


_CHILD = textwrap.dedent("""
    import json, torch
    from model.compute import kernels, onednn
    from model.config import BertConfig
    from model.modeling import BertModel
    from model.compute.precision import apply_precision
    onednn._MIN_MACS = 0  # oneDNN for the small model too, wherever it runs
    torch.manual_seed(0)
    config = BertConfig(vocab_size=200, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, max_position_embeddings=64)
    ids = torch.randint(5, 200, (3, 24), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[2, 10:] = 0
    out = {"capability": torch.backends.cpu.get_cpu_capability()}
    for precision in ("fp32", "bf16", "int8"):
        torch.manual_seed(0)
        model = apply_precision(BertModel(config).eval(), precision)
        with torch.inference_mode():
            out[precision] = model(ids, mask).last_hidden_state[mask.bool()].tolist()
        out[precision + " kernels"] = kernels.describe(precision)["kernels"]
    print(json.dumps(out))
""")


def run_child(**env: str) -> dict:
    return run_as(_CHILD, **env)


@pytest.mark.slow
def test_lesser_instruction_sets_give_the_same_answers():
    """ATEN_CPU_CAPABILITY and ONEDNN_MAX_CPU_ISA hold torch and oneDNN to what older CPUs have."""
    default = run_child()
    lesser = {
        "avx2": run_child(ATEN_CPU_CAPABILITY="avx2"),
        "sse41": run_child(ATEN_CPU_CAPABILITY="default", ONEDNN_MAX_CPU_ISA="SSE41"),
    }
    assert lesser["sse41"]["capability"] == "DEFAULT"
    assert lesser["sse41"]["fp32 kernels"] == "torch-fp32"  # oneDNN held below AVX2 does not pay
    assert lesser["sse41"]["bf16 kernels"] == "bf16-emulated (torch-fp32)"
    assert lesser["sse41"]["int8 kernels"] == "int8-emulated (torch-fp32)"
    for name, run in lesser.items():
        for precision, atol in (("fp32", 1e-4), ("bf16", 0.1), ("int8", 0.1)):
            got, want = torch.tensor(run[precision]), torch.tensor(default[precision])
            torch.testing.assert_close(got, want, atol=atol, rtol=0, msg=f"{name} {precision}")
            assert F.cosine_similarity(got, want).min() > 0.99, (name, precision)
