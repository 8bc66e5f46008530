"""Retrieval training losses, in pure torch: sentence-transformers 6.x's semantics over any embedding or scoring model.

Bi-encoder losses take `embed(features) -> (B, D)`, where `features` is one column's batch (input_ids,
attention_mask, token_type_ids, each (B, T)), and are called with a list of columns, `loss(features, scores)`:

    MultipleNegativesRankingLoss        (anchor, positive, negative_1..n) columns; in-batch negatives
                                        (Henderson et al. 2017, arXiv:1705.00652; InfoNCE, van den Oord et
                                        al. 2018, arXiv:1807.03748), with ST's directions and partition modes
    CachedMultipleNegativesRankingLoss  the same loss by GradCache (Gao et al. 2021, arXiv:2101.06983):
                                        memory of one mini-batch for any batch size
    CoSENTLoss                          (sentence1, sentence2) columns and scores (B,) (Su 2022, CoSENT)
    MatryoshkaLoss                      any of the above at several truncated dimensions (Kusupati et al.
                                        2022, arXiv:2205.13147)

Cross-encoder losses take `score_pairs(firsts, seconds) -> logits (N,)` (a sequence classifier with one
output: BertForSequenceClassification with num_labels=1) and are called with text columns, whatever their
items are (strings, token ids):

    BinaryCrossEntropyLoss                    (first, second) columns and labels or scores in 0..1
    CrossEncoderMultipleNegativesRankingLoss  (anchor, positive, negative_1..n) columns, plus in-batch
                                              negatives drawn by sample_in_batch_negatives

Every class also has its loss as a function of embeddings or logits (`loss_from_embeddings`,
`loss_from_logits`), and `cos_sim` and `multiple_negatives_ranking_loss` are functions, so evaluation
and mining code score with the same similarity. Each loss equals sentence-transformers 6.3's on the
same batch and weights (tests/model/test_retrieval_losses.py), which is the reference for its details:
sentence_transformers/sentence_transformer/losses/ and cross_encoder/losses/. Not carried over: ST's
`gather_across_devices` and its DDP handling of the cached loss's replayed forwards.
"""

from __future__ import annotations

import abc
import logging
import random
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Protocol, cast

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import get_device_states, set_device_states

from model.options import DIRECTIONS, PARTITION_MODES  # declared once, with the job options

log = logging.getLogger(__name__)

Features = dict[str, Tensor]  # one column's batch: input_ids, attention_mask, token_type_ids, each (B, T)
Embed = Callable[[Features], Tensor]  # features -> embeddings (B, D)
ScorePairs = Callable[[Sequence[Any], Sequence[Any]], Tensor]  # (firsts, seconds) -> logits (N,) or (N, 1)


class EmbeddingsLoss(Protocol):
    """A cached loss's second step: whole-batch embeddings -> the loss, backpropagated into their .grad if asked."""

    def __call__(self, embeddings: list[Tensor], *, backward: bool) -> Tensor: ...


HARDNESS_MODES = (None, "in_batch_negatives", "hard_negatives", "all_negatives")


# ---------------------------------------------------------------------------------------------
# Similarity and columns
# ---------------------------------------------------------------------------------------------


def _fp32(x: Tensor) -> Tensor:
    """Half precision up to fp32, as ST's similarities do (a half matmul rounds close scores into ties)."""
    return x.float() if x.is_floating_point() and torch.finfo(x.dtype).bits < 32 else x


def cos_sim(a: Tensor, b: Tensor) -> Tensor:
    """Cosine similarity of every row of `a` (Na, D) with every row of `b` (Nb, D): (Na, Nb) (ST's util.cos_sim)."""
    return F.normalize(_fp32(a), p=2, dim=-1) @ F.normalize(_fp32(b), p=2, dim=-1).T


def pairwise_cos_sim(a: Tensor, b: Tensor) -> Tensor:
    """Cosine similarity of a[i] and b[i]: (N, D), (N, D) -> (N,) (ST's util.pairwise_cos_sim)."""
    return (F.normalize(_fp32(a), p=2, dim=-1) * F.normalize(_fp32(b), p=2, dim=-1)).sum(dim=-1)


