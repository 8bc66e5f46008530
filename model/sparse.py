"""SPLADE sparse embeddings: one weight per vocabulary token, from the masked-LM head's logits.

A token's weight is log(1 + relu(logit)) at each position the attention mask keeps ([CLS] and [SEP]
included, padding never), max-pooled over the positions (SPLADE v2's pooling; "sum" is SPLADE v1's),
as sentence-transformers' SpladePooling computes it over MLMTransformer's logits and
text-embeddings-inference's `--pooling splade` does. The (batch, length, vocabulary) logits are never
made: the head runs over the kept tokens in chunks of at most CHUNK_VALUES logits, each chunk reduced
into the (batch, vocabulary) result as it goes.

References: Formal et al., "SPLADE v2" (2021), arXiv:2109.10086; sentence-transformers
(sparse_encoder/modules/splade_pooling.py).
"""

from __future__ import annotations

import torch

from model.modeling import BertLMPredictionHead
from model.sentence_modules import Splade

CHUNK_VALUES = 1 << 22  # logits in one chunk of the head's output (16 MiB in fp32)
SPLADE = Splade()  # SPLADE v2: max over the tokens of log(1 + relu(logit)); what a model without its files gets


def activate(logits: torch.Tensor, activation: str) -> torch.Tensor:
    """SpladePooling's activation, in place on float32 `logits`: "relu" is log(1 + relu(x)), "log1p_relu"
    applies log1p once more."""
    weights = logits.relu_().log1p_()
    return weights.log1p_() if activation == "log1p_relu" else weights


def splade_vectors(
    head: BertLMPredictionHead,
    hidden: torch.Tensor,
    attention_mask: torch.Tensor,
    splade: Splade = SPLADE,
    chunk_values: int = CHUNK_VALUES,
) -> torch.Tensor:
    """(B, T, H) last hidden states and their (B, T) attention mask (on any device: read where it is)
    -> (B, V) float32 SPLADE vectors, the MLM `head` run over the kept tokens in chunks of at most
    `chunk_values` logits. With "max", the logits are max-reduced first and activated once: the
    activation is non-decreasing, so the max of the activations is the activation of the max (and the
    log1p of a (B, V) vector, not of every token's)."""
    B, T, H = hidden.shape
    V = head.bias.shape[0]
    rows = attention_mask.reshape(-1).nonzero().squeeze(1).to(hidden.device)  # (B, T) -> kept flat indices
    owners = rows // T  # each kept token's batch row
    tokens = hidden.reshape(B * T, H).index_select(0, rows)  # (B, T, H) -> (N, H)
    out = torch.zeros(B, V, device=hidden.device)  # 0: relu's floor, so the max needs no relu of its own
    step = max(1, chunk_values // V)
    for start in range(0, tokens.shape[0], step):
        logits = head(tokens[start : start + step]).float()  # (n, H) -> (n, V)
        index = owners[start : start + step, None].expand_as(logits)  # (n,) -> (n, V): each value's row
        if splade.strategy == "sum":
            out.scatter_add_(0, index, activate(logits, splade.activation))
        else:
            out.scatter_reduce_(0, index, logits, "amax")
    return out if splade.strategy == "sum" else activate(out, splade.activation)


def sparse_entries(
    vectors: torch.Tensor, thresholds: list[float], top_ks: list[int | None]
) -> list[tuple[list[int], list[float]]]:
    """Per row of (B, V) `vectors`: its entries above the row's threshold as (indices, values), by index; with
    a top_k, its k largest of those, largest first (equal values by index). One copy to the host per pass for
    the rows without a top_k."""
    kept = vectors > torch.tensor(thresholds, device=vectors.device, dtype=vectors.dtype)[:, None]  # (B, V)
    out: list[tuple[list[int], list[float]]] = [([], [])] * len(top_ks)
    plain = [r for r, k in enumerate(top_ks) if k is None]
    if plain:
        rows = torch.tensor(plain, device=vectors.device)
        found = kept.index_select(0, rows).nonzero()  # (M, 2): (row among `plain`, index), row-major
        values = vectors.index_select(0, rows)[found[:, 0], found[:, 1]].tolist()
        indices, counts = found[:, 1].tolist(), kept.index_select(0, rows).sum(1).tolist()
        start = 0
        for r, n in zip(plain, counts):
            out[r] = (indices[start : start + n], values[start : start + n])
            start += n
    for r, k in enumerate(top_ks):
        if k is not None:
            n = min(k, int(kept[r].sum()))
            values_r, indices_r = vectors[r].sort(descending=True, stable=True)  # equal values: lower index first
            out[r] = (indices_r[:n].tolist(), values_r[:n].tolist())
    return out


def splade_entries(
    head: BertLMPredictionHead,
    hidden: torch.Tensor,
    attention_mask: torch.Tensor,
    splade: Splade,
    thresholds: list[float],
    top_ks: list[int | None],
    chunk_values: int = CHUNK_VALUES,
) -> list[tuple[list[int], list[float]]]:
    """sparse_entries of splade_vectors, a group of rows at a time: a pass of many short rows never holds
    (B, V) floats at once, only a group's (at most `chunk_values`, or one row)."""
    rows = max(1, chunk_values // head.bias.shape[0])
    out: list[tuple[list[int], list[float]]] = []
    for start in range(0, hidden.shape[0], rows):
        group = slice(start, start + rows)
        vectors = splade_vectors(head, hidden[group], attention_mask[group], splade, chunk_values)
        out += sparse_entries(vectors, thresholds[group], top_ks[group])
    return out
