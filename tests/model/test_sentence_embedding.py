"""model/training/sentence_embedding.py and the sentence-embedding task of model/training/runs.py: the model's loss
equals sentence-transformers' loss on the same batch and weights (each loss, cached, Matryoshka), for its own
pooling modules; what it saves (checkpoints and the final model) loads in SentenceTransformer and encodes as our
`embed`; a run evaluates the base model first and picks its best checkpoint by its metric; a stopped run resumes
to the weights of an uninterrupted one; options that do not go together are refused, quoting them."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from sentence_transformers import SentenceTransformer
from sentence_transformers.sentence_transformer import losses as st_losses

from model.config import BertConfig
from model.data.pair_batches import PairBatches, ScoredPairBatches
from model.data.pairs import Pair, ScoredPair
from model.errors import UserError
from model.modeling import BertModel, load_model
from model.options import defaults
from model.sentence_modules import Pooling, SentenceModules, read_sentence_modules, write_sentence_modules
from model.tokenizer import BertTokenizer
from model.training.checkpoint import list_checkpoints
from model.training.runs import FinetuneSpec, evaluate_model, run_finetuning
from model.training.sentence_embedding import (
    EmbeddingLoss,
    SentenceEmbeddingModel,
    check_embedding_options,
    loss_for,
)
from tests.conftest import TINY_VOCAB, tiny_config_dict
from tests.helpers import StopAt

TOL = dict(atol=1e-5, rtol=1e-5)
PAIRS = [
    Pair("the cat sat on the mat", "a cat sat", ("the dog eats bread",)),
    Pair("she reads a book", "a woman reads the book at night", ("the sky is blue",)),
    Pair("he ran fast", "the man runs", ("the car is red",)),
    Pair("we love the movie", "it was a great film", ("i hate the film",)),
    Pair("the river runs", "water", ("the tree is big and green",)),
    Pair("the city is small", "a small city", ("fire",)),
]
SCORED = [
    ScoredPair("the cat sat", "a cat sat", 0.9),
    ScoredPair("she reads", "the sky is blue", 0.1),
    ScoredPair("he ran fast", "the man runs", 0.7),
    ScoredPair("we love the movie", "i hate the film", 0.3),
    ScoredPair("the river", "water", 0.5),
]
CLS = SentenceModules(Pooling(("cls",)), normalize=False, max_seq_length=24)  # [CLS], not unit length
MEAN = SentenceModules()  # mean pooling, unit length: what a directory without modules.json gets
GTE = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")


def tiny_dir(path, modules: SentenceModules | None, seed: int = 0):
    """A random tiny BertModel with the tiny vocabulary and (unless None) sentence-transformers modules."""
    torch.manual_seed(seed)
    BertModel(BertConfig(**tiny_config_dict())).save_pretrained(path, tokenizer=BertTokenizer.from_vocab(TINY_VOCAB))
    if modules is not None:
        write_sentence_modules(path, modules)
    return path


@pytest.fixture(scope="module", params=[CLS, MEAN], ids=["cls", "mean-normalize"])
def model_dir(request, tmp_path_factory):
    return tiny_dir(tmp_path_factory.mktemp("tiny-st"), request.param)


def st_columns(batch):
    """sentence-transformers' feature dicts of each column of a (B, C, T) batch: the same tensors."""
    keys = ("input_ids", "attention_mask", "token_type_ids")
    return [{k: batch[k][:, c] for k in keys} for c in range(batch["input_ids"].shape[1])]


