"""The retrieval losses (model/training/losses.py) against sentence-transformers 6.x on the same batch and weights.

A tiny random BERT is saved with transformers; sentence-transformers loads it (Transformer + mean Pooling, or a
CrossEncoder over a one-output sequence classifier) and our BertModel / BertForSequenceClassification loads the
same directory. Models are in eval mode (no dropout) wherever the reference's randomness cannot be matched;
the cached loss's replayed dropout is checked against the same mini-batches run uncached from the same seed.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from sentence_transformers import CrossEncoder, SentenceTransformer
from sentence_transformers.base.modules import Transformer
from sentence_transformers.cross_encoder import losses as ce_losses
from sentence_transformers.sentence_transformer import losses as st_losses
from sentence_transformers.sentence_transformer.modules import Pooling
from sentence_transformers.util import cos_sim as st_cos_sim
from sentence_transformers.util import pairwise_cos_sim as st_pairwise_cos_sim
from transformers import BertConfig as HFBertConfig
from transformers import BertForSequenceClassification as HFBertForSequenceClassification
from transformers import BertModel as HFBertModel

from model.modeling import BertForSequenceClassification, BertModel
from model.tokenizer import BertTokenizer
from model.training.losses import (
    BinaryCrossEntropyLoss,
    CachedMultipleNegativesRankingLoss,
    CoSENTLoss,
    CrossEncoderMultipleNegativesRankingLoss,
    MatryoshkaLoss,
    MultipleNegativesRankingLoss,
    cos_sim,
    multiple_negatives_ranking_loss,
    pairwise_cos_sim,
    sample_in_batch_negatives,
)
from tests.conftest import TINY_VOCAB, tiny_config_dict

TOL = dict(atol=1e-5, rtol=1e-5)

ANCHORS = ["the cat sat on the mat", "she reads a book", "he ran fast", "we love the movie", "the river runs"]
POSITIVES = ["a cat sat", "a woman reads the book at night", "the man runs", "it was a great film", "water"]
NEGATIVES = [
    ["the dog eats bread", "the sky is blue", "the car is red", "i hate the film", "the tree is big and green"],
    ["fire", "the city is small", "they write", "a good day", "the mountain is green"],
]

GTE = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")  # Li et al. 2023: one joint softmax
RANKING_OPTIONS = [
    {},
    dict(directions=("query_to_doc", "doc_to_query"), partition_mode="per_direction"),  # symmetric InfoNCE
    dict(directions=GTE, partition_mode="joint"),
    dict(directions=("query_to_doc", "doc_to_doc"), scale=30.0),
    dict(hardness_mode="in_batch_negatives", hardness_strength=9.0),
    dict(hardness_mode="hard_negatives", hardness_strength=5.0),
    dict(hardness_mode="all_negatives", hardness_strength=5.0, directions=GTE),
]


# ---------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def bi_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-bi")
    torch.manual_seed(0)
    HFBertModel(HFBertConfig(**tiny_config_dict())).save_pretrained(path)
    BertTokenizer.from_vocab(TINY_VOCAB).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def ce_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-ce")
    torch.manual_seed(1)
    HFBertForSequenceClassification(HFBertConfig(**tiny_config_dict(num_labels=1))).save_pretrained(path)
    BertTokenizer.from_vocab(TINY_VOCAB).save_pretrained(path)
    return path


@pytest.fixture
def reference(bi_dir):
    return SentenceTransformer(modules=[Transformer(str(bi_dir)), Pooling(32, "mean")], device="cpu").eval()


@pytest.fixture
def ours(bi_dir):
    return BertModel.from_pretrained(bi_dir)  # eval mode


def mean_pooled(model):
    """Our model's `embed`: mean of the last hidden states over the attended tokens (ST's Pooling "mean")."""

    def embed(features):
        hidden = model(features["input_ids"], features["attention_mask"], features["token_type_ids"]).last_hidden_state
        mask = features["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        return (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)

    return embed


def columns(reference, texts):
    """One batch, tokenized once: the reference's feature dicts and ours (the same tensors, less ST's metadata)."""
    theirs = [reference.preprocess(column) for column in texts]
    mine = [{k: v for k, v in f.items() if isinstance(v, torch.Tensor)} for f in theirs]
    return theirs, mine


def fresh(features):
    return [dict(f) for f in features]  # the reference writes its outputs into the dicts it is given


def our_grads(model):
    """Our gradients under Hugging Face's names: the fused qkv split back into query, key and value."""
    grads = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        if ".qkv." in name:
            prefix, kind = name.split(".qkv.")
            grads.update({f"{prefix}.{part}.{kind}": g for part, g in zip(("query", "key", "value"), p.grad.chunk(3))})
        else:
            grads[name] = p.grad.clone()
    return grads