def _check_columns(features: Sequence[Features], least: int, most: int | None, name: str) -> list[Features]:
    """The columns as a list, after checking their count and that they hold one batch size."""
    if isinstance(features, dict) or not all(isinstance(f, dict) for f in features):
        raise ValueError(f"{name} takes a list of feature dicts, one per column; got {type(features).__name__}")
    columns = list(features)
    if len(columns) < least or (most is not None and len(columns) > most):
        wanted = f"{least}" if most == least else f"at least {least}" if most is None else f"{least} to {most}"
        raise ValueError(f"{name} takes {wanted} columns, got {len(columns)}")
    sizes = [_batch_size(column) for column in columns]
    if len(set(sizes)) > 1:
        raise ValueError(f"{name}: every column must hold the same number of rows, got {sizes}")
    return columns


def _batch_size(features: Features) -> int:
    tensor = features.get("input_ids", next(iter(features.values()), None))
    if not isinstance(tensor, Tensor) or tensor.dim() < 1:
        raise ValueError(f"a column's features must hold tensors (input_ids, ...), got keys {sorted(features)}")
    return tensor.shape[0]


def embed_columns(embed: Embed, columns: Sequence[Features]) -> list[Tensor]:
    """Each column's embeddings (B, D). The first column (anchors, often short queries) has a forward of its
    own; the others share one, padded to the widest, when they hold the same (B, T) tensors: as ST's
    embed_columns, fewer and larger forwards, and the same embeddings (padding is masked)."""
    first, rest = embed(columns[0]), list(columns[1:])
    if len(rest) < 2 or not _mergeable(rest):
        return [first, *(embed(column) for column in rest)]
    width = max(column["input_ids"].shape[1] for column in rest)
    merged = {key: torch.cat([F.pad(c[key], (0, width - c[key].shape[1])) for c in rest]) for key in rest[0]}
    together = embed(merged)  # (C * B, D), column after column
    return [first, *together.reshape(len(rest), -1, together.shape[-1]).unbind(0)]  # -> (C, B, D) -> C x (B, D)


def _mergeable(columns: list[Features]) -> bool:
    keys = set(columns[0])
    return "input_ids" in keys and all(
        set(c) == keys and all(isinstance(v, Tensor) and v.dim() == 2 and not v.is_floating_point() for v in c.values())
        for c in columns
    )


class _EmbeddingLoss(abc.ABC):
    """What the bi-encoder losses share: the `embed` callable, the columns they take, and their loss as a
    function of the columns' embeddings."""

    least_columns: int = 2
    most_columns: int | None = None

    def __init__(self, embed: Embed):
        self.embed = embed

    def columns(self, features: Sequence[Features]) -> list[Features]:
        return _check_columns(features, self.least_columns, self.most_columns, type(self).__name__)

    def __call__(self, features: Sequence[Features], scores: Tensor | None = None) -> Tensor:
        return self.loss_from_embeddings(embed_columns(self.embed, self.columns(features)), scores)

    @abc.abstractmethod
    def loss_from_embeddings(self, embeddings: list[Tensor], scores: Tensor | None = None) -> Tensor:
        """The loss of the columns' embeddings, each (B, D)."""


# ---------------------------------------------------------------------------------------------
# In-batch negatives
# ---------------------------------------------------------------------------------------------


def check_ranking_options(
    scale: float, directions: Sequence[str], partition_mode: str, hardness_mode: str | None, hardness_strength: float
) -> None:
    """ValueError, quoting the values, for options MultipleNegativesRankingLoss does not take (as ST checks them)."""
    if not scale > 0:
        raise ValueError(f"scale must be > 0, got {scale!r}")
    if not directions or not set(directions) <= set(DIRECTIONS) or "query_to_doc" not in directions:
        raise ValueError(f"directions must include 'query_to_doc' and be among {DIRECTIONS}, got {tuple(directions)}")
    if partition_mode not in PARTITION_MODES:
        raise ValueError(f"partition_mode must be one of {PARTITION_MODES}, got {partition_mode!r}")
    if partition_mode == "per_direction" and set(directions) & {"query_to_query", "doc_to_doc"}:
        # Their candidates never include the positive: a softmax of their own is ill-defined (ST refuses it too).
        raise ValueError(
            f"partition_mode='per_direction' cannot take 'query_to_query' or 'doc_to_doc' (got {tuple(directions)}); "
            "use partition_mode='joint'"
        )
    if hardness_mode not in HARDNESS_MODES:
        raise ValueError(f"hardness_mode must be one of {HARDNESS_MODES}, got {hardness_mode!r}")
    if not hardness_strength >= 0:
        raise ValueError(f"hardness_strength must be >= 0, got {hardness_strength!r}")


