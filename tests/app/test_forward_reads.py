"""The host reads a forward pass decides (app/serving/forward.py), counted on the CPU: the engine's device tensors
stand in as tensors that count every read, the host copies of the ids and mask stay plain (as after
engine._forward). Fill-mask (with targets too), NSP and classification with top_k bring their answers back in one
copy per pass and read nothing else of the device; on a GPU each read is a sync."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from app.serving import forward
from app.serving.engine import Batch
from model.modeling import BertForPreTraining, BertForSequenceClassification
from tests.app.conftest import VOCAB, tiny_config

READS = {"item", "tolist", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__"}
MASK = VOCAB.index("[MASK]")


class OnDevice(torch.Tensor):
    """A tensor as if it were on a GPU: each read of it on the host is counted; what .cpu() gives is plain."""

    reads: list[str] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in READS:
            cls.reads.append(name)
        out = super().__torch_function__(func, types, args, kwargs or {})
        return out.as_subclass(torch.Tensor) if name == "cpu" else out


def batch_of(rows: list[list[int]], params: list[dict]) -> Batch:
    """A padded batch as engine._forward leaves it: device ids (counted), host ids and mask kept."""
    longest = max(len(r) for r in rows)
    ids = torch.tensor([r + [0] * (longest - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (longest - len(r)) for r in rows])
    item = SimpleNamespace
    batch = Batch(
        ids.as_subclass(OnDevice),
        torch.zeros_like(ids).as_subclass(OnDevice),
        mask.as_subclass(OnDevice),
        [(item(params=p), i) for i, p in enumerate(params)],
        int(mask.sum()),
    )
    batch.host_ids, batch.host_mask = ids, mask
    return batch


@pytest.fixture
def reads():
    OnDevice.reads = []
    return OnDevice.reads


def lm_of(model) -> SimpleNamespace:
    return SimpleNamespace(model=model.eval(), mask_token_id=MASK, config=model.config)


ROWS = [[2, 10, MASK, 11, 3], [2, MASK, 12, MASK, 13, 3], [2, 14, 3]]


@pytest.mark.parametrize("targets", [False, True])
def test_fill_mask_reads_its_answers_once_per_pass(reads, targets):
    torch.manual_seed(0)
    lm = lm_of(BertForPreTraining(tiny_config()))
    params = [{"top_k": 3, **({"target_ids": [20, 21, 22, 23]} if targets and r != 1 else {})} for r in range(3)]
    with torch.inference_mode():
        answers = forward.run_mlm(lm, batch_of(ROWS, params))
    assert [len(a) for a in answers] == [1, 2, 0]  # one answer per [MASK]
    assert all(len(v) == len(i) == 3 for a in answers for v, i in a)
    # One copy back per pass (without targets, the batch's top-k values then ids: the second waits for nothing)
    assert reads == (["cpu"] if targets else ["cpu", "cpu"]), reads


def test_nsp_and_classification_with_top_k_read_once(reads):
    torch.manual_seed(0)
    nsp = forward.run_nsp(lm_of(BertForPreTraining(tiny_config())), batch_of(ROWS, [{}] * 3))
    assert len(nsp) == 3 and reads == ["cpu"]
    reads.clear()
    labels = {i: f"l{i}" for i in range(5)}
    clf = lm_of(BertForSequenceClassification(tiny_config(id2label=labels)))
    with torch.inference_mode():
        out = forward.run_classify(clf, batch_of(ROWS, [{"top_k": 2}, {}, {"top_k": 1}]))
    assert [len(o[0]) if isinstance(o, tuple) else len(o) for o in out] == [2, 5, 1]
    assert reads == ["cpu"]
