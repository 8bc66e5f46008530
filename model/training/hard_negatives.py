"""Hard-negative mining, as sentence-transformers' `mine_hard_negatives` mines them (its "n-tuple" output,
no cross-encoder): each anchor's nearest corpus texts by cosine that are not its positives become its
negatives.

    plan = MiningPlan.of(pairs, extra_corpus)        # distinct queries and corpus texts, positives by row
    found = mine(query_emb, corpus_emb, plan, MiningOptions(num_negatives=3, range_min=10))
    rows = plan.tuples(found)                          # (anchor, positive, negatives); short ones dropped

The reference's rules, kept here:
- the corpus is the extra corpus, then the positives, each text once (its first place kept); the queries are
  the anchors, each once. An anchor's positives are every positive its rows pair it with, each once.
- each query's candidates are its range_max + max_positives + 1 nearest corpus texts (exact cosine search,
  retrieval_eval.search), less its own text (when it is in the corpus) and its positives;
- then the filters: absolute_margin and relative_margin against the query's lowest positive score (a candidate
  scoring above `lowest - absolute_margin`, or above `lowest - |lowest| * relative_margin`, goes), max_score
  (above it goes) and min_score (below it goes);
- of the candidates left, best first, the first range_min are skipped; "top" keeps the next num_negatives,
  "random" draws num_negatives of the rest (Python's `random.sample` once per query, in query order, from a
  `random.Random(seed)`; the reference draws from the global generator) and keeps them in score order;
- one row per (anchor, positive), anchors in first-seen order; a row whose anchor has fewer than
  num_negatives negatives left is dropped.
- range_max, unset: range_min + num_negatives + max_positives, or range_min + 10 * num_negatives +
  max_positives when a margin or max_score is set (some candidates will be filtered out); max_positives is
  the most rows one anchor has (duplicates counted, as the reference's groupby counts them).

Reference: sentence-transformers 6.x, sentence_transformers/util/hard_negatives.py (mine_hard_negatives);
Moreira et al. 2024, "NV-Retriever: Improving text embedding models with effective hard-negative mining"
(the margins).
"""

from __future__ import annotations

import collections
import random
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F

from model.data.pairs import NEGATIVE
from model.training.retrieval_eval import search

SAMPLING_STRATEGIES = ("top", "random")
FILTER_FACTOR = 10  # candidates per negative kept by the default range_max when a filter will drop some


@dataclass(frozen=True)
class MiningOptions:
    """The reference's options that shape which negatives are kept (their names and defaults, but range_min)."""

    num_negatives: int = 3
    range_min: int = 0
    range_max: int | None = None
    max_score: float | None = None
    min_score: float | None = None
    absolute_margin: float | None = None
    relative_margin: float | None = None
    sampling_strategy: Literal["top", "random"] = "top"
    seed: int = 0  # for "random"

    @property
    def filters(self) -> bool:
        """Whether a filter that the default range_max makes room for is set (min_score is not one: the
        reference widens the range for it only with a cross-encoder)."""
        return any(v is not None for v in (self.absolute_margin, self.relative_margin, self.max_score))

    def ranks(self, max_positives: int = 0) -> int:
        """range_max: as set, else its default for anchors with at most `max_positives` positives."""
        if self.range_max is not None:
            return self.range_max
        return self.range_min + self.num_negatives * (FILTER_FACTOR if self.filters else 1) + max_positives

    def check(self) -> None:
        """The reference's ValueErrors, quoting the values; none depends on the data."""
        if self.num_negatives < 1:
            raise ValueError(f"num_negatives must be at least 1, got {self.num_negatives}")
        if self.range_min < 0:
            raise ValueError(f"range_min must be non-negative, got {self.range_min}")
        if self.sampling_strategy not in SAMPLING_STRATEGIES:
            raise ValueError(f"sampling_strategy must be one of {SAMPLING_STRATEGIES}, got {self.sampling_strategy!r}")
        if self.range_max is None:  # the default leaves num_negatives candidates past range_min
            return
        if self.range_min >= self.range_max:
            raise ValueError(
                f"range_min must be smaller than range_max, got range_min={self.range_min} and "
                f"range_max={self.range_max}"
            )
        left = self.range_max - self.range_min
        if self.num_negatives > left:
            raise ValueError(
                f"cannot mine {self.num_negatives} negatives per anchor: only {left} candidate{'s' * (left != 1)} "
                f"remain{'s' * (left == 1)} after skipping the first range_min={self.range_min} of "
                f"range_max={self.range_max}"
            )