def multiple_negatives_ranking_loss(
    anchors: Tensor,
    candidates: Sequence[Tensor] | Tensor,
    *,
    scale: float = 20.0,
    directions: Sequence[str] = ("query_to_doc",),
    partition_mode: str = "joint",
    hardness_mode: str | None = None,
    hardness_strength: float = 0.0,
    rows: Tensor | None = None,
) -> Tensor:
    """MNRL of anchors (B, D) against candidate columns (positives, then any number of hard-negative
    columns, each (B, D)): the mean over anchors of -log softmax of the anchor's positive among the
    scaled cosine similarities (Henderson et al. 2017; InfoNCE). sentence-transformers 6.x's
    MultipleNegativesRankingLoss.compute_loss_from_embeddings, term for term:

    directions      "query_to_doc" (required): anchor i against every candidate of every row;
                    "query_to_query": against the other anchors; "doc_to_query": positive i against every
                    anchor; "doc_to_doc": positive i against the candidates of the other rows
    partition_mode  "joint": one softmax over the chosen directions' scores; "per_direction": one
                    log-partition per direction, averaged
    hardness_mode   adds hardness_strength * cos (not scaled, no gradient) to the logits of the in-batch
                    negatives, the hard negatives or all negatives (Lan et al. 2025; EmbeddingGemma)
    rows            the anchors (indices) to average over, all by default: GradCache's chunks of the
                    score matrix (the other rows still serve as negatives)
    """
    check_ranking_options(scale, directions, partition_mode, hardness_mode, hardness_strength)
    docs = _candidate_columns(anchors, candidates)
    batch = anchors.shape[0]
    rows = torch.arange(batch, device=anchors.device) if rows is None else rows
    arange = torch.arange(len(rows), device=anchors.device)
    every_doc = torch.cat(docs)  # (C * B, D): the positives, then each hard-negative column
    queries, positives = anchors[rows], docs[0][rows]  # (R, D)
    own = torch.zeros(len(rows), batch, dtype=torch.bool, device=anchors.device)
    own[arange, rows] = True  # (R, B): each row's own column
    own_docs = own.repeat(1, len(docs))  # (R, C * B): each row's positive and its hard negatives

    sims = {"query_to_doc": cos_sim(queries, every_doc)}  # (R, C * B)
    if "query_to_query" in directions:
        sims["query_to_query"] = cos_sim(queries, anchors).masked_fill(own, -torch.inf)  # (R, B), not itself
    if "doc_to_query" in directions:
        sims["doc_to_query"] = cos_sim(anchors, positives).T  # (R, B)
    if "doc_to_doc" in directions:
        sims["doc_to_doc"] = cos_sim(every_doc, positives).T.masked_fill(own_docs, -torch.inf)  # (R, C * B)
    logits = {direction: sim * scale for direction, sim in sims.items()}
    if hardness_mode is not None and hardness_strength > 0:
        penalty = _hardness_penalty(sims["query_to_doc"], own_docs, batch, hardness_mode, hardness_strength)
        logits["query_to_doc"] = logits["query_to_doc"] + penalty

    positive = logits["query_to_doc"][arange, rows]  # (R,)
    if partition_mode == "joint":
        log_z = torch.logsumexp(torch.cat(list(logits.values()), dim=1), dim=1)
    else:
        log_z = torch.stack([torch.logsumexp(scores, dim=1) for scores in logits.values()]).sum(0) / len(logits)
    return (log_z - positive).mean()


def _candidate_columns(anchors: Tensor, candidates: Sequence[Tensor] | Tensor) -> list[Tensor]:
    docs = [candidates] if isinstance(candidates, Tensor) else list(candidates)
    if anchors.dim() != 2 or not docs or any(d.shape != anchors.shape for d in docs):
        raise ValueError(
            f"anchors must be (B, D) and candidates one or more (B, D) columns like them; "
            f"got {tuple(anchors.shape)} and {[tuple(d.shape) for d in docs]}"
        )
    return docs