LOSSES = [
    (EmbeddingLoss("mnrl"), lambda st: st_losses.MultipleNegativesRankingLoss(st)),
    (
        EmbeddingLoss("mnrl", scale=30.0, directions=GTE, partition_mode="joint"),
        lambda st: st_losses.MultipleNegativesRankingLoss(st, scale=30.0, directions=GTE, partition_mode="joint"),
    ),
    (
        EmbeddingLoss("mnrl", directions=("query_to_doc", "doc_to_query"), partition_mode="per_direction"),
        lambda st: st_losses.MultipleNegativesRankingLoss(
            st, directions=("query_to_doc", "doc_to_query"), partition_mode="per_direction"
        ),
    ),
    (
        EmbeddingLoss("mnrl", cached=True, mini_batch_size=2),
        lambda st: st_losses.CachedMultipleNegativesRankingLoss(st, mini_batch_size=2),
    ),
    (
        EmbeddingLoss("mnrl", matryoshka_dims=(32, 16, 8)),
        lambda st: st_losses.MatryoshkaLoss(st, st_losses.MultipleNegativesRankingLoss(st), [32, 16, 8]),
    ),
    (
        EmbeddingLoss("mnrl", cached=True, mini_batch_size=4, matryoshka_dims=(32, 8)),
        lambda st: st_losses.MatryoshkaLoss(
            st, st_losses.CachedMultipleNegativesRankingLoss(st, mini_batch_size=4), [32, 8]
        ),
    ),
    (EmbeddingLoss("cosent", scale=15.0), lambda st: st_losses.CoSENTLoss(st, scale=15.0)),
    (
        EmbeddingLoss("cosent", matryoshka_dims=(32, 16)),
        lambda st: st_losses.MatryoshkaLoss(st, st_losses.CoSENTLoss(st), [32, 16]),
    ),
]


@pytest.mark.parametrize(
    "options, reference", LOSSES, ids=lambda x: repr(x)[:60] if isinstance(x, EmbeddingLoss) else ""
)
def test_the_loss_is_sentence_transformers_loss_on_the_same_batch(model_dir, options, reference):
    tokenizer = BertTokenizer.from_pretrained(model_dir)
    if options.loss == "cosent":
        batch = next(ScoredPairBatches(SCORED, tokenizer, batch_size=5, max_seq_len=24).iter_batches(0))
    else:
        batch = next(PairBatches(PAIRS, tokenizer, batch_size=6, max_seq_len=24).iter_batches(0))
    ours = SentenceEmbeddingModel.from_pretrained(model_dir, loss=options).eval()
    st = SentenceTransformer(str(model_dir), device="cpu").eval()
    expected = reference(st)(st_columns(batch), batch.get("scores"))
    loss = ours(**batch).loss
    torch.testing.assert_close(loss, expected, **TOL)
    assert loss.item() > 0.05  # a real ranking problem, not a degenerate zero


def test_what_it_saves_loads_in_sentence_transformers_and_encodes_as_our_pooling(model_dir, tmp_path):
    texts = ["the cat sat on the mat", "a man eats bread in the city at night", "fire"]
    tokenizer = BertTokenizer.from_pretrained(model_dir)
    model = SentenceEmbeddingModel.from_pretrained(model_dir, loss=EmbeddingLoss("mnrl"))
    with torch.no_grad():  # weights of its own, so the comparison is not with the start model's
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    model.save_pretrained(tmp_path / "saved", tokenizer)
    saved = tmp_path / "saved"
    assert json.loads((saved / "config.json").read_text())["architectures"] == ["BertModel"]
    assert type(load_model(saved)) is BertModel  # the service loads and serves it as the encoder it is
    assert read_sentence_modules(saved) == read_sentence_modules(model_dir)
    expected = SentenceTransformer(str(saved), device="cpu").encode(texts, convert_to_numpy=True)
    features = tokenizer(texts, max_length=24, truncation=True)
    with torch.no_grad():
        ours = model.eval().embed(features).numpy()
    assert ours.shape == expected.shape and np.allclose(ours, expected, rtol=0, atol=1e-5)
    reloaded = SentenceEmbeddingModel.from_pretrained(saved)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reloaded.state_dict().values()))