@dataclass
class MiningPlan:
    """What is embedded and how the rows refer to it: distinct queries, distinct corpus texts, each query's
    positives (corpus rows) and its own corpus row (-1: none)."""

    queries: list[str]
    corpus: list[str]
    positives: list[list[int]]
    query_rows: list[int]
    max_positives: int

    @classmethod
    def of(cls, pairs: Iterable[tuple[str, str]], extra_corpus: Iterable[str] = ()) -> MiningPlan:
        """From (anchor, positive) pairs, in order, and texts to mine from besides their positives."""
        pairs = list(pairs)
        if not pairs:
            raise ValueError("there are no (anchor, positive) pairs to mine negatives for")
        corpus = list(dict.fromkeys([*extra_corpus, *(positive for _, positive in pairs)]))
        row_of = {text: i for i, text in enumerate(corpus)}
        queries = list(dict.fromkeys(anchor for anchor, _ in pairs))
        query_of = {text: i for i, text in enumerate(queries)}
        positives: list[dict[int, None]] = [{} for _ in queries]  # ordered sets
        for anchor, positive in pairs:
            positives[query_of[anchor]][row_of[positive]] = None
        rows_per_anchor = collections.Counter(anchor for anchor, _ in pairs)
        return cls(
            queries=queries,
            corpus=corpus,
            positives=[list(p) for p in positives],
            query_rows=[row_of.get(q, -1) for q in queries],
            max_positives=max(rows_per_anchor.values()),
        )

    def tuples(self, found: Mined) -> list[tuple[str, str, list[str]]]:
        """(anchor, positive, negatives) for each (anchor, positive) whose anchor got every negative."""
        complete = torch.isfinite(found.scores).all(dim=1).tolist()
        picked = found.negatives.tolist()
        return [
            (self.queries[q], self.corpus[p], [self.corpus[i] for i in picked[q]])
            for q, positives in enumerate(self.positives)
            if complete[q]
            for p in positives
        ]

    @property
    def pairs(self) -> int:
        """The distinct (anchor, positive) pairs: the rows mining can give."""
        return sum(len(p) for p in self.positives)


class Mined(NamedTuple):
    """Each query's negatives: (Q, num_negatives) corpus rows and their cosine scores, best first; a score of
    -inf marks a place no candidate filled (its rows are then dropped)."""

    negatives: torch.Tensor
    scores: torch.Tensor


def mine(query_emb: torch.Tensor, corpus_emb: torch.Tensor, plan: MiningPlan, options: MiningOptions) -> Mined:
    """The negatives of each of plan.queries (embedded as `query_emb`) among plan.corpus (`corpus_emb`)."""
    options.check()
    if (len(query_emb), len(corpus_emb)) != (len(plan.queries), len(plan.corpus)):
        raise ValueError(
            f"{len(query_emb)} query and {len(corpus_emb)} corpus embeddings for {len(plan.queries)} queries and "
            f"{len(plan.corpus)} corpus texts"
        )
    range_max = options.ranks(plan.max_positives)
    width = range_max + plan.max_positives + 1  # room for the query itself and its positives
    scores, rows = _candidates(query_emb, corpus_emb, width)
    excluded = (rows == -1) | (rows == torch.tensor(plan.query_rows).unsqueeze(1)) | _positive(plan, rows)
    scores = scores.masked_fill(excluded, -float("inf"))
    scores = _filtered(scores, _lowest_positive_scores(query_emb, corpus_emb, plan), options)
    scores, order = scores.sort(dim=1, descending=True, stable=True)  # equal scores keep the search's order
    scores, rows = scores[:, options.range_min : range_max], rows.gather(1, order)[:, options.range_min : range_max]
    if options.sampling_strategy == "top":
        return Mined(rows[:, : options.num_negatives], scores[:, : options.num_negatives])
    return _sampled(rows, scores, options)


