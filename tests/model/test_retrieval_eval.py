"""Retrieval, reranking and similarity metrics against sentence-transformers' evaluators on the same models
and data (a tiny random BERT saved once, loaded by sentence-transformers and by our model/), the exact
chunked search against a full sort, and the metrics' definitions on a case worked by hand."""

from __future__ import annotations

import random

import numpy as np
import pytest
import scipy.stats
import torch
import transformers
from sentence_transformers import CrossEncoder, SentenceTransformer
from sentence_transformers.cross_encoder.evaluation import CrossEncoderRerankingEvaluator
from sentence_transformers.sentence_transformer.evaluation import (
    EmbeddingSimilarityEvaluator,
    InformationRetrievalEvaluator,
)
from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
from sentence_transformers.util import cos_sim

from model.modeling import BertForSequenceClassification, BertModel
from model.tokenizer import BertTokenizer
from model.training import retrieval_eval
from model.training.retrieval_eval import (
    average_ranks,
    evaluate_retrieval,
    information_retrieval,
    ranking_metrics,
    rerank,
    retrieve,
    search,
    similarity_correlation,
)
from tests.conftest import TINY_VOCAB, WORDS, tiny_config_dict

TOL = 1e-6
PR_AT_K = [1, 3, 5, 10, 100]  # ours by default; the reference's default stops at 10
MISSING = "d999"  # relevant to one query, not in the corpus


# ---------------------------------------------------------------------------- data and models