def grads_of(model):
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def assert_same_grads(a, b):
    assert a.keys() == b.keys() and len(a) > 30  # every encoder weight (the unused pooler has none)
    for name in a:
        torch.testing.assert_close(a[name], b[name], **TOL, msg=name)


# ---------------------------------------------------------------------------------------------- similarity


def test_cos_sim_is_sentence_transformers():
    torch.manual_seed(0)
    a, b = torch.randn(5, 16), torch.randn(7, 16)
    torch.testing.assert_close(cos_sim(a, b), st_cos_sim(a, b), **TOL)
    torch.testing.assert_close(pairwise_cos_sim(a, b[:5]), st_pairwise_cos_sim(a, b[:5]), **TOL)
    half = cos_sim(a.bfloat16(), b.bfloat16())  # half inputs are compared in fp32, as ST does
    assert half.dtype == torch.float32
    torch.testing.assert_close(half, st_cos_sim(a.bfloat16(), b.bfloat16()), **TOL)


# ---------------------------------------------------------------------------------------------- MNRL


@pytest.mark.parametrize(
    "options", RANKING_OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "default"
)
@pytest.mark.parametrize("hard_negatives", [0, 2])
def test_mnrl_function_equals_reference_on_embeddings(options, hard_negatives, reference):
    torch.manual_seed(hard_negatives)
    embeddings = [torch.randn(6, 12) for _ in range(2 + hard_negatives)]
    theirs = st_losses.MultipleNegativesRankingLoss(reference, **options).compute_loss_from_embeddings(embeddings, None)
    mine = multiple_negatives_ranking_loss(embeddings[0], embeddings[1:], **options)
    torch.testing.assert_close(mine, theirs, **TOL)


@pytest.mark.parametrize(
    "options", RANKING_OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "default"
)
@pytest.mark.parametrize("hard_negatives", [0, 2])
def test_mnrl_equals_reference_on_a_batch(options, hard_negatives, reference, ours):
    theirs, mine = columns(reference, [ANCHORS, POSITIVES, *NEGATIVES[:hard_negatives]])
    expected = st_losses.MultipleNegativesRankingLoss(reference, **options)(fresh(theirs), None)
    loss = MultipleNegativesRankingLoss(mean_pooled(ours), **options)(mine)
    torch.testing.assert_close(loss, expected, **TOL)
    assert loss.item() > 0.1  # a real ranking problem, not a degenerate zero


@pytest.mark.parametrize("options", [dict(directions=GTE), dict(hardness_mode="all_negatives", hardness_strength=5.0)])
def test_mnrl_gradients_equal_reference(options, reference, ours):
    theirs, mine = columns(reference, [ANCHORS, POSITIVES, *NEGATIVES])
    st_losses.MultipleNegativesRankingLoss(reference, **options)(fresh(theirs), None).backward()
    MultipleNegativesRankingLoss(mean_pooled(ours), **options)(mine).backward()
    assert_same_grads(our_grads(ours), grads_of(reference[0].auto_model))


# ---------------------------------------------------------------------------------------------- CoSENT