def _hardness_penalty(sims: Tensor, own_docs: Tensor, batch: int, mode: str, strength: float) -> Tensor:
    """strength * cos, without gradient, on the negatives the mode names (ST 6.x; Lan et al. 2025, eq. 5)."""
    if mode == "hard_negatives":  # a row's own hard negatives only
        spared = ~own_docs
        spared[:, :batch] = True
    elif mode == "in_batch_negatives":  # the other rows' candidates only
        spared = own_docs
    else:  # all_negatives: everything but the positive
        spared = own_docs.clone()
        spared[:, batch:] = False
    return (strength * sims.detach()).masked_fill(spared, 0.0)


class MultipleNegativesRankingLoss(_EmbeddingLoss):
    """In-batch negatives over (anchor, positive, negative_1, ..., negative_n) columns (n >= 0): each
    anchor must find its positive among every candidate of the batch (Henderson et al. 2017; InfoNCE,
    van den Oord et al. 2018). ST 6.x's MultipleNegativesRankingLoss with cosine similarity; the options
    are `multiple_negatives_ranking_loss`'s."""

    def __init__(
        self,
        embed: Embed,
        scale: float = 20.0,
        directions: Sequence[str] = ("query_to_doc",),
        partition_mode: str = "joint",
        hardness_mode: str | None = None,
        hardness_strength: float = 0.0,
    ):
        super().__init__(embed)
        check_ranking_options(scale, directions, partition_mode, hardness_mode, hardness_strength)
        if hardness_mode is not None and hardness_strength == 0:
            log.warning("hardness_mode=%r with hardness_strength=0 has no effect", hardness_mode)
        self.options: dict[str, Any] = dict(
            scale=scale,
            directions=tuple(directions),
            partition_mode=partition_mode,
            hardness_mode=hardness_mode,
            hardness_strength=hardness_strength,
        )

    def loss_from_embeddings(self, embeddings: list[Tensor], scores: Tensor | None = None) -> Tensor:
        """The loss of [anchors, positives, negatives...] embeddings; `scores` are not used."""
        return multiple_negatives_ranking_loss(embeddings[0], embeddings[1:], **self.options)


# ---------------------------------------------------------------------------------------------
# GradCache
# ---------------------------------------------------------------------------------------------


class RandContext:
    """The CPU and accelerator random states when made, restored on entering (the outer states come back on
    leaving): a forward run again under it draws the same dropout masks. GradCache's RandContext, as ST's."""

    def __init__(self, *tensors: Tensor):
        self.cpu_state = torch.get_rng_state()
        self.devices, self.device_states = get_device_states(*tensors)

    def __enter__(self) -> None:
        self._fork = torch.random.fork_rng(devices=self.devices)
        self._fork.__enter__()
        torch.set_rng_state(self.cpu_state)
        set_device_states(self.devices, self.device_states)

    def __exit__(self, *exc: Any) -> None:
        self._fork.__exit__(*exc)


def mini_batch(features: Features, begin: int, end: int) -> Features:
    """Rows begin:end of a column, cut after the last position any of them attends to (as ST's
    _create_minibatch), so a mini-batch of short texts is not embedded at the whole batch's width."""
    part = {key: value[begin:end] for key, value in features.items()}
    mask = part.get("attention_mask")
    if mask is None or mask.dim() != 2:
        return part
    active = mask.bool().any(dim=0).nonzero()
    width = int(active.max()) + 1 if len(active) else mask.shape[1]
    return {k: v[:, :width] if v.dim() >= 2 and v.shape[1] == mask.shape[1] else v for k, v in part.items()}


def _replay(
    grad_output: Tensor,
    *,
    embed: Embed,
    columns: list[Features],
    ranges: list[tuple[int, int]],
    states: list[list[RandContext]],
    grads: list[Tensor],
    autocast: tuple[str, torch.dtype, bool],
) -> None:
    """GradCache's third step, run by the loss's backward hook: each mini-batch embedded again with
    gradients, under its first forward's random state and autocast (a backward runs outside the caller's
    autocast block), and the cached gradient of its embeddings backpropagated into the model, scaled by
    the loss's own gradient (a 1/accum, a loss scaler's factor)."""
    device_type, dtype, enabled = autocast
    with torch.enable_grad():
        for column, column_states, grad in zip(columns, states, grads):
            for (begin, end), state in zip(ranges, column_states):
                with state, torch.autocast(device_type, dtype=dtype, enabled=enabled):
                    reps = embed(mini_batch(column, begin, end))  # (b, D)
                wide = torch.promote_types(torch.promote_types(reps.dtype, grad.dtype), torch.float32)  # >= fp32
                surrogate = torch.dot(reps.flatten().to(wide), grad[begin:end].flatten().to(wide))
                (surrogate * grad_output).backward()


