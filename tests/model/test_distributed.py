"""model/training/distributed.py without processes: the rows a rank takes and the weights its losses get make the
mean of the ranks' gradients (what DDP computes) equal to the global batch's gradient, for a pretraining
model (MLM over masked tokens + NSP over pairs: two different counts) and for a classifier (rows).
Real ranks (torchrun, gloo) are tested in tests/app/cli/test_data_parallel.py."""

from __future__ import annotations

import pytest
import torch

from model.config import BertConfig
from model.modeling import BertForSequenceClassification
from model.training.distributed import Dist, label_counts, loss_weights, rank_rows, rank_seed
from tests.conftest import tiny_config_dict
from tests.model.conftest import tiny_model
from tests.model.test_trainer import fixed_pretraining_batch

NO_DROPOUT = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def gradients(model, batch, parts=("loss",), weights=None) -> list[torch.Tensor]:
    model.zero_grad()
    out = model(**batch)
    loss = sum(getattr(out, p) * (weights or {}).get(p, 1.0) for p in parts)
    loss.backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def ranks_mean(model, batch, world: int, parts) -> list[torch.Tensor]:
    """What DDP leaves on every rank: the mean over ranks of each rank's weighted gradient."""
    per_rank = []
    for rank in range(world):
        d = Dist(rank, world)
        local, factor = rank_rows(batch, d)
        per_rank.append(gradients(model, local, parts, loss_weights(batch, local, parts, d, factor)))
    return [torch.stack(g).mean(0) for g in zip(*per_rank)]


@pytest.mark.parametrize("world", [2, 3, 5])
def test_pretraining_ranks_average_to_the_global_gradient(tiny_tokenizer, world):
    model = tiny_model(**NO_DROPOUT)
    batch = fixed_pretraining_batch(tiny_tokenizer)  # 4 rows: with 5 ranks, one rank has none
    assert label_counts(batch, ["mlm_loss", "nsp_loss"]) == {
        "mlm_loss": int((batch["labels"] != -100).sum()),
        "nsp_loss": 4,
    }
    expected = gradients(model, batch)
    for got, want in zip(ranks_mean(model, batch, world, ["mlm_loss", "nsp_loss"]), expected):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_classifier_ranks_average_to_the_global_gradient(tiny_tokenizer):
    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(**tiny_config_dict(**NO_DROPOUT)).with_labels(["a", "b", "c"]))
    batch = tiny_tokenizer(["the cat sat", "a dog runs fast", "the sky is blue", "she reads", "big red car"])
    batch["labels"] = torch.tensor([0, 2, 1, 1, 0])
    expected = gradients(model, batch)
    for got, want in zip(ranks_mean(model, batch, 2, ["loss"]), expected):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_one_process_takes_the_whole_batch_unweighted():
    batch = {"input_ids": torch.arange(12).reshape(4, 3)}
    assert rank_rows(batch, Dist()) == (batch, 1.0)
    assert loss_weights(batch, batch, ["loss"], Dist()) == {"loss": 1.0}
    local, factor = rank_rows(batch, Dist(1, 3))
    assert local["input_ids"].tolist() == [[3, 4, 5]] and factor == 1.0


def test_dropout_seeds_differ_by_rank_and_step_and_repeat():
    seeds = {rank_seed(0, step, rank) for step in range(50) for rank in range(4)}
    assert len(seeds) == 200 and rank_seed(7, 3, 1) == rank_seed(7, 3, 1)


def test_a_lost_peer_is_told_apart_from_a_ranks_own_error():
    from torch.distributed import DistBackendError

    from model.training.distributed import is_peer_failure

    gloo = RuntimeError(
        "[../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:15794: Connection reset by peer."
    )
    assert is_peer_failure(gloo) and is_peer_failure(DistBackendError("NCCL communicator was aborted"))
    assert not is_peer_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_peer_failure(ValueError("Connection reset by peer"))


def test_one_process_always_agrees_with_itself():
    from model.training.distributed import same_on_all_ranks

    assert same_on_all_ranks(40, Dist())