def _candidates(query_emb: torch.Tensor, corpus_emb: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(Q, width) cosine scores and corpus rows, best first; past the corpus's end -inf and -1."""
    scores, rows = search(query_emb, corpus_emb, width)
    missing = width - scores.shape[1]
    if missing > 0:
        scores = torch.cat([scores, scores.new_full((len(scores), missing), -float("inf"))], dim=1)
        rows = torch.cat([rows, rows.new_full((len(rows), missing), -1)], dim=1)
    return scores, rows


def _positive(plan: MiningPlan, rows: torch.Tensor) -> torch.Tensor:
    """(Q, width): whether each candidate is one of its query's positives, by (query, row) keys searched in
    the sorted keys of the positives (the reference's way: no Python loop over the candidates)."""
    stride = len(plan.corpus) + 1  # a key for the -1 padding too
    keys = torch.tensor([q * stride + p + 1 for q, ps in enumerate(plan.positives) for p in ps]).sort().values
    candidate = torch.arange(len(rows)).unsqueeze(1) * stride + rows + 1
    at = torch.searchsorted(keys, candidate).clamp(max=len(keys) - 1)
    return keys[at] == candidate


def _lowest_positive_scores(query_emb: torch.Tensor, corpus_emb: torch.Tensor, plan: MiningPlan) -> torch.Tensor:
    """(Q,): the cosine of each query to its least similar positive (the margins are kept from it)."""
    queries = torch.tensor([q for q, ps in enumerate(plan.positives) for _ in ps])
    positives = torch.tensor([p for ps in plan.positives for p in ps])
    cosine = (F.normalize(query_emb[queries].float(), dim=-1) * F.normalize(corpus_emb[positives].float(), dim=-1)).sum(
        -1
    )
    lowest = torch.full((len(plan.queries),), float("inf"))
    return lowest.scatter_reduce(0, queries, cosine, reduce="amin")


def _filtered(scores: torch.Tensor, lowest: torch.Tensor, options: MiningOptions) -> torch.Tensor:
    """The candidates' scores with those the margins, max_score and min_score drop set to -inf."""
    lowest = lowest.unsqueeze(1)
    drop = torch.zeros_like(scores, dtype=torch.bool)
    if options.absolute_margin is not None:
        drop |= scores + options.absolute_margin > lowest
    if options.relative_margin is not None:
        drop |= scores > lowest - lowest.abs() * options.relative_margin
    if options.max_score is not None:
        drop |= scores > options.max_score
    if options.min_score is not None:
        drop |= scores < options.min_score
    return scores.masked_fill(drop, -float("inf"))


def _sampled(rows: torch.Tensor, scores: torch.Tensor, options: MiningOptions) -> Mined:
    """num_negatives of each query's candidates at random, then best first. A query with fewer candidates
    than that draws among the empty places too, and its row is dropped (as the reference)."""
    rng, n = random.Random(options.seed), options.num_negatives
    left = (scores.shape[1] - torch.isinf(scores).sum(1)).clamp(min=n).tolist()
    drawn = torch.tensor([rng.sample(range(k), k=n) for k in left], dtype=torch.long).view(len(rows), n)
    rows, scores = rows.gather(1, drawn), scores.gather(1, drawn)
    scores, order = scores.sort(dim=1, descending=True, stable=True)
    return Mined(rows.gather(1, order), scores)


def negative_columns(n: int) -> list[str]:
    """The mined rows' negative columns, as the reference names them: negative_1 .. negative_n."""
    return [f"{NEGATIVE}_{i}" for i in range(1, n + 1)]