class CachedMultipleNegativesRankingLoss(_EmbeddingLoss):
    """MultipleNegativesRankingLoss by GradCache (Gao et al. 2021): its loss and gradients at any batch size,
    with the activations of `mini_batch_size` rows at a time (ST 6.x's CachedMultipleNegativesRankingLoss).

    1. Every column is embedded without gradients, mini-batch by mini-batch, each one's random state kept.
    2. The loss of the whole batch's embeddings is computed `mini_batch_size` anchors at a time, each part
       backpropagated into the embeddings at once: their gradients are the cache.
    3. The returned loss is a leaf whose backward hook embeds each mini-batch again, with gradients and
       under its kept random state (the same dropout), and backpropagates its cached gradient times the
       loss's own gradient. A caller only calls `loss.backward()`; `(loss / accum).backward()` scales it.

    Under torch.no_grad() only steps 1 and 2 run, without backward. Not for DistributedDataParallel as it
    stands: the replayed forwards would need DDP's no_sync handling (ST's _ddp_replay_context)."""

    def __init__(
        self,
        embed: Embed,
        scale: float = 20.0,
        mini_batch_size: int = 32,
        directions: Sequence[str] = ("query_to_doc",),
        partition_mode: str = "joint",
        hardness_mode: str | None = None,
        hardness_strength: float = 0.0,
    ):
        super().__init__(embed)
        if not isinstance(mini_batch_size, int) or mini_batch_size < 1:
            raise ValueError(f"mini_batch_size must be an integer >= 1, got {mini_batch_size!r}")
        self.mini_batch_size = mini_batch_size
        self.ranking = MultipleNegativesRankingLoss(
            embed, scale, directions, partition_mode, hardness_mode, hardness_strength
        )

    def __call__(self, features: Sequence[Features], scores: Tensor | None = None) -> Tensor:
        return self.grad_cache(features, self.loss_from_embeddings)

    def loss_from_embeddings(
        self, embeddings: list[Tensor], scores: Tensor | None = None, *, backward: bool = False
    ) -> Tensor:
        """The loss of the whole batch's embeddings, `mini_batch_size` anchors at a time; with `backward`, each
        part is backpropagated into the embeddings' .grad as soon as it is computed (so no part's score
        matrix outlives it) and the total comes back detached."""
        batch, parts = embeddings[0].shape[0], []
        for begin in range(0, batch, self.mini_batch_size):
            rows = torch.arange(begin, min(begin + self.mini_batch_size, batch), device=embeddings[0].device)
            part = multiple_negatives_ranking_loss(embeddings[0], embeddings[1:], rows=rows, **self.ranking.options)
            part = part * len(rows) / batch
            if backward:
                part.backward()
                part = part.detach()
            parts.append(part)
        return torch.stack(parts).sum()

    def grad_cache(self, features: Sequence[Features], loss_fn: EmbeddingsLoss) -> Tensor:
        """Steps 1 to 3 with `loss_fn(embeddings, backward)` as step 2 (MatryoshkaLoss gives its own)."""
        columns = self.columns(features)
        batch, size = _batch_size(columns[0]), self.mini_batch_size
        ranges = [(begin, min(begin + size, batch)) for begin in range(0, batch, size)]
        with_grad = torch.is_grad_enabled()
        embeddings, states = [], []
        for column in columns:
            reps, column_states = [], []
            for begin, end in ranges:
                part = mini_batch(column, begin, end)
                if with_grad:  # only a backward replays it
                    column_states.append(RandContext(*part.values()))
                with torch.no_grad():
                    reps.append(self.embed(part))
            embeddings.append(torch.cat(reps).requires_grad_(with_grad))  # (B, D), a leaf
            states.append(column_states)
        if not with_grad:
            return loss_fn(embeddings, backward=False)
        loss = loss_fn(embeddings, backward=True).detach().requires_grad_()
        grads = [e.grad for e in embeddings if e.grad is not None]
        assert len(grads) == len(embeddings), "the loss left a column out"  # MNRL reads every column
        device_type = columns[0].get("input_ids", next(iter(columns[0].values()))).device.type
        autocast = (device_type, torch.get_autocast_dtype(device_type), torch.is_autocast_enabled(device_type))
        replay = partial(
            _replay, embed=self.embed, columns=columns, ranges=ranges, states=states, grads=grads, autocast=autocast
        )
        loss.register_hook(replay)
        return loss