SCORES = torch.tensor([0.9, 0.2, 0.5, 0.5, 0.0])  # a tie: pairs of equal scores are not ranked


def test_cosent_equals_reference(reference, ours):
    theirs, mine = columns(reference, [ANCHORS, POSITIVES])
    expected = st_losses.CoSENTLoss(reference)(fresh(theirs), SCORES)
    torch.testing.assert_close(CoSENTLoss(mean_pooled(ours))(mine, SCORES), expected, **TOL)
    torch.manual_seed(0)
    a, b, s = torch.randn(9, 8), torch.randn(9, 8), torch.randint(0, 4, (9,)) / 3
    expected = st_losses.CoSENTLoss(reference, scale=7.0).compute_loss_from_embeddings([a, b], s)
    torch.testing.assert_close(
        CoSENTLoss(mean_pooled(ours), scale=7.0).loss_from_embeddings([a, b], s), expected, **TOL
    )


def test_cosent_is_the_pairwise_sum():
    """log(1 + sum over score[i] > score[j] of exp(scale * (cos_j - cos_i))), written out (Su 2022)."""
    torch.manual_seed(0)
    a, b = torch.randn(5, 8), torch.randn(5, 8)
    cos = pairwise_cos_sim(a, b) * 20
    terms = [(cos[j] - cos[i]).exp() for i in range(5) for j in range(5) if SCORES[i] > SCORES[j]]
    expected = torch.log(1 + torch.stack(terms).sum())
    torch.testing.assert_close(CoSENTLoss(lambda f: f).loss_from_embeddings([a, b], SCORES), expected, **TOL)


# ---------------------------------------------------------------------------------------------- Matryoshka

DIMS, WEIGHTS = [8, 32, 16], [1.0, 0.5, 2.0]  # unsorted on purpose: both sort them largest first


def test_matryoshka_over_mnrl_equals_reference(reference, ours):
    theirs, mine = columns(reference, [ANCHORS, POSITIVES, NEGATIVES[0]])
    inner = st_losses.MultipleNegativesRankingLoss(reference, directions=GTE)
    expected = st_losses.MatryoshkaLoss(reference, inner, DIMS, WEIGHTS)(fresh(theirs), None)
    expected.backward()
    mnrl = MultipleNegativesRankingLoss(mean_pooled(ours), directions=GTE)
    loss = MatryoshkaLoss(mnrl, DIMS, WEIGHTS)(mine)
    loss.backward()
    torch.testing.assert_close(loss, expected, **TOL)
    assert_same_grads(our_grads(ours), grads_of(reference[0].auto_model))
    with torch.no_grad():  # the truncated dimensions do score otherwise than the whole embedding
        assert abs(loss.item() - sum(WEIGHTS) * mnrl(mine).item()) > 1e-3


def test_matryoshka_over_cosent_equals_reference(reference, ours):
    theirs, mine = columns(reference, [ANCHORS, POSITIVES])
    expected = st_losses.MatryoshkaLoss(reference, st_losses.CoSENTLoss(reference), DIMS, WEIGHTS)(
        fresh(theirs), SCORES
    )
    loss = MatryoshkaLoss(CoSENTLoss(mean_pooled(ours)), DIMS, WEIGHTS)(mine, SCORES)
    torch.testing.assert_close(loss, expected, **TOL)


# ---------------------------------------------------------------------------------------------- GradCache


def backward_grads(loss, model, accum=1):
    model.zero_grad(set_to_none=True)
    (loss / accum).backward()  # as the trainer does under gradient accumulation
    return our_grads(model)


