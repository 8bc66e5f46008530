"""auto's measured choice (model/precision_choice.py): the kind of CPU and what it runs natively on every kind
(CpuInfo as each reports it, and this machine held down by ATEN_CPU_CAPABILITY / ONEDNN_MAX_CPU_ISA in a child),
each output's measurement against a direct computation, the choice within the bounds and its reasons, and the
card's table that write_card keeps. Speeds come from a fake clock: they are shown, never asserted."""

from __future__ import annotations

import itertools
import textwrap

import pytest
import torch

from datadir.cards import read_card
from model import precision_choice
from model.compute.kernels import CpuInfo
from model.config import BertConfig
from model.model_card import SET_NAME, precision_inputs, write_card
from model.modeling import (
    BertForMaskedLM,
    BertForPreTraining,
    BertForQuestionAnswering,
    BertForSequenceClassification,
    BertForTokenClassification,
    BertModel,
)
from model.precision_choice import Bounds, choose, cpu_kind, measure, native_precisions, outputs_of
from model.tokenizer import BertTokenizer
from tests.conftest import MINILM_DIR, tiny_config_dict
from tests.cpu_kinds import run_as

AMX = {"avx2", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8"}


def ticking():
    """A clock that advances one second per reading: every timed pass takes 1 s, every speed is 1.0."""
    return itertools.count().__next__


def cpu(capability="AVX512", flags=AMX, limit=None, mkldnn_bf16=True):
    return CpuInfo("x", capability, frozenset(flags), limit, mkldnn_bf16, 2)


@pytest.mark.parametrize(
    "info, kind, native",
    [
        (cpu(), "avx512 bf16 vnni amx", ["fp32", "bf16", "int8"]),  # Sapphire Rapids and later
        (cpu(flags={"avx2", "avx512_bf16", "avx512_vnni"}), "avx512 bf16 vnni", ["fp32", "bf16", "int8"]),  # Zen 4
        (cpu(flags={"avx2", "avx512_vnni"}), "avx512 vnni", ["fp32", "int8"]),  # Cascade Lake
        (cpu(limit="AVX512_CORE_BF16"), "avx512 bf16 vnni", ["fp32", "bf16", "int8"]),  # AMX held off
        (cpu(limit="AVX512_CORE_VNNI"), "avx512 vnni", ["fp32", "int8"]),
        (cpu("AVX2", {"avx2", "avx_vnni"}, mkldnn_bf16=False), "avx2 vnni", ["fp32", "int8"]),  # Alder Lake
        (cpu("AVX2", {"avx2"}, mkldnn_bf16=False), "avx2", ["fp32"]),  # an AVX2 EPYC
        (cpu("DEFAULT", set(), mkldnn_bf16=False), "default", ["fp32"]),
    ],
)
def test_every_kind_of_cpu_has_its_key_and_native_precisions(info, kind, native):
    assert cpu_kind(info).split(" ", 1)[1] == kind
    assert native_precisions(info) == native


_CHILD = textwrap.dedent("""
    import json, torch
    from model.config import BertConfig
    from model.modeling import BertModel
    from model.precision_choice import cpu_kind, measure, native_precisions
    from tests.conftest import tiny_config_dict
    ids = torch.randint(5, 40, (4, 12), generator=torch.Generator().manual_seed(0))
    texts = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "token_type_ids": torch.zeros_like(ids)}
    def load():
        torch.manual_seed(0)
        return BertModel(BertConfig(**tiny_config_dict())).eval()
    row = measure(load, {"texts": texts}, native_precisions())
    print(json.dumps({"kind": cpu_kind(), "native": native_precisions(), "measured": list(row["precisions"])}))
""")


def run_child(**env: str) -> dict:
    return run_as(_CHILD, **env)


@pytest.mark.slow
def test_a_cpu_held_down_measures_only_what_it_runs_natively():
    """This machine as an older CPU: the key and the precisions measured follow what torch and oneDNN are allowed."""
    here = run_child()
    assert here["measured"] == here["native"] == native_precisions()
    held = run_child(ONEDNN_MAX_CPU_ISA="AVX2")  # no bf16, no VNNI for oneDNN
    assert held["native"] == held["measured"] == ["fp32"]
    assert held["kind"] == cpu_kind().split(" ")[0] + " " + torch.backends.cpu.get_cpu_capability().lower()
    avx2 = run_child(ATEN_CPU_CAPABILITY="avx2", ONEDNN_MAX_CPU_ISA="AVX2")
    assert avx2["kind"].split(" ")[1] == "avx2" and avx2["measured"] == ["fp32"]


# ---------------------------------------------------------------------------- measuring


@pytest.fixture(scope="module")
def tokenizer():
    return BertTokenizer.from_pretrained(MINILM_DIR)


@pytest.fixture(scope="module")
def inputs(tokenizer):
    return precision_inputs(tokenizer, 32, 64)  # the tiny config's 64 positions


def loader(cls, tokenizer, **config):
    def load():
        torch.manual_seed(0)
        return cls(BertConfig(**tiny_config_dict(vocab_size=tokenizer.vocab_size, **config))).eval()

    return load


@pytest.mark.parametrize(
    "cls, config, outputs",
    [
        (BertModel, {}, ["embeddings"]),
        (BertForSequenceClassification, {"id2label": {0: "a", 1: "b", 2: "c"}}, ["embeddings", "classification"]),
        (BertForSequenceClassification, {"id2label": {0: "score"}}, ["embeddings", "reranking"]),  # a cross-encoder
        (BertForTokenClassification, {"id2label": dict(enumerate("abcde"))}, ["embeddings", "token_labels"]),
        (BertForQuestionAnswering, {}, ["embeddings", "qa"]),
        (BertForMaskedLM, {}, ["embeddings", "fill_mask"]),
        (BertForPreTraining, {}, ["embeddings", "fill_mask", "nsp"]),
    ],
)
def test_each_output_of_the_heads_is_measured_against_fp32(tokenizer, inputs, cls, config, outputs):
    load = loader(cls, tokenizer, **config)
    assert outputs_of(load()) == outputs
    row = measure(load, inputs, ["fp32", "bf16", "int8"], clock=ticking())
    assert row["outputs"] == outputs and list(row["precisions"]) == ["fp32", "bf16", "int8"]
    assert row["precisions"]["fp32"] == {"speed": 1.0}
    for precision in ("bf16", "int8"):
        scores = row["precisions"][precision]
        assert scores["speed"] == scores["speed_short"] == scores["speed_long"] == 1.0
        assert set(scores) == {"speed", "speed_short", "speed_long", *outputs}
        values = [v for output in outputs for v in scores[output].values()]
        assert all(0.0 <= v <= 1.0 + 1e-6 for v in values), scores
        assert 0.9 < scores["embeddings"]["min_cosine"] <= scores["embeddings"]["mean_cosine"]


def test_the_scores_match_a_direct_computation(tokenizer, inputs):
    load = loader(BertForMaskedLM, tokenizer)
    row = measure(load, inputs, ["bf16"], clock=ticking())
    with torch.no_grad():
        ref, low = load(), precision_choice.apply_precision(load(), "bf16")
        mask = inputs["texts"]["attention_mask"].unsqueeze(-1)
        pooled = [(m.bert(**inputs["texts"]).last_hidden_state.float() * mask).sum(1) / mask.sum(1) for m in (ref, low)]
        cosine = torch.nn.functional.cosine_similarity(*pooled)
        top = [m(**inputs["masked"]).logits.topk(5).indices.tolist() for m in (ref, low)]
    overlap = sum(len(set(a) & set(b)) / 5 for a, b in zip(*top)) / len(top[0])
    bf16 = row["precisions"]["bf16"]
    assert bf16["embeddings"] == {
        "min_cosine": round(float(cosine.min()), 6),
        "mean_cosine": round(float(cosine.mean()), 6),
    }
    assert bf16["fill_mask"] == {"top5_overlap": round(overlap, 6)}


def test_the_long_texts_are_full_rows_of_held_out_text(tokenizer, inputs):
    long = inputs["long"]
    assert long["input_ids"].shape == (precision_choice.LONG_ROWS, 64)  # 64: the positions the fixture allows
    assert bool(long["attention_mask"].all())  # no padding: every row is text to its last token
    assert (long["input_ids"][:, 0] == tokenizer.cls_token_id).all()
    assert len({tuple(r) for r in long["input_ids"].tolist()}) == precision_choice.LONG_ROWS
    assert precision_inputs(tokenizer, 32)["long"]["input_ids"].shape[1] == precision_choice.LONG_TOKENS


def test_the_speed_that_orders_a_precision_is_its_slower_one(tokenizer, inputs, monkeypatch):
    """A precision faster than fp32 on short texts but slower on long ones (int8 on AVX-512 against bf16, as the
    module docstring says) counts at its long-text speed, so auto does not serve it."""
    long_width = inputs["long"]["input_ids"].shape[1]

    def turns(fp32, model, batch, repeats, clock):  # (fp32's seconds, the other's): twice as fast short, half long
        return (1.0, 2.0) if batch["input_ids"].shape[1] == long_width else (1.0, 0.5)

    assert inputs["texts"]["input_ids"].shape[1] != long_width
    monkeypatch.setattr(precision_choice, "_time_in_turns", turns)
    row = measure(loader(BertModel, tokenizer), inputs, ["fp32", "int8"])
    assert {k: v for k, v in row["precisions"]["int8"].items() if k.startswith("speed")} == {
        "speed": 0.5,
        "speed_short": 2.0,
        "speed_long": 0.5,
    }
    assert choose(row, Bounds(cosine=0.9)) == ("fp32", "int8 keeps every bound but ran 0.5× fp32")


def test_reranking_counts_the_candidate_pairs_ordered_alike():
    scores = torch.arange(10.0).repeat(4, 1)  # (Q, C): four queries, ten candidates in order
    assert precision_choice._compare("reranking", scores, scores.clone()) == {"agreement": 1.0}
    swapped = scores.clone()
    swapped[0, [3, 4]] = swapped[0, [4, 3]]  # one adjacent pair of one query's 45 changes its order
    assert precision_choice._compare("reranking", scores, swapped) == {"agreement": round(1 - 1 / 180, 6)}


# ---------------------------------------------------------------------------- choosing


def row(bf16: dict, int8: dict | None = None, outputs=("embeddings", "fill_mask")) -> dict:
    precisions = {"fp32": {"speed": 1.0}, "bf16": bf16}
    if int8 is not None:
        precisions["int8"] = int8
    return {"outputs": list(outputs), "precisions": precisions}


EMB = {"embeddings": {"min_cosine": 0.99991, "mean_cosine": 0.99996}}


def test_the_fastest_precision_within_every_bound_is_chosen():
    r = row(
        {"speed": 3.4, **EMB},
        {"speed": 2.1, "embeddings": {"min_cosine": 0.9972, "mean_cosine": 0.998}},
        outputs=["embeddings"],
    )
    assert choose(r) == ("bf16", "embeddings min cosine 0.99991 ≥ 0.999, 3.4× fp32 on this CPU")
    # with a looser cosine bound int8 passes too; bf16 is still the faster
    assert choose(r, Bounds(cosine=0.99))[0] == "bf16"
    r["precisions"]["int8"]["speed"] = 4.0
    assert choose(r, Bounds(cosine=0.99)) == ("int8", "embeddings min cosine 0.9972 ≥ 0.99, 4× fp32 on this CPU")


def test_a_model_that_fails_one_outputs_bound_stays_fp32_with_the_reason():
    r = row({"speed": 3.4, **EMB, "fill_mask": {"top5_overlap": 0.978}})
    assert choose(r) == ("fp32", "fill-mask top-5 overlap 97.8% < 99% in bf16")
    assert choose(r, Bounds(top5=0.97)) == (
        "bf16",
        "embeddings min cosine 0.99991 ≥ 0.999, fill-mask top-5 overlap 97.8% ≥ 97%, 3.4× fp32 on this CPU",
    )
    r = row(
        {"speed": 3.4, **EMB, "fill_mask": {"top5_overlap": 0.978}},
        {"speed": 2.0, "embeddings": {"min_cosine": 0.997, "mean_cosine": 0.998}, "fill_mask": {"top5_overlap": 0.995}},
    )
    assert choose(r) == (
        "fp32",
        "fill-mask top-5 overlap 97.8% < 99% in bf16; embeddings min cosine 0.997 < 0.999 in int8",
    )


def test_labels_order_and_next_sentence_are_held_to_the_agreement_bound():
    r = row({"speed": 3.0, **EMB, "reranking": {"agreement": 0.99}}, outputs=["embeddings", "reranking"])
    assert choose(r) == ("fp32", "reranking order agreement 99% < 99.5% in bf16")
    r = row({"speed": 3.0, **EMB, "nsp": {"agreement": 1.0}}, outputs=["embeddings", "nsp"])
    assert choose(r)[0] == "bf16"


def test_a_precision_no_faster_than_fp32_or_a_missing_row_is_fp32():
    assert choose(row({"speed": 0.9, **EMB}, outputs=["embeddings"])) == (
        "fp32",
        "bf16 keeps every bound but ran 0.9× fp32",
    )
    assert choose(None) == ("fp32", "not measured")
    assert choose({"set": SET_NAME, "error": "RuntimeError: boom"}) == (
        "fp32",
        "the measurement failed: RuntimeError: boom",
    )
    assert choose({"outputs": ["embeddings"], "precisions": {"fp32": {"speed": 1.0}}}) == (
        "fp32",
        "no faster precision is native on this CPU",
    )


# ---------------------------------------------------------------------------- the card


def test_write_card_keeps_a_row_per_kind_of_cpu(tokenizer, tmp_path, monkeypatch):
    model_dir = tmp_path / "m"
    loader(BertForPreTraining, tokenizer)().save_pretrained(model_dir, tokenizer=tokenizer)
    monkeypatch.setattr(precision_choice, "cpu_kind", lambda info=None: "x86 avx2")
    monkeypatch.setattr(precision_choice, "native_precisions", lambda info=None: ["fp32"])
    write_card(model_dir)
    monkeypatch.undo()
    card = write_card(model_dir)
    table = read_card(model_dir)["precision"]
    assert card["precision"] == table and set(table) == {"x86 avx2", cpu_kind()}
    assert list(table["x86 avx2"]["precisions"]) == ["fp32"]
    here = table[cpu_kind()]
    assert here["set"] == SET_NAME and here["outputs"] == ["embeddings", "fill_mask", "nsp"]
    assert sorted(here["precisions"]) == sorted(native_precisions())