def test_a_start_model_with_heads_loses_them_and_keeps_its_prompts(tmp_path):
    from model.modeling import BertForPreTraining

    start = tmp_path / "mlm"
    BertForPreTraining(BertConfig(**tiny_config_dict())).save_pretrained(
        start, tokenizer=BertTokenizer.from_vocab(TINY_VOCAB)
    )
    (start / "config_sentence_transformers.json").write_text(json.dumps({"prompts": {"query": "the "}}))
    model = SentenceEmbeddingModel.from_pretrained(start, init_missing_heads=True)
    assert model.heads == {"pooler"} and model.sentence_modules == MEAN
    model.save_pretrained(tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config_sentence_transformers.json").read_text())["prompts"] == {
        "query": "the "
    }
    assert read_sentence_modules(tmp_path / "out") == MEAN  # written out: sentence-transformers pools as we do


# ---------------------------------------------------------------------------------------------- runs


def pairs_csv(path, pairs=PAIRS * 3):
    rows = ["anchor,positive,negative"] + [f"{p.anchor} {i},{p.positive},{p.negatives[0]}" for i, p in enumerate(pairs)]
    path.write_text("\n".join(rows) + "\n")
    return path


def spec(tmp_path, out, train_file, **kw):
    train = {"max_steps": 6, "log_every": 1, "save_every": 3, "lr": 1e-3, "seed": 5, **kw.pop("train", {})}
    values = {"task": "sentence-embedding", "batch_size": 4, "max_seq_len": 16, "eval_fraction": 0.25, **kw}
    return FinetuneSpec.from_dict(
        dict(train_file=str(train_file), from_model=str(tmp_path / "start"), out=str(out), **values, train=train)
    )


def test_a_run_scores_the_base_model_first_then_trains_saves_and_resumes_exactly(tmp_path):
    tiny_dir(tmp_path / "start", CLS)
    data = pairs_csv(tmp_path / "pairs.csv")
    straight = run_finetuning(spec(tmp_path, tmp_path / "a", data))
    metrics = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in metrics if r["type"] == "eval"]
    assert [r["step"] for r in evals] == [0, 6]
    names = ["cosine_ndcg@10", "cosine_mrr@10", "cosine_recall@1", "cosine_recall@10", "cosine_recall@100"]
    names.append("cosine_map@100")
    assert set(names) | {"queries", "documents"} == set(evals[0]) - {"type", "step"}
    assert straight.eval_metrics == {
        **evals[1],
        **{f"base_{n}": evals[0][n] for n in names},
    } and set(straight.eval_metrics) == {"type", "step", "queries", "documents", *names, *(f"base_{n}" for n in names)}
    assert straight.eval_metrics["queries"] >= 4  # whole anchors held out: a quarter of them
    assert straight.best_checkpoint.endswith("step-6")  # evaluated only there (and at the start)
    assert SentenceTransformer(str(tmp_path / "a" / "checkpoints" / "step-3"), device="cpu").encode(
        ["the cat"]
    ).shape == (
        1,
        32,
    )
    stopped = run_finetuning(spec(tmp_path, tmp_path / "b", data), callbacks=[StopAt(2)])
    assert (stopped.status, stopped.step) == ("stopped", 2)
    resumed = run_finetuning(spec(tmp_path, tmp_path / "b", data))
    assert (resumed.status, resumed.step) == ("completed", 6)
    a, b = load_model(straight.model_dir).state_dict(), load_model(resumed.model_dir).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert resumed.eval_metrics == straight.eval_metrics  # the baseline kept in the checkpoint
    # `bert evaluate` of the trained encoder: held-out pairs given as a file score as the run scored them
    rows = ["anchor,positive,negative"]
    rows += [f"{p.anchor},{p.positive},{p.negatives[0]}" for p in PAIRS]
    (tmp_path / "held.csv").write_text("\n".join(rows) + "\n")
    metrics = evaluate_model(tmp_path / "a", tmp_path / "held.csv", max_seq_len=16, device="cpu")
    assert set(metrics) == {"model", "data", "queries", "documents", *names} and metrics["queries"] == 6
    scored = tmp_path / "sts.csv"
    scored.write_text(
        "sentence1,sentence2,score\n" + "".join(f"{p.sentence1},{p.sentence2},{p.score}\n" for p in SCORED)
    )
    metrics = evaluate_model(tmp_path / "a", scored, max_seq_len=16, device="cpu")
    assert set(metrics) == {"model", "data", "pearson_cosine", "spearman_cosine", "pairs"}