def synthetic_set(seed: int = 0):
    """~200 documents with ids whose string order is not their number's (d10 < d2), 30 queries with 1-3
    relevant documents each (words of the first), one of them also relevant to MISSING, one query with none,
    and relevant ids for a query that does not exist (the reference ignores them)."""
    rng = random.Random(seed)
    texts: set[str] = set()
    while len(texts) < 200:
        texts.add(" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))))
    ordered = sorted(texts)
    rng.shuffle(ordered)
    corpus = {f"d{i}": t for i, t in enumerate(ordered)}
    queries, relevant = {}, {}
    for j in range(30):
        docs = rng.sample(sorted(corpus), rng.randint(1, 3))
        words = corpus[docs[0]].split()
        queries[f"q{j}"] = " ".join(rng.sample(words, min(4, len(words))) + [rng.choice(WORDS)])
        relevant[f"q{j}"] = set(docs)
    relevant["q7"].add(MISSING)
    queries["q_none"] = "the sky is blue"
    relevant["q_unknown"] = {"d1"}
    return queries, corpus, relevant


def random_hf(name: str, **cfg):
    """A random tiny transformers model with weights spread wide enough (initializer_range 0.2) that its
    scores differ far more than two implementations' float noise (~1e-7) does."""
    torch.manual_seed(0)
    config = transformers.BertConfig(**tiny_config_dict(**cfg), initializer_range=0.2)
    return getattr(transformers, name)(config).eval()


@pytest.fixture(scope="module")
def bi_encoder_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("bi")
    random_hf("BertModel").save_pretrained(path)
    BertTokenizer.from_vocab(TINY_VOCAB, lowercase=True).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def cross_encoder_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("ce")
    random_hf("BertForSequenceClassification", num_labels=1).save_pretrained(path)
    BertTokenizer.from_vocab(TINY_VOCAB, lowercase=True).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def data(st_model):
    """synthetic_set less any document whose cosine to a query lies within 1e-5 of a relevant document's
    (by the reference model), so that float noise cannot swap a relevant document with another."""
    queries, corpus, relevant = synthetic_set()
    ids = list(corpus)
    scores = cos_sim(st_model.encode(list(queries.values())), st_model.encode(list(corpus.values())))
    close = set()
    for qi, q in enumerate(queries):
        for r in relevant.get(q, set()) & set(ids):
            near = (scores[qi] - scores[qi, ids.index(r)]).abs() < 1e-5
            close |= {ids[i] for i in near.nonzero()[:, 0].tolist()} - relevant[q]
    return queries, {c: t for c, t in corpus.items() if c not in close}, relevant


@pytest.fixture(scope="module")
def st_model(bi_encoder_dir):
    transformer = Transformer(str(bi_encoder_dir))
    return SentenceTransformer(modules=[transformer, Pooling(transformer.get_embedding_dimension(), "mean")])


@pytest.fixture(scope="module")
def our_encode(bi_encoder_dir):
    """Our BertModel of the same weights, mean-pooled over the real tokens (as the Pooling module)."""
    model, tokenizer = BertModel.from_pretrained(bi_encoder_dir), BertTokenizer.from_pretrained(bi_encoder_dir)

    @torch.no_grad()
    def encode(texts: list[str]) -> torch.Tensor:
        batch = tokenizer(texts)
        hidden = model(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"]).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).float()  # (B, T) -> (B, T, 1)
        return (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)

    return encode


@pytest.fixture(scope="module")
def our_score(cross_encoder_dir):
    """Our BertForSequenceClassification of the same weights; sigmoid of the logit, as CrossEncoder.predict."""
    model = BertForSequenceClassification.from_pretrained(cross_encoder_dir)
    tokenizer = BertTokenizer.from_pretrained(cross_encoder_dir)

    @torch.no_grad()
    def score(pairs: list[tuple[str, str]]) -> list[float]:
        batch = tokenizer([q for q, _ in pairs], [d for _, d in pairs])
        return torch.sigmoid(
            model(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"]).logits[:, 0]
        ).tolist()

    return score


def lookup(vectors: dict[str, torch.Tensor]):
    """An `encode` that gives the embeddings already computed for each text."""
    return lambda texts: torch.stack([vectors[t] for t in texts])


class GivenEmbeddingsIR(InformationRetrievalEvaluator):
    """The reference evaluator with its search and metrics as they are, embedding by a table (text -> vector)."""

    def __init__(self, vectors, **kwargs):
        super().__init__(score_functions={"cosine": cos_sim}, **kwargs)
        self.vectors = vectors

    def embed_inputs(self, model, sentences, **kwargs):
        return torch.stack([self.vectors[s] for s in sentences])

    def metrics(self) -> dict[str, float]:
        scores = self.compute_all_metrics(model=None)
        return {
            f"{fn}_{name.replace('@k', '@' + str(k))}": float(value)
            for fn, by_name in scores.items()
            for name, by_k in by_name.items()
            for k, value in by_k.items()
        }


def assert_same_metrics(ours: dict[str, float], theirs: dict[str, float]) -> None:
    assert list(ours) == list(theirs)
    for key in theirs:
        assert ours[key] == pytest.approx(float(theirs[key]), abs=TOL), key


# ---------------------------------------------------------------------------- retrieval


def test_retrieval_equals_the_reference_with_our_model(data, st_model, our_encode):
    queries, corpus, relevant = data
    theirs = InformationRetrievalEvaluator(queries, corpus, relevant, precision_recall_at_k=PR_AT_K)(st_model)
    ours = evaluate_retrieval(our_encode, queries, corpus, relevant, batch_size=16, chunk_size=37)
    texts = list(corpus.values())
    torch.testing.assert_close(our_encode(texts), st_model.encode(texts, convert_to_tensor=True), atol=1e-5, rtol=0)
    assert_same_metrics(ours, theirs)
    assert 0 < ours["cosine_ndcg@10"] < 1 and 0 < ours["cosine_recall@100"] < 1  # a ranking, not a trivial case


def test_retrieval_equals_the_reference_on_the_same_embeddings(data, st_model):
    """The reference's own embeddings of every text (computed as its evaluator computes them), looked up."""
    queries, corpus, relevant = data
    asked = [q for q in queries if relevant.get(q)]
    vectors = dict(zip(corpus.values(), st_model.encode_document(list(corpus.values()), convert_to_tensor=True)))
    vectors |= dict(
        zip([queries[q] for q in asked], st_model.encode_query([queries[q] for q in asked], convert_to_tensor=True))
    )
    theirs = InformationRetrievalEvaluator(queries, corpus, relevant, precision_recall_at_k=PR_AT_K)(st_model)
    for chunk_size in (1, 50, 10_000):
        assert_same_metrics(
            evaluate_retrieval(lookup(vectors), queries, corpus, relevant, chunk_size=chunk_size), theirs
        )


def tied_set(seed: int = 0):
    """300 documents on 6 unit vectors whose cosines are exact in float32 (multiples of 1/4): scores tie
    everywhere, also at the 100th place, and only the ids can order them."""
    rng = random.Random(seed)
    basis = torch.tensor(
        [[1, 0, 0, 0], [0, 1, 0, 0], [0.5, 0.5, 0.5, 0.5], [0.5, -0.5, 0.5, -0.5], [0, 0, 1, 0], [-0.5, 0.5, 0.5, 0.5]]
    )
    ids = [f"d{i}" for i in range(300)]
    rng.shuffle(ids)  # the corpus's order is neither numeric nor the ids' string order
    corpus = {cid: f"doc {cid}" for cid in ids}
    queries = {f"q{j}": f"query {j}" for j in range(12)}
    vectors = {text: basis[rng.randrange(6)] for text in [*corpus.values(), *queries.values()]}
    relevant = {q: set(rng.sample(ids, rng.randint(1, 60))) for q in queries}
    relevant["q3"].add(MISSING)
    return queries, corpus, relevant, vectors


@pytest.mark.parametrize("chunk_size", [1, 7, 128, 50_000])
def test_tied_scores_rank_as_the_reference(chunk_size):
    queries, corpus, relevant, vectors = tied_set()
    kwargs = dict(precision_recall_at_k=PR_AT_K, accuracy_at_k=[1, 3, 5, 10, 50], ndcg_at_k=[10, 100], map_at_k=[100])
    theirs = GivenEmbeddingsIR(
        vectors, queries=queries, corpus=corpus, relevant_docs=relevant, corpus_chunk_size=chunk_size, **kwargs
    )
    ours = evaluate_retrieval(lookup(vectors), queries, corpus, relevant, chunk_size=chunk_size, **kwargs)
    assert_same_metrics(ours, theirs.metrics())


def full_sort(query_emb, corpus_emb, k):
    """The definition: every score, sorted by (-score, row)."""
    scores = torch.nn.functional.normalize(query_emb, dim=-1) @ torch.nn.functional.normalize(corpus_emb, dim=-1).T
    values, rows = scores.sort(dim=1, descending=True, stable=True)
    return values[:, :k], rows[:, :k]


def test_chunked_search_equals_a_full_sort():
    """On embeddings whose cosines are exact in float32 (±1 in 16 dimensions: multiples of 1/16, ties
    everywhere) any chunking gives the full sort's order exactly; on Gaussian ones, the same top 10."""
    g = torch.Generator().manual_seed(0)
    signs_q = torch.randint(0, 2, (300, 16), generator=g).float() * 2 - 1  # 300 queries: more than QUERY_ROWS
    signs_c = torch.randint(0, 2, (500, 16), generator=g).float() * 2 - 1
    tied_q = torch.tensor([[1.0, 0, 0, 0], [0.5, 0.5, 0.5, 0.5], [0, 0, 0, 2.0]])
    tied_c = torch.tensor([[1.0, 0, 0, 0], [0, 1.0, 0, 0], [0.5, -0.5, 0.5, 0.5]]).repeat(40, 1)
    gauss_q, gauss_c = torch.randn(50, 16, generator=g), torch.randn(500, 16, generator=g)
    for q, c, ks in (
        (signs_q, signs_c, (1, 10, 100, 1000)),
        (tied_q, tied_c, (1, 10, 100, 1000)),
        (gauss_q, gauss_c, (10,)),
    ):
        for k in ks:
            want_scores, want_rows = full_sort(q, c, k)
            for chunk_size in (1, 7, 64, len(c)):
                scores, rows = search(q, c, k, chunk_size=chunk_size)
                assert torch.equal(rows, want_rows), (k, chunk_size)
                torch.testing.assert_close(scores, want_scores, atol=TOL, rtol=0)


def test_information_retrieval_takes_rows():
    """Integer ids are corpus rows; a row outside the corpus is relevant and never found; a list and a dict
    by query row say the same; a query with nothing relevant is left out."""
    g = torch.Generator().manual_seed(1)
    q, c = torch.randn(4, 8, generator=g), torch.randn(50, 8, generator=g)
    as_list = [{3, 7}, set(), {0, 60}, {49}]
    ours = information_retrieval(q, c, as_list, chunk_size=9)
    assert ours == information_retrieval(q, c, {0: {3, 7}, 2: [0, 60], 3: (49,)})
    assert list(ours)[:2] == ["cosine_accuracy@1", "cosine_accuracy@3"] and "cosine_map@100" in ours
    vectors = {f"t{i}": v for i, v in enumerate(torch.cat([q, c]))}
    corpus = {f"c{i:02d}": f"t{4 + i}" for i in range(50)}  # zero-padded: the ids' order is the rows'
    relevant = {f"q{i}": {f"c{r:02d}" for r in rows} for i, rows in enumerate(as_list)}
    assert ours == evaluate_retrieval(lookup(vectors), {f"q{i}": f"t{i}" for i in range(4)}, corpus, relevant)


def test_metrics_by_hand():
    """Two queries, results ranked 1-5. Query A: relevant at ranks 1 and 3, and 3 relevant in all (one never
    found). Query B: relevant at rank 2 only, 1 relevant in all."""
    hits = np.array([[1, 0, 1, 0, 0], [0, 1, 0, 0, 0]], dtype=bool)
    n_relevant = np.array([3, 1])
    m = ranking_metrics(
        hits, n_relevant, mrr_at_k=[5], ndcg_at_k=[3], accuracy_at_k=[1, 2], precision_recall_at_k=[3], map_at_k=[5]
    )
    log2 = np.log2
    expected = {
        "accuracy@1": (1 + 0) / 2,  # A's first result is relevant, B's is not
        "accuracy@2": (1 + 1) / 2,
        "precision@3": (2 / 3 + 1 / 3) / 2,  # relevant in the top 3, over 3
        "recall@3": (2 / 3 + 1 / 1) / 2,  # relevant in the top 3, over all relevant (found or not)
        # DCG: 1/log2(rank+1) per relevant result; ideal: min(n_relevant, k) relevant results on top.
        "ndcg@3": ((1 / log2(2) + 1 / log2(4)) / (1 / log2(2) + 1 / log2(3) + 1 / log2(4)) + (1 / log2(3)) / 1) / 2,
        "mrr@5": (1 / 1 + 1 / 2) / 2,  # 1 / the first relevant rank
        # precision at each relevant rank, summed, over min(k, n_relevant): A (1/1 + 2/3) / 3, B (1/2) / 1.
        "map@5": ((1 / 1 + 2 / 3) / 3 + (1 / 2) / 1) / 2,
    }
    assert m == pytest.approx(expected, abs=1e-12)
    assert list(m) == list(expected)


def test_retrieval_rejects_bad_input():
    q, c = torch.randn(2, 4), torch.randn(5, 4)
    with pytest.raises(ValueError, match=r"none of the 2 queries has a relevant document"):
        information_retrieval(q, c, [set(), set()])
    with pytest.raises(ValueError, match=r"relevant has 1 entries but there are 2 queries"):
        information_retrieval(q, c, [{1}])
    with pytest.raises(ValueError, match=r"keyed by query rows 0..1, got \[5\]"):
        information_retrieval(q, c, {5: {1}})
    with pytest.raises(ValueError, match=r"ndcg_at_k must be ints >= 1, got \[0\]"):
        information_retrieval(q, c, [{1}, {2}], ndcg_at_k=[0])
    with pytest.raises(ValueError, match=r"got \(2, 4\) and \(5, 3\)"):
        search(q, torch.randn(5, 3), 3)
    with pytest.raises(ValueError, match=r"corpus embeddings hold NaN"):
        search(q, torch.full((5, 4), float("nan")), 3)
    with pytest.raises(ValueError, match=r"encode gave shape \(1, 4\) for 2 texts"):
        evaluate_retrieval(lambda texts: torch.zeros(1, 4), {"q": "a"}, {"d": "b", "e": "c"}, {"q": {"d"}})
    with pytest.raises(ValueError, match=r"got a string for \['q'\]"):
        evaluate_retrieval(lambda texts: torch.zeros(len(texts), 4), {"q": "a"}, {"d": "b"}, {"q": "d"})


# ---------------------------------------------------------------------------- reranking


def reference_samples(queries, corpus, relevant, candidates, top_k, extra_positive: dict | None = None):
    """The reference evaluator's samples with "documents": the candidates' texts, best first."""
    samples = []
    for q in queries:
        if not relevant.get(q):
            continue
        positive = [corpus[c] for c in sorted(relevant[q]) if c in corpus] + (extra_positive or {}).get(q, [])
        samples.append(
            {"query": queries[q], "positive": positive, "documents": [corpus[c] for c in candidates[q][:top_k]]}
        )
    return samples


@pytest.fixture(scope="module")
def first_stage(data, our_encode):
    queries, corpus, _ = data
    return retrieve(our_encode, queries, corpus, top_k=30, chunk_size=64)


def test_rerank_equals_the_reference_with_our_cross_encoder(data, first_stage, cross_encoder_dir, our_score):
    """The default adds the relevant documents the first stage missed. The reference's samples hold texts,
    so a relevant id outside the corpus cannot be given to it: here relevant is cut to the corpus."""
    queries, corpus, relevant = data
    relevant = {q: {c for c in ids if c in corpus} for q, ids in relevant.items()}
    ce = CrossEncoder(str(cross_encoder_dir))
    pairs = [(queries["q0"], corpus[c]) for c in first_stage["q0"]]
    np.testing.assert_allclose(our_score(pairs), ce.predict(pairs), atol=1e-5)
    theirs = CrossEncoderRerankingEvaluator(
        reference_samples(queries, corpus, relevant, first_stage, 20), name="rerank"
    )(ce)
    ours = rerank(our_score, queries, corpus, relevant, first_stage, top_k=20, batch_size=50)
    assert_same_metrics(ours, theirs)
    assert ours["rerank_map"] != ours["rerank_base_map"]
    missed = [q for q in queries if relevant.get(q) and not relevant[q] & set(first_stage[q][:20])]
    assert missed  # some query's relevant documents were all missed, and are reranked all the same


def test_rerank_without_adding_positives_equals_the_reference(data, first_stage, cross_encoder_dir, our_score):
    """always_rerank_positives=False: the candidates alone are scored; every relevant id, the one outside the
    corpus too, counts in NDCG's ideal and MAP's denominator, as the reference's positives do."""
    queries, corpus, relevant = data
    ce = CrossEncoder(str(cross_encoder_dir))
    samples = reference_samples(
        queries, corpus, relevant, first_stage, 30, extra_positive={"q7": ["not in the corpus"]}
    )
    theirs = CrossEncoderRerankingEvaluator(samples, always_rerank_positives=False, name="rerank", at_k=5)(ce)
    ours = rerank(our_score, queries, corpus, relevant, first_stage, top_k=30, at_k=5, always_rerank_positives=False)
    assert_same_metrics(ours, theirs)


def test_rerank_metrics_with_tied_scores_equal_the_reference():
    """Scores with many exact ties: MRR follows NumPy's argsort as the reference; NDCG and AP average
    over the tied orders, as scikit-learn does for it."""
    rng = np.random.default_rng(0)
    for _ in range(200):
        n, at_k = int(rng.integers(1, 25)), int(rng.integers(1, 12))
        y_true = (rng.random(n) < 0.3).astype(int)
        y_pred = rng.integers(0, 4, n).astype(np.float64)
        n_positives = int(y_true.sum() + rng.integers(0, 3))
        theirs = CrossEncoderRerankingEvaluator([], at_k=at_k).compute_metrics(list(y_true), y_pred, n_positives)
        ap, mrr, ndcg = retrieval_eval._rerank_metrics(y_true.astype(np.float64), y_pred, n_positives, at_k)
        assert (mrr, ndcg, ap) == pytest.approx(tuple(float(v) for v in theirs), abs=1e-12), (y_true, y_pred, at_k)


def test_rerank_by_hand():
    """One query, relevant {a, b, gone}: the first stage ranks x, a, y (b and gone missed). Reranked, b is
    added and scored; the scores put b first, then y, a, x. `gone` is not in the corpus: it counts, unfound."""
    corpus = {"a": "A", "b": "B", "x": "X", "y": "Y"}
    scores = {"A": 0.5, "B": 0.9, "X": 0.1, "Y": 0.7}
    m = rerank(
        lambda pairs: [scores[d] for _, d in pairs],
        {"q": "Q"},
        corpus,
        {"q": {"a", "b", "gone"}},
        {"q": ["x", "a", "y"]},
    )
    log2 = np.log2
    ideal = 1 / log2(2) + 1 / log2(3) + 1 / log2(4)  # three relevant on top
    assert m == pytest.approx(
        {
            "rerank_map": (1 / 1 + 2 / 3) / 3,  # b, y, a, x: relevant at ranks 1 and 3
            "rerank_mrr@10": 1.0,
            "rerank_ndcg@10": (1 / log2(2) + 1 / log2(4)) / ideal,
            "rerank_base_map": (1 / 2) / 3,  # x, a, y: relevant at rank 2
            "rerank_base_mrr@10": 1 / 2,
            "rerank_base_ndcg@10": (1 / log2(3)) / ideal,
        },
        abs=1e-12,
    )


def test_rerank_rejects_bad_input():
    corpus, queries, relevant = {"a": "A", "b": "B"}, {"q": "Q"}, {"q": {"a"}}
    with pytest.raises(ValueError, match=r"query 'q' has relevant documents but no candidates"):
        rerank(lambda pairs: [0.0] * len(pairs), queries, corpus, relevant, {})
    with pytest.raises(ValueError, match=r"candidates of query 'q' are not in the corpus: \['z'\]"):
        rerank(lambda pairs: [0.0] * len(pairs), queries, corpus, relevant, {"q": ["z"]})
    with pytest.raises(ValueError, match=r"score gave \[0.0\] for 2 pairs"):
        rerank(lambda pairs: [0.0], queries, corpus, relevant, {"q": ["a", "b"]})


# ---------------------------------------------------------------------------- similarity


def test_correlations_equal_scipy():
    rng = np.random.default_rng(0)
    for _ in range(50):
        n = int(rng.integers(2, 40))
        x, y = rng.integers(0, 5, n).astype(float), rng.normal(size=n).round(1)  # ties on both sides
        if np.ptp(x) == 0 or np.ptp(y) == 0:
            continue
        np.testing.assert_array_equal(average_ranks(y), scipy.stats.rankdata(y, method="average"))
        assert retrieval_eval.pearson(x, y) == pytest.approx(scipy.stats.pearsonr(x, y)[0], abs=1e-12)
        assert retrieval_eval.spearman(x, y) == pytest.approx(scipy.stats.spearmanr(x, y)[0], abs=1e-12)


@pytest.fixture(scope="module")
def sts_pairs():
    rng = random.Random(3)
    s1 = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 9))) for _ in range(40)]
    s2 = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 9))) for _ in range(40)]
    gold = [rng.randint(0, 10) / 2 for _ in range(40)]  # 0-5 in halves: tied gold scores
    return s1, s2, gold