@pytest.mark.parametrize(
    "options",
    [{}, dict(directions=GTE), dict(directions=("query_to_doc", "doc_to_query"), partition_mode="per_direction")],
)
@pytest.mark.parametrize("mini_batch_size", [1, 2, 5])
def test_cached_equals_uncached(options, mini_batch_size, reference, ours):
    """The same loss and parameter gradients at any mini-batch size (5 rows: 2 makes a ragged last one),
    and the loss sentence-transformers' cached loss gives."""
    theirs, mine = columns(reference, [ANCHORS, POSITIVES, *NEGATIVES])
    embed = mean_pooled(ours)
    expected = MultipleNegativesRankingLoss(embed, **options)(mine)
    expected_grads = backward_grads(expected, ours, accum=3)
    loss = CachedMultipleNegativesRankingLoss(embed, mini_batch_size=mini_batch_size, **options)(mine)
    assert loss.is_leaf and loss.requires_grad  # the model's graph is not kept: the hook rebuilds it
    torch.testing.assert_close(loss, expected, **TOL)
    assert_same_grads(backward_grads(loss, ours, accum=3), expected_grads)
    with torch.no_grad():
        st = st_losses.CachedMultipleNegativesRankingLoss(reference, mini_batch_size=mini_batch_size, **options)
        torch.testing.assert_close(loss, st(fresh(theirs), None), **TOL)


def test_cached_without_grad_is_the_loss(reference, ours):
    _, mine = columns(reference, [ANCHORS, POSITIVES])
    embed = mean_pooled(ours)
    with torch.no_grad():
        loss = CachedMultipleNegativesRankingLoss(embed, mini_batch_size=2)(mine)
        assert not loss.requires_grad
        torch.testing.assert_close(loss, MultipleNegativesRankingLoss(embed)(mine), **TOL)


def unpadded_columns(count, rows=4, width=7, seed=0):
    """Columns of random tokens with no padding, so a mini-batch is the rows alone (no width trimmed)."""
    g = torch.Generator().manual_seed(seed)
    make = lambda: {  # noqa: E731
        "input_ids": torch.randint(5, len(TINY_VOCAB), (rows, width), generator=g),
        "attention_mask": torch.ones(rows, width, dtype=torch.long),
        "token_type_ids": torch.zeros(rows, width, dtype=torch.long),
    }
    return [make() for _ in range(count)]


def in_mini_batches(embed, size):
    """`embed` over rows size at a time, in order: the forwards (and dropout draws) of GradCache's first pass."""

    def run(features):
        n = features["input_ids"].shape[0]
        return torch.cat([embed({k: v[i : i + size] for k, v in features.items()}) for i in range(0, n, size)])

    return run


def test_cached_replays_dropout(ours):
    """With dropout on, the cached loss's gradients are those of the loss whose embeddings it computed: its
    replayed forwards draw the first pass's masks. The uncached reference runs the same mini-batches, in the
    same order, from the same seed (the candidate columns merged: positives' mini-batches, then negatives')."""
    ours.train()
    features = unpadded_columns(3)
    embed = mean_pooled(ours)
    torch.manual_seed(123)
    expected = MultipleNegativesRankingLoss(in_mini_batches(embed, 2), directions=GTE)(features)
    expected_grads = backward_grads(expected, ours)

    torch.manual_seed(123)
    loss = CachedMultipleNegativesRankingLoss(embed, mini_batch_size=2, directions=GTE)(features)
    after_forward = torch.get_rng_state()
    grads = backward_grads(loss, ours)
    assert torch.equal(torch.get_rng_state(), after_forward)  # the replays leave the random stream as it was
    torch.testing.assert_close(loss, expected, **TOL)
    assert_same_grads(grads, expected_grads)

    torch.manual_seed(124)  # other masks: another loss and other gradients, so the masks above mattered
    other = MultipleNegativesRankingLoss(in_mini_batches(embed, 2), directions=GTE)(features)
    other_grads = backward_grads(other, ours)
    assert abs(other.item() - loss.item()) > 1e-4
    assert not torch.allclose(
        other_grads["embeddings.word_embeddings.weight"], grads["embeddings.word_embeddings.weight"]
    )