def test_scored_pairs_train_with_cosent_and_pick_the_best_spearman(tmp_path):
    tiny_dir(tmp_path / "start", None)
    rows = ["sentence1,sentence2,score"] + [
        f"{p.sentence1} {i},{p.sentence2},{p.score}" for i, p in enumerate(SCORED * 4)
    ]
    (tmp_path / "sts.csv").write_text("\n".join(rows) + "\n")
    s = spec(tmp_path, tmp_path / "run", tmp_path / "sts.csv", train={"eval_every": 3})
    result = run_finetuning(s)
    assert (s.train.best_metric, s.train.greater_is_better) == ("spearman_cosine", True)
    assert {"pearson_cosine", "spearman_cosine", "base_spearman_cosine", "base_pearson_cosine", "pairs"} <= set(
        result.eval_metrics
    )
    evals = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in evals if r["type"] == "eval" and r["step"] > 0]
    best = max(evals, key=lambda r: (r["spearman_cosine"], -r["step"]))
    assert result.best_checkpoint.endswith(f"step-{best['step']}")
    assert {p.name for p in list_checkpoints(tmp_path / "run")} >= {f"step-{best['step']}", "step-6"}


# ---------------------------------------------------------------------------------------------- refusals


def test_a_loss_must_suit_its_data():
    assert (loss_for(None, "pairs"), loss_for(None, "scored-pairs"), loss_for("mnrl", "pairs")) == (
        "mnrl",
        "cosent",
        "mnrl",
    )
    with pytest.raises(ValueError) as e:
        loss_for("cosent", "pairs", "dataset 'faq'")
    assert str(e.value) == (
        "loss cosent trains on scored-pairs (sentence1, sentence2, score), but dataset 'faq' is pairs (anchor, "
        "positive, negatives): give loss mnrl, or leave it unset"
    )


@pytest.mark.parametrize(
    "values, message",
    [
        (dict(matryoshka_dims=[16, 32]), "matryoshka_dims must descend without repeats (largest first), got [16, 32]"),
        (dict(matryoshka_dims=[32, 32]), "matryoshka_dims must descend without repeats (largest first), got [32, 32]"),
        (dict(matryoshka_dims=[64, 32]), "matryoshka_dims 64 exceeds the model's 32-dimensional embeddings"),
        (dict(loss="cosent", cached=True), "cached is for loss mnrl (in-batch negatives), not cosent"),
        (
            dict(loss="cosent", directions=["query_to_doc", "doc_to_query"]),
            "directions is for loss mnrl (in-batch negatives), not cosent",
        ),  # fmt: skip
        (dict(mini_batch_size=8), "mini_batch_size is for cached: true (GradCache's mini-batches)"),
        (
            dict(directions=["query_to_doc", "query_to_query"], partition_mode="per_direction"),
            "partition_mode='per_direction' cannot take 'query_to_query' or 'doc_to_doc' (got ('query_to_doc', "
            "'query_to_query')); use partition_mode='joint'",
        ),
    ],
)
def test_options_that_do_not_go_together(values, message):
    every = {**defaults("finetune", "sentence-embedding"), "loss": "mnrl"}
    with pytest.raises(ValueError) as e:
        check_embedding_options({**every, **values}, every, dimension=32)
    assert str(e.value) == message


def test_a_run_refuses_a_matryoshka_size_past_the_models(tmp_path):
    tiny_dir(tmp_path / "start", CLS)
    with pytest.raises(UserError) as e:
        run_finetuning(spec(tmp_path, tmp_path / "run", pairs_csv(tmp_path / "p.csv"), matryoshka_dims=[48, 16]))
    assert str(e.value) == "matryoshka_dims 48 exceeds the model's 32-dimensional embeddings"
    with pytest.raises(ValueError) as e:
        spec(tmp_path, tmp_path / "x", tmp_path / "p.csv", task="token-classification", cached=True)
    assert str(e.value) == "cached is for task sentence-embedding, not token-classification"