# ---------------------------------------------------------------------------------------------
# CoSENT
# ---------------------------------------------------------------------------------------------


def cosent_loss(first: Tensor, second: Tensor, scores: Tensor, scale: float = 20.0) -> Tensor:
    """CoSENT (Su 2022): log(1 + sum over pairs (i, j) with scores[i] > scores[j] of
    exp(scale * (cos_j - cos_i))), cos_i the cosine of first[i] and second[i]: every pair of rows ranked
    as their scores rank them. ST 6.x's CoSENTLoss, with its O(B log B) sum (a sort and a suffix
    logsumexp) in place of the (B, B) matrix."""
    if scores.numel() != first.shape[0]:
        raise ValueError(f"CoSENTLoss takes one score per row: {first.shape[0]} rows, scores {tuple(scores.shape)}")
    cos = pairwise_cos_sim(first, second) * scale  # (B,)
    labels, order = (scores.int() if scores.dtype == torch.bool else scores).view(-1).sort()
    cos = cos[order]
    # For each row: logsumexp of -cos over the rows of strictly higher scores (ties excluded).
    higher = torch.searchsorted(labels, labels, right=True)
    suffix = torch.logcumsumexp(-cos.flip(0), dim=0).flip(0)
    suffix = torch.cat((suffix, cos.new_full((1,), -torch.inf)))
    return torch.logsumexp(torch.cat((cos.new_zeros(1), cos + suffix[higher])), dim=0)


class CoSENTLoss(_EmbeddingLoss):
    """CoSENT (Su 2022) over (sentence1, sentence2) columns with a score per pair (e.g. 0..1): ST 6.x's
    CoSENTLoss with cosine similarity."""

    least_columns, most_columns = 2, 2

    def __init__(self, embed: Embed, scale: float = 20.0):
        super().__init__(embed)
        self.scale = scale

    def loss_from_embeddings(self, embeddings: list[Tensor], scores: Tensor | None = None) -> Tensor:
        if scores is None:
            raise ValueError("CoSENTLoss needs scores, one per pair: (B,)")
        return cosent_loss(embeddings[0], embeddings[1], scores, self.scale)


# ---------------------------------------------------------------------------------------------
# Matryoshka
# ---------------------------------------------------------------------------------------------


def shrink(embeddings: Tensor, dim: int) -> Tensor:
    """The first `dim` features, normalised to unit length (in fp32 for half inputs): ST's matryoshka shrink."""
    if dim > embeddings.shape[-1]:
        raise ValueError(f"matryoshka dimension {dim} exceeds the embeddings' dimension {embeddings.shape[-1]}")
    return F.normalize(_fp32(embeddings[..., :dim]), p=2, dim=-1).to(embeddings.dtype)