def test_similarity_equals_the_reference(sts_pairs, st_model, our_encode):
    s1, s2, gold = sts_pairs
    theirs = EmbeddingSimilarityEvaluator(s1, s2, gold)(st_model)
    # The reference's own embeddings (encoded as its evaluator encodes them), then our model's.
    same = similarity_correlation(st_model.encode(s1, batch_size=16), st_model.encode(s2, batch_size=16), gold)
    ours = similarity_correlation(our_encode(s1), our_encode(s2), gold)
    for got in (same, ours):
        assert list(got) == ["pearson_cosine", "spearman_cosine"]
        for key in got:
            assert got[key] == pytest.approx(theirs[key], abs=TOL), key


def test_similarity_rejects_bad_input():
    e = torch.eye(3, 4)  # with itself: every cosine exactly 1
    with pytest.raises(ValueError, match=r"got \(3, 4\), \(3, 4\) and \(2,\)"):
        similarity_correlation(e, e, [1.0, 2.0])
    with pytest.raises(ValueError, match=r"not all equal, got \[1.0, 1.0, 1.0\]"):
        similarity_correlation(e, e, [1.0, 1.0, 1.0])
    assert np.isnan(similarity_correlation(e, e, [1.0, 2.0, 3.0])["pearson_cosine"])