def test_cached_replays_under_the_first_pass_autocast(reference, ours):
    """The trainer calls backward outside its autocast block: the replayed forwards still run in bf16, as the
    first pass did, so the cached gradients meet the embeddings they were computed for."""
    _, mine = columns(reference, [ANCHORS, POSITIVES])
    embed, seen = mean_pooled(ours), []

    def recording(features):
        seen.append(torch.is_autocast_enabled("cpu"))
        return embed(features)

    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = CachedMultipleNegativesRankingLoss(recording, mini_batch_size=2)(mine)
        expected = MultipleNegativesRankingLoss(embed)(mine)
    grads, expected_grads = backward_grads(loss, ours), backward_grads(expected, ours)
    assert seen == [True] * 12  # 2 columns x 3 mini-batches, embedded then replayed
    torch.testing.assert_close(loss, expected, atol=0.05, rtol=0.02)  # bf16: same within its rounding
    flat, expected_flat = (torch.cat([g[name].flatten() for name in sorted(g)]) for g in (grads, expected_grads))
    assert F.cosine_similarity(flat, expected_flat, dim=0) > 0.99


def test_matryoshka_over_cached_equals_matryoshka_over_mnrl(reference, ours):
    theirs, mine = columns(reference, [ANCHORS, POSITIVES, NEGATIVES[1]])
    embed = mean_pooled(ours)
    expected = MatryoshkaLoss(MultipleNegativesRankingLoss(embed, directions=GTE), DIMS, WEIGHTS)(mine)
    expected_grads = backward_grads(expected, ours, accum=2)
    cached = CachedMultipleNegativesRankingLoss(embed, mini_batch_size=2, directions=GTE)
    loss = MatryoshkaLoss(cached, DIMS, WEIGHTS)(mine)
    torch.testing.assert_close(loss, expected, **TOL)
    assert_same_grads(backward_grads(loss, ours, accum=2), expected_grads)
    with torch.no_grad():
        st_cached = st_losses.CachedMultipleNegativesRankingLoss(reference, mini_batch_size=2, directions=GTE)
        st = st_losses.MatryoshkaLoss(reference, st_cached, DIMS, WEIGHTS)
        torch.testing.assert_close(loss, st(fresh(theirs), None), **TOL)


# ---------------------------------------------------------------------------------------------- cross-encoders


@pytest.fixture
def cross_encoders(ce_dir):
    reference = CrossEncoder(str(ce_dir), device="cpu")
    reference.eval()
    model, tokenizer = BertForSequenceClassification.from_pretrained(ce_dir), BertTokenizer.from_pretrained(ce_dir)

    def score_pairs(firsts, seconds):
        return model(**tokenizer(list(firsts), list(seconds))).logits  # (N, 1)

    return reference, score_pairs


CE_COLUMNS = [ANCHORS, POSITIVES, NEGATIVES[0]]


@pytest.mark.parametrize("num_negatives", [0, 3, None])
def test_in_batch_negatives_are_the_reference_draw(num_negatives, cross_encoders):
    reference, _ = cross_encoders
    st = ce_losses.MultipleNegativesRankingLoss(reference, num_negatives=num_negatives)
    torch.manual_seed(5)
    if num_negatives == 0:  # the reference cannot draw none; ours gives hard negatives alone
        expected = []
    else:
        expected = list(st.get_in_batch_negatives(CE_COLUMNS[0], CE_COLUMNS[1:]))  # one list per draw
    drawn = sample_in_batch_negatives(5, 2, num_negatives, generator=torch.Generator().manual_seed(5))
    candidates = [c for column in CE_COLUMNS[1:] for c in column]
    assert [[candidates[i] for i in column] for column in drawn.T.tolist()] == expected
    own = torch.arange(5)[:, None] + 5 * torch.arange(2)
    assert drawn.shape == (5, 8 if num_negatives is None else num_negatives)
    assert not (drawn[:, :, None] == own[:, None, :]).any()  # never a row's own positive or hard negative