class MatryoshkaLoss:
    """A loss at several embedding dimensions at once (Kusupati et al. 2022): the weighted sum of `loss` on
    the embeddings truncated to each of `matryoshka_dims` (and normalised), from one forward pass. ST 6.x's
    MatryoshkaLoss; over CachedMultipleNegativesRankingLoss the truncation happens in GradCache's second
    step, so the memory stays one mini-batch's. `n_dims_per_step` > 0 draws that many dimensions a call
    (Python's `random`, as ST)."""

    def __init__(
        self,
        loss: MultipleNegativesRankingLoss | CachedMultipleNegativesRankingLoss | CoSENTLoss,
        matryoshka_dims: Sequence[int],
        matryoshka_weights: Sequence[float] | None = None,
        n_dims_per_step: int = -1,
    ):
        if not isinstance(loss, (MultipleNegativesRankingLoss, CachedMultipleNegativesRankingLoss, CoSENTLoss)):
            raise ValueError(f"MatryoshkaLoss wraps a bi-encoder loss of this module, got {type(loss).__name__}")
        if not matryoshka_dims or any(not isinstance(d, int) or d <= 0 for d in matryoshka_dims):
            raise ValueError(f"matryoshka_dims must be one or more integers > 0, got {list(matryoshka_dims)}")
        weights = [1.0] * len(matryoshka_dims) if matryoshka_weights is None else list(matryoshka_weights)
        if len(weights) != len(matryoshka_dims):
            raise ValueError(f"{len(weights)} matryoshka_weights for {len(matryoshka_dims)} matryoshka_dims")
        self.loss = loss
        self.dims = sorted(zip(matryoshka_dims, weights), key=lambda dw: dw[0], reverse=True)  # largest first
        self.n_dims_per_step = n_dims_per_step

    def __call__(self, features: Sequence[Features], scores: Tensor | None = None) -> Tensor:
        dims = self._dims_this_call()
        if isinstance(self.loss, CachedMultipleNegativesRankingLoss):
            return self.loss.grad_cache(features, partial(self._cached_loss, dims))
        embeddings = embed_columns(self.loss.embed, self.loss.columns(features))
        losses = [w * self.loss.loss_from_embeddings([shrink(e, d) for e in embeddings], scores) for d, w in dims]
        return torch.stack(losses).sum()

    def _dims_this_call(self) -> list[tuple[int, float]]:
        if 0 < self.n_dims_per_step < len(self.dims):
            return [self.dims[i] for i in sorted(random.sample(range(len(self.dims)), self.n_dims_per_step))]
        return self.dims

    def _cached_loss(self, dims: list[tuple[int, float]], embeddings: list[Tensor], *, backward: bool) -> Tensor:
        """GradCache's second step at each dimension: the cached loss of the truncated embeddings, and with
        `backward` its gradients carried back through the truncation into the full embeddings' .grad."""
        assert isinstance(self.loss, CachedMultipleNegativesRankingLoss)
        total = []
        for dim, weight in dims:
            truncated = [shrink(e, dim) for e in embeddings]
            if not backward:
                total.append(weight * self.loss.loss_from_embeddings(truncated))
                continue
            leaves = [t.detach().requires_grad_() for t in truncated]
            total.append(weight * self.loss.loss_from_embeddings(leaves, backward=True))
            torch.autograd.backward(truncated, [weight * cast(Tensor, leaf.grad) for leaf in leaves])
        return torch.stack(total).sum()


# ---------------------------------------------------------------------------------------------
# Cross-encoder losses
# ---------------------------------------------------------------------------------------------


def _check_text_columns(columns: Sequence[Sequence[Any]], least: int, most: int | None, name: str) -> int:
    """The batch size of text columns, after checking their count and lengths."""
    if len(columns) < least or (most is not None and len(columns) > most):
        wanted = f"{least}" if most == least else f"at least {least}"
        raise ValueError(f"{name} takes {wanted} columns, got {len(columns)}")
    sizes = [len(column) for column in columns]
    if len(set(sizes)) > 1 or sizes[0] == 0:
        raise ValueError(f"{name}: every column must hold the same number of rows (> 0), got {sizes}")
    return sizes[0]


def _logits(score_pairs: ScorePairs, firsts: Sequence[Any], seconds: Sequence[Any]) -> Tensor:
    logits = score_pairs(firsts, seconds)
    if logits.numel() != len(firsts):
        raise ValueError(f"score_pairs must give one logit per pair: {len(firsts)} pairs, {tuple(logits.shape)}")
    return logits.reshape(-1)


class BinaryCrossEntropyLoss:
    """Binary cross-entropy on the logit of each (first, second) pair against its label (0 or 1) or score in
    0..1, `pos_weight` weighing the positives (torch's BCEWithLogitsLoss): ST 6.x's cross-encoder
    BinaryCrossEntropyLoss with its identity activation."""

    def __init__(self, score_pairs: ScorePairs, pos_weight: float | Tensor | None = None):
        self.score_pairs = score_pairs
        self.pos_weight = pos_weight

    def __call__(self, columns: Sequence[Sequence[Any]], labels: Tensor) -> Tensor:
        _check_text_columns(columns, 2, 2, "BinaryCrossEntropyLoss")
        return self.loss_from_logits(_logits(self.score_pairs, columns[0], columns[1]), labels)

    def loss_from_logits(self, logits: Tensor, labels: Tensor) -> Tensor:
        """The loss of logits (B,) or (B, 1) against labels (B,)."""
        logits = logits.reshape(-1)
        if labels.numel() != logits.numel():
            raise ValueError(f"one label per pair: {logits.numel()} pairs, labels {tuple(labels.shape)}")
        pos_weight = None
        if self.pos_weight is not None:
            pos_weight = torch.as_tensor(self.pos_weight, dtype=torch.float32, device=logits.device)
        return F.binary_cross_entropy_with_logits(logits, labels.reshape(-1).float(), pos_weight=pos_weight)


def sample_in_batch_negatives(
    batch_size: int, num_columns: int, num_negatives: int | None = 4, generator: torch.Generator | None = None
) -> Tensor:
    """In-batch negatives for each anchor: (B, k) indices into the candidates flattened column after column
    (column c's row j is c * B + j), drawn without replacement from the other rows' candidates (its own
    positive and hard negatives left out). All of them, in order, when `num_negatives` is None or not
    fewer. ST 6.x's rule (get_in_batch_negatives): the same draw as ST's for the same generator state
    (ST draws from torch's global generator, which `generator=None` uses too)."""
    if num_negatives is not None and (not isinstance(num_negatives, int) or num_negatives < 0):
        raise ValueError(f"num_negatives must be None or an integer >= 0, got {num_negatives!r}")
    others = ~torch.eye(batch_size, dtype=torch.bool).repeat(1, num_columns)  # (B, C * B)
    if num_negatives is not None and num_negatives < num_columns * (batch_size - 1):
        if num_negatives == 0:
            return torch.zeros(batch_size, 0, dtype=torch.long)
        return torch.multinomial(others.float(), num_negatives, generator=generator)
    return torch.arange(batch_size * num_columns).repeat(batch_size, 1)[others].reshape(batch_size, -1)


class CrossEncoderMultipleNegativesRankingLoss:
    """In-batch negatives for a cross-encoder (Henderson et al. 2017): each anchor's positive must score
    highest among it, `num_negatives` other rows' candidates (sample_in_batch_negatives) and its own hard
    negatives, by cross-entropy over activation(logit) * scale. ST 6.x's cross-encoder
    MultipleNegativesRankingLoss, its defaults included (4 negatives, sigmoid, scale 10); all pairs are
    scored in one call of `score_pairs`."""

    def __init__(
        self,
        score_pairs: ScorePairs,
        num_negatives: int | None = 4,
        scale: float | None = 10.0,
        activation: Callable[[Tensor], Tensor] | None = torch.sigmoid,
    ):
        if num_negatives is not None and (not isinstance(num_negatives, int) or num_negatives < 0):
            raise ValueError(f"num_negatives must be None or an integer >= 0, got {num_negatives!r}")
        self.score_pairs, self.num_negatives = score_pairs, num_negatives
        self.scale, self.activation = scale, activation

    def __call__(self, columns: Sequence[Sequence[Any]], generator: torch.Generator | None = None) -> Tensor:
        """The loss of (anchor, positive, negative_1..n) columns; the in-batch negatives drawn with `generator`."""
        batch = _check_text_columns(columns, 2, None, type(self).__name__)
        candidates = [item for column in columns[1:] for item in column]  # column after column
        sampled = sample_in_batch_negatives(batch, len(columns) - 1, self.num_negatives, generator)  # (B, k)
        own = torch.arange(batch)[:, None] + batch * torch.arange(len(columns) - 1)  # (B, 1 + n): positive, hard
        table = torch.cat([own[:, :1], sampled, own[:, 1:]], dim=1)  # (B, 1 + k + n)
        anchors = [columns[0][i] for _ in range(table.shape[1]) for i in range(batch)]
        seconds = [candidates[j] for j in table.T.reshape(-1).tolist()]
        logits = _logits(self.score_pairs, anchors, seconds).view(table.shape[1], batch).T  # (B, 1 + k + n)
        return self.loss_from_logits(logits)

    def loss_from_logits(self, logits: Tensor) -> Tensor:
        """The loss of logits (B, 1 + negatives) whose first column is each anchor's positive."""
        if self.activation is not None:
            logits = self.activation(logits)
        if self.scale:
            logits = logits * self.scale
        return F.cross_entropy(logits, torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device))