@pytest.mark.parametrize(
    "options", [{}, dict(num_negatives=2, scale=5.0), dict(num_negatives=None, activation=None, scale=1.0)]
)
def test_cross_encoder_mnrl_equals_reference(options, cross_encoders):
    reference, score_pairs = cross_encoders
    theirs = dict(options)
    if "activation" in theirs:
        theirs["activation_fn"] = theirs.pop("activation")
    torch.manual_seed(7)  # the reference draws from torch's generator; ours from the one it is given
    expected = ce_losses.MultipleNegativesRankingLoss(reference, **theirs)(CE_COLUMNS, None)
    loss = CrossEncoderMultipleNegativesRankingLoss(score_pairs, **options)(
        CE_COLUMNS, generator=torch.Generator().manual_seed(7)
    )
    torch.testing.assert_close(loss, expected, **TOL)


@pytest.mark.parametrize("pos_weight", [None, 2.5])
def test_binary_cross_entropy_equals_reference(pos_weight, cross_encoders):
    reference, score_pairs = cross_encoders
    weight = None if pos_weight is None else torch.tensor(pos_weight)
    for labels in (torch.tensor([1, 0, 0, 1, 1]), torch.tensor([0.9, 0.1, 0.5, 0.3, 1.0])):
        expected = ce_losses.BinaryCrossEntropyLoss(reference, pos_weight=weight)([ANCHORS, POSITIVES], labels)
        loss = BinaryCrossEntropyLoss(score_pairs, pos_weight=pos_weight)([ANCHORS, POSITIVES], labels)
        torch.testing.assert_close(loss, expected, **TOL)


# ---------------------------------------------------------------------------------------------- bad input


def test_bad_options_and_columns_are_refused_with_their_values(ours):
    embed = mean_pooled(ours)
    features = unpadded_columns(3)
    cases = [
        (lambda: MultipleNegativesRankingLoss(embed, directions=("doc_to_query",)), "must include 'query_to_doc'"),
        (
            lambda: MultipleNegativesRankingLoss(embed, directions=GTE, partition_mode="per_direction"),
            "partition_mode='per_direction' cannot take 'query_to_query' or 'doc_to_doc'",
        ),
        (lambda: MultipleNegativesRankingLoss(embed, scale=0), "scale must be > 0, got 0"),
        (lambda: MultipleNegativesRankingLoss(embed, hardness_mode="hardest"), "got 'hardest'"),
        (
            lambda: CachedMultipleNegativesRankingLoss(embed, mini_batch_size=0),
            "mini_batch_size must be an integer >= 1, got 0",
        ),
        (lambda: MultipleNegativesRankingLoss(embed)(features[:1]), "takes at least 2 columns, got 1"),
        (lambda: MultipleNegativesRankingLoss(embed)(features[0]), "takes a list of feature dicts"),
        (lambda: CoSENTLoss(embed)(features, SCORES[:4]), "CoSENTLoss takes 2 columns, got 3"),
        (lambda: CoSENTLoss(embed)(features[:2]), "CoSENTLoss needs scores"),
        (lambda: CoSENTLoss(embed)(features[:2], SCORES), "one score per row: 4 rows, scores (5,)"),
        (
            lambda: MatryoshkaLoss(MultipleNegativesRankingLoss(embed), [64])(features),
            "dimension 64 exceeds the embeddings' dimension 32",
        ),
        (lambda: MatryoshkaLoss(MultipleNegativesRankingLoss(embed), [16, 8], [1.0]), "1 matryoshka_weights for 2"),
        (lambda: sample_in_batch_negatives(4, 1, -1), "num_negatives must be None or an integer >= 0, got -1"),
    ]
    for make, message in cases:
        with pytest.raises(ValueError) as info:
            make()
        assert message in str(info.value)
    short = [features[0], {k: v[:3] for k, v in features[1].items()}]
    with pytest.raises(ValueError, match=r"the same number of rows, got \[4, 3\]"):
        MultipleNegativesRankingLoss(embed)(short)
