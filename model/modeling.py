"""BERT in PyTorch, from the paper: Devlin et al. (2018), "BERT: Pre-training of Deep Bidirectional
Transformers for Language Understanding", arXiv:1810.04805.

Ordered from parts to whole:

    outputs            the dataclasses the models return, with HF's field names
    embeddings         token + learned position + segment (BertEmbeddings)
    padding            the attention mask, or a packed batch of real tokens only (Packed, should_unpad)
    attention          self-attention, its output projection and residual (BertAttention)
    feed-forward       BertIntermediate (dense + act) and BertOutput (dense + residual)
    layer and encoder  the post-LN Transformer layer (BertLayer) and the stack of them (BertEncoder)
    heads              the pooler and the MLM head (BertPooler, BertLMPredictionHead)
    base class         BertPreTrainedModel: weight init, save_pretrained/from_pretrained
    models             BertModel; the masked-LM loss; BertForPreTraining, BertForMaskedLM,
                       BertForSequenceClassification, BertForTokenClassification,
                       BertForQuestionAnswering, BertForMultipleChoice
    helpers            MODEL_CLASSES, class_for_heads, class_for_dir, compile_model, load_model

The dense layers go through model.compute.onednn's `dense` (and its `linear` for the tied decoder): oneDNN's
fused GEMMs on CPU where they pay, F.linear elsewhere.

Parameter names are Hugging Face's (`bert.embeddings.word_embeddings.weight`,
`bert.encoder.layer.N.attention.self.query.weight`, `cls.predictions.transform.dense.weight`, ...),
so state dicts move both ways without a conversion table. Two modules hold their weights under
other module paths than their state-dict names, and say how where they are defined:
BertSelfAttention (one fused `qkv`) and BertLMPredictionHead (a decoder tied to the word embeddings).

Fixes over the seed project (codertimo/BERT-pytorch): learned (not sinusoidal) positions, post-LN
(not pre-LN), a pooler (dense + tanh on [CLS]) feeding NSP and classification, the MLM transform
(dense + GELU + LayerNorm) before a decoder tied to the word embeddings, and an NSP loss that counts
both labels (0 = "B follows A", 1 = "B is random", as in Google's and HF's code).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from datadir.files import atomic_dir
from model.compute import kernels
from model.compute.onednn import dense, linear
from model.config import BertConfig
from model.weights import (
    HEAD_NAMES,
    HEAD_PREFIXES,
    LEGACY_KEYS,
    heads_in_dir,
    heads_of_keys,
    load_state_dict,
    normalize_state_dict,
)

IGNORE_INDEX = (
    -100
)  # labels that take no part in a loss (Hugging Face's convention): MLM positions not predicted, padding


# ---------------------------------------------------------------------------------------------
# Outputs: HF's field names, so callers written against transformers read ours unchanged.
# ---------------------------------------------------------------------------------------------


@dataclass
class BaseModelOutput:
    last_hidden_state: torch.Tensor  # (B, T, H)
    pooler_output: torch.Tensor | None  # (B, H); None when the model has no pooler


@dataclass
class PreTrainingOutput:
    prediction_logits: torch.Tensor  # (B, T, V), or (N, V) at the predicted positions
    seq_relationship_logits: torch.Tensor  # (B, 2)
    loss: torch.Tensor | None = None
    mlm_loss: torch.Tensor | None = None
    nsp_loss: torch.Tensor | None = None


@dataclass
class MaskedLMOutput:
    logits: torch.Tensor  # (B, T, V), or (N, V) at the predicted positions
    loss: torch.Tensor | None = None


@dataclass
class SequenceClassifierOutput:
    logits: torch.Tensor  # (B, num_labels)
    loss: torch.Tensor | None = None


@dataclass
class TokenClassifierOutput:
    logits: torch.Tensor  # (B, T, num_labels)
    loss: torch.Tensor | None = None


@dataclass
class QuestionAnsweringModelOutput:
    start_logits: torch.Tensor  # (B, T)
    end_logits: torch.Tensor  # (B, T)
    loss: torch.Tensor | None = None


@dataclass
class MultipleChoiceModelOutput:
    logits: torch.Tensor  # (B, num_choices)
    loss: torch.Tensor | None = None


# ---------------------------------------------------------------------------------------------
# Embeddings
# ---------------------------------------------------------------------------------------------


class BertEmbeddings(nn.Module):
    """Token + learned position + segment embeddings, summed, then LayerNorm and dropout."""

    position_ids: torch.Tensor  # a buffer, registered in __init__

    def __init__(self, config: BertConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        # Not a weight: rebuilt from the config, never saved (HF's old checkpoints carry it; we ignore it).
        self.register_buffer("position_ids", torch.arange(config.max_position_embeddings), persistent=False)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None) -> torch.Tensor:
        seq_len = input_ids.shape[1]
        x = self.word_embeddings(input_ids) + self.position_embeddings(self.position_ids[:seq_len])
        if token_type_ids is None or self.token_type_embeddings.num_embeddings == 1:
            # Every token in segment A; a model with one segment (type_vocab_size 1) was trained so, and a pair's
            # type 1 would be past its table (an IndexError on the CPU, a context-poisoning assert on CUDA).
            x = x + self.token_type_embeddings.weight[0]
        else:
            x = x + self.token_type_embeddings(token_type_ids)
        return self.dropout(self.LayerNorm(x))


# ---------------------------------------------------------------------------------------------
# Padding. A padded batch reaches attention as a bool (B, 1, 1, T) mask; or, where it pays
# (should_unpad), the encoder runs on the real tokens only, packed one sequence after another as
# (N, H), and only attention needs to know where each sequence starts (Packed). On CUDA that is
# flash attention's variable-length kernel; on CPU a loop of SDPA calls, one per sequence.
# ---------------------------------------------------------------------------------------------


def attention_mask_for(attention_mask: torch.Tensor | None, input_ids: torch.Tensor) -> torch.Tensor | None:
    """The padding mask, built once per batch: (B, T) -> bool (B, 1, 1, T), True = attend.

    Shape (B, 1, 1, T) broadcasts over heads and query positions; a (B, T) mask added to
    (B, nh, T, T) scores would broadcast wrongly (the seed posts' first pitfall). None when there
    is no padding, which lets SDPA take its fastest path.
    """
    if attention_mask is None:
        return None
    if attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask shape {tuple(attention_mask.shape)} does not match "
            f"input_ids shape {tuple(input_ids.shape)}"
        )
    mask = attention_mask.bool()
    if not torch.compiler.is_compiling() and bool(mask.all()):  # a graph break under compile
        return None
    return mask[:, None, None, :]


try:
    from torch.nn.attention.varlen import varlen_attn as _varlen_attn  # torch >= 2.9, CUDA only
except ImportError:  # pragma: no cover - older torch
    _varlen_attn = None  # type: ignore[assignment]  # (none on this torch: varlen_fits says no)

# Flash attention's kernels take head sizes that are a multiple of 8, up to 256.
VARLEN_HEAD_SIZE_MULTIPLE, VARLEN_MAX_HEAD_SIZE = 8, 256

# On CPU, packing pays once about this share of the batch is padding (measured: 1.3x faster at 26%
# padding, 1.8x at 45%, even at 14%; small config, batch 32); below it the per-sequence SDPA loop
# and the gather/scatter cost about what the padded rows save. bench/model_bench.py --cases padded.
CPU_UNPAD_MIN_PADDING = 0.2


def varlen_fits(dtype: torch.dtype, head_size: int, dropout_p: float) -> bool:
    """Whether flash attention's variable-length kernel takes this attention (on a CUDA device)."""
    return (
        _varlen_attn is not None
        and dtype in (torch.float16, torch.bfloat16)
        and dropout_p == 0.0
        and head_size % VARLEN_HEAD_SIZE_MULTIPLE == 0
        and head_size <= VARLEN_MAX_HEAD_SIZE
    )


def should_unpad(mask: torch.Tensor, hidden: torch.Tensor, dropout_p: float, head_size: int) -> bool:
    """Whether to run this padded batch packed (see above); `mask` is the bool (B, 1, 1, T) one.

    On CUDA only where the varlen kernel fits (else padded SDPA); on CPU once enough is padding.
    """
    if torch.compiler.is_compiling():
        return False
    if hidden.is_cuda:
        dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else hidden.dtype
        return varlen_fits(dtype, head_size, dropout_p) and kernels.enabled("flash-varlen", hidden.device)
    if hidden.device.type != "cpu":
        return False
    return 1.0 - mask.float().mean().item() >= CPU_UNPAD_MIN_PADDING


def upload(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device` without waiting: a host tensor bound for a GPU goes through pinned memory, since CUDA
    stages a copy from pageable memory synchronously (a wait that sync-debug mode does not report)."""
    if device.type == "cuda" and t.device.type == "cpu":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


@dataclass(frozen=True)
class Packed:
    """Where each sequence sits in a packed (N, ...) batch: rows offsets[i]:offsets[i+1]."""

    cu_seqlens: torch.Tensor  # int32 (B + 1,), on the batch's device
    offsets: tuple[int, ...]  # the same, as Python ints
    max_len: int

    @classmethod
    def from_mask(cls, keep: torch.Tensor, device: torch.device | None = None) -> Packed:
        """From the (B, T) bool mask; `cu_seqlens` on `device` (default the mask's). A mask on the host
        gives the offsets without a device sync."""
        lengths = keep.sum(1, dtype=torch.int32)  # (B, T) bool -> (B,)
        cu_seqlens = F.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
        offsets = tuple(cu_seqlens.tolist())
        cu_seqlens = upload(cu_seqlens, device or keep.device)
        return cls(cu_seqlens, offsets, max(b - a for a, b in zip(offsets, offsets[1:])))

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> torch.Tensor:
        """Attention within each sequence of packed (N, nh, hs) q, k, v."""
        if q.is_cuda and varlen_fits(q.dtype, q.shape[-1], dropout_p) and kernels.enabled("flash-varlen", q.device):
            try:
                # (torch's stub also allows the (out, aux) pair that only return_aux asks for)
                out = _varlen_attn(q, k, v, self.cu_seqlens, self.cu_seqlens, self.max_len, self.max_len)
                return out  # type: ignore[return-value]
            except RuntimeError as e:  # off for the process; this call goes through SDPA per sequence
                kernels.fail("flash-varlen", e)
        pieces = []
        for a, b in zip(self.offsets, self.offsets[1:]):
            if b > a:  # (L, nh, hs) -> (nh, L, hs) -> SDPA -> (L, nh, hs)
                qi, ki, vi = (t[a:b].transpose(0, 1) for t in (q, k, v))
                pieces.append(F.scaled_dot_product_attention(qi, ki, vi, dropout_p=dropout_p).transpose(0, 1))
        return torch.cat(pieces)


# ---------------------------------------------------------------------------------------------
# Attention
# ---------------------------------------------------------------------------------------------


class BertSelfAttention(nn.Module):
    """Multi-head scaled dot-product attention, softmax(QK^T / sqrt(d_k)) V, via torch's SDPA.

    Q, K and V come from one fused (H -> 3H) projection, `qkv`: one matmul instead of three. Its
    state dict still shows HF's separate `query`, `key` and `value` (weight and bias each): the two
    hooks below split `qkv` on saving and join the three on loading.
    """

    def __init__(self, config: BertConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_size = config.head_size
        self.dropout_p = config.attention_probs_dropout_prob
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.register_state_dict_post_hook(_split_qkv)
        self.register_load_state_dict_pre_hook(_join_qkv)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | Packed | None) -> torch.Tensor:
        dropout_p = self.dropout_p if self.training else 0.0
        if isinstance(mask, Packed):  # x is (N, C): the batch's real tokens, one sequence after another
            N, C = x.shape
            # (N, 3C) -> (N, 3, nh, hs) -> 3 x (N, nh, hs)
            q, k, v = dense(self.qkv, x).view(N, 3, self.num_heads, self.head_size).unbind(1)
            return mask.attention(q, k, v, dropout_p).reshape(N, C)  # (N, nh, hs) -> (N, C)
        B, T, C = x.shape
        # (B, T, 3C) -> (B, T, 3, nh, hs) -> (3, B, nh, T, hs)
        q, k, v = dense(self.qkv, x).view(B, T, 3, self.num_heads, self.head_size).permute(2, 0, 3, 1, 4)
        # SDPA scales by 1/sqrt(hs) itself (the paper's 1/sqrt(d_k)).
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)
        return y.transpose(1, 2).reshape(B, T, C)  # (B, nh, T, hs) -> (B, T, C)


_QKV = ("query", "key", "value")


def _split_qkv(module, state_dict, prefix, local_metadata) -> None:
    for kind in ("weight", "bias"):
        fused = state_dict.pop(f"{prefix}qkv.{kind}")
        for name, part in zip(_QKV, fused.chunk(3, dim=0)):
            state_dict[f"{prefix}{name}.{kind}"] = part


def _join_qkv(module, state_dict, prefix, *args) -> None:
    for kind in ("weight", "bias"):
        keys = [f"{prefix}{name}.{kind}" for name in _QKV]
        if all(k in state_dict for k in keys):
            state_dict[f"{prefix}qkv.{kind}"] = torch.cat([state_dict.pop(k) for k in keys], dim=0)


class _ResidualOutput(nn.Module):
    """Projection back to hidden_size, dropout, then the post-LN residual: LayerNorm(x + sublayer(x))."""

    def __init__(self, config: BertConfig, in_features: int):
        super().__init__()
        self.dense = nn.Linear(in_features, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        if self.training:  # dropout sits between the projection and the residual
            return self.LayerNorm(self.dropout(dense(self.dense, h)) + residual)
        return self.LayerNorm(dense(self.dense, h, add=residual))  # the add fuses into the GEMM


class BertSelfOutput(_ResidualOutput):
    """The attention sub-layer's output projection and residual."""

    def __init__(self, config: BertConfig):
        super().__init__(config, config.hidden_size)


class BertAttention(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.self = BertSelfAttention(config)
        self.output = BertSelfOutput(config)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | Packed | None) -> torch.Tensor:
        return self.output(self.self(x, mask), x)


# ---------------------------------------------------------------------------------------------
# Feed-forward
# ---------------------------------------------------------------------------------------------


class BertIntermediate(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)
        self.act = config.hidden_act  # fused into the GEMM where it can be (see model.compute.onednn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dense(self.dense, x, self.act)


class BertOutput(_ResidualOutput):
    """The feed-forward sub-layer's output projection (intermediate -> hidden) and residual."""

    def __init__(self, config: BertConfig):
        super().__init__(config, config.intermediate_size)


# ---------------------------------------------------------------------------------------------
# Layer and encoder
# ---------------------------------------------------------------------------------------------


class BertLayer(nn.Module):
    """One post-LN Transformer encoder layer: attention sub-layer, then feed-forward sub-layer."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        self.output = BertOutput(config)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | Packed | None) -> torch.Tensor:
        a = self.attention(x, mask)
        return self.output(self.intermediate(a), a)


class BertEncoder(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | Packed | None) -> torch.Tensor:
        for layer in self.layer:
            x = layer(x, mask)
        return x


# ---------------------------------------------------------------------------------------------
# Heads
# ---------------------------------------------------------------------------------------------


class BertPooler(nn.Module):
    """dense + tanh on the [CLS] vector: the sentence representation NSP and classifiers read."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return dense(self.dense, hidden[:, 0], "tanh")


class BertLMPredictionHead(nn.Module):
    """MLM head: transform (dense + act + LayerNorm), then a decoder tied to the word embeddings.

    State dict: `cls.predictions.transform.*` and `cls.predictions.bias`, HF's names. The decoder
    has no module or weight of its own: it reads `word_embeddings.weight` (the one line that ties
    them), so HF's `cls.predictions.decoder.weight` and `decoder.bias` (the tie's copy and an alias
    of `bias`) are never saved, and are read as legacy keys when loading (model.weights).
    """

    def __init__(self, config: BertConfig, word_embeddings: nn.Embedding):
        super().__init__()
        self.transform: Any = nn.Module()  # a bare holder of HF-named children: mypy cannot see them
        self.transform.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.transform.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.act = config.hidden_act
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))
        self.word_embeddings = [word_embeddings]  # a list, so it is not registered twice

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = self.transform.LayerNorm(dense(self.transform.dense, h, self.act))
        return linear(self, h, self.word_embeddings[0].weight, self.bias)  # the tied decoder


# ---------------------------------------------------------------------------------------------
# Base class: weight init, loading and saving, shared by every model class
# ---------------------------------------------------------------------------------------------


class BertPreTrainedModel(nn.Module):
    """Weight init, from_pretrained/save_pretrained and parameter counting for every model class."""

    prefix = "bert."  # where the encoder's keys live in this class's state dict
    # The attention mask may stay on the CPU while the ids are on a GPU (BertModel.forward): callers
    # that know it (the trainer, the engine) then pack or mask without a device sync.
    takes_host_attention_mask = True

    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config

    @property
    def heads(self) -> set[str]:
        return heads_of_keys(normalize_state_dict(self.state_dict()))

    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.padding_idx is not None:
                module.weight.data[module.padding_idx].zero_()
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
        elif isinstance(module, BertLMPredictionHead):
            nn.init.zeros_(module.bias)

    def init_weights(self) -> None:
        self.apply(self._init_weights)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    # -- saving ---------------------------------------------------------------------------------

    def save_pretrained(self, path: str | Path, tokenizer=None) -> None:
        """Write config.json + model.safetensors (+ tokenizer files) atomically into `path`."""
        with atomic_dir(path) as tmp:
            self.write_files(tmp, tokenizer)

    @property
    def architecture(self) -> str:
        """The class config.json's `architectures` names: this one's."""
        return type(self).__name__

    def write_files(self, out: Path, tokenizer=None) -> None:
        """The model directory's files, into the existing directory `out` (save_pretrained's temp directory, a
        checkpoint's): config.json naming `architecture`, model.safetensors in fp32, the tokenizer's files."""
        config = BertConfig.from_dict(self.config.to_dict())
        config.architectures = [self.architecture]
        tensors = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in self.state_dict().items()}
        config.to_json_file(out / "config.json")
        save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
        if tokenizer is not None:
            tokenizer.save_pretrained(out)

    # -- loading --------------------------------------------------------------------------------

    @classmethod
    def from_pretrained(
        cls, path: str | Path, device: str | torch.device = "cpu", init_missing_heads: bool = False, **config_overrides
    ):
        """Load a model directory in HF layout; eval mode, on `device`.

        A head this class needs but the directory lacks is an error naming it, unless
        `init_missing_heads` (warm start: the encoder is loaded, missing heads get fresh weights).
        `config_overrides` replace config fields (for example `id2label` for a new classifier).
        """
        path = Path(path)
        if not path.is_dir():
            raise FileNotFoundError(f"model directory {path} does not exist")
        return cls._from_state(
            path, normalize_state_dict(load_state_dict(path)), device, init_missing_heads, config_overrides
        )

    @classmethod
    def _from_state(cls, path: Path, state, device, init_missing_heads, config_overrides):
        config = BertConfig.from_json_file(path / "config.json")
        if config_overrides:
            config = BertConfig.from_dict({**config.to_dict(), **config_overrides})
        if init_missing_heads:  # a warm start: the heads it adds need real, initialised weights
            model = cls._build(config, heads_of_keys(state), init_missing_heads)
            model._load_weights(state, str(path), init_missing_heads)
            return model.to(device).eval()
        # Built without storage, then the loaded tensors become its weights (in fp32, as built): a load holds
        # one copy of the weights, not a fresh random model and the file's tensors side by side.
        with torch.device("meta"):
            model = cls._build(config, heads_of_keys(state), False)
        state = {k: v.float() if v.is_floating_point() and v.dtype != torch.float32 else v for k, v in state.items()}
        model._load_weights(state, str(path), False, assign=True)
        for module in model.modules():
            if isinstance(module, BertEmbeddings):  # its one buffer, never saved: made as __init__ makes it
                module.position_ids = torch.arange(config.max_position_embeddings)
        return model.to(device).eval()

    @classmethod
    def _build(cls, config: BertConfig, heads: set[str], init_missing_heads: bool):
        return cls(config)

    def _load_weights(
        self, given: dict[str, torch.Tensor], source: str, init_missing_heads: bool, assign: bool = False
    ) -> None:
        """Load a normalized ("bert."-prefixed) state dict, naming whatever is missing or unknown; `assign`:
        the given tensors become the weights (a model built on the meta device) instead of being copied in."""
        strip = len("bert.") if self.prefix == "" else 0  # a bare BertModel's own keys have no prefix
        expected = {("bert." if strip else "") + k for k in self.state_dict()}
        my_heads = heads_of_keys(expected)
        missing = sorted(expected - set(given))
        missing_heads = sorted(h for h in my_heads if any(k.startswith(HEAD_PREFIXES[h]) for k in missing))
        if missing_heads and not init_missing_heads:
            names = ", ".join(f"{HEAD_NAMES[h]} ({HEAD_PREFIXES[h]}*)" for h in missing_heads)
            raise ValueError(f"{source} has no {names}, which {type(self).__name__} needs")
        missing = [k for k in missing if not heads_of_keys([k]) & set(missing_heads)]
        if missing:
            raise ValueError(f"{source} lacks weights {type(self).__name__} needs: {_names(missing)}")
        # Keys of heads this class does not have (an MLM head when loading a BertModel) are fine.
        unexpected = sorted(k for k in set(given) - expected - LEGACY_KEYS if not heads_of_keys([k]) - my_heads)
        if unexpected:
            raise ValueError(f"{source} has weights {type(self).__name__} does not know: {_names(unexpected)}")
        if missing_heads:
            self.init_weights()
        try:
            self.load_state_dict(
                {k[strip:]: v for k, v in given.items() if k in expected}, strict=not missing_heads, assign=assign
            )
        except RuntimeError as e:
            raise ValueError(f"{source}: weights do not fit the config: {e}") from None


def _names(keys: list[str], most: int = 8) -> str:
    more = f" (and {len(keys) - most} more)" if len(keys) > most else ""
    return ", ".join(keys[:most]) + more


# ---------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------


class BertModel(BertPreTrainedModel):
    """The encoder: embeddings, L post-LN layers, and (optionally) the pooler."""

    prefix = ""

    def __init__(self, config: BertConfig, add_pooling_layer: bool = True):
        super().__init__(config)
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config)
        self.pooler = BertPooler(config) if add_pooling_layer else None
        self.init_weights()

    @classmethod
    def _build(cls, config, heads, init_missing_heads):
        # An encoder saved without a pooler (HF's BertForMaskedLM) still loads as a BertModel.
        return cls(config, add_pooling_layer="pooler" in heads or init_missing_heads)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
    ) -> BaseModelOutput:
        """`attention_mask` may stay on the CPU while the ids are on a GPU (the service's engine does
        so): whether to mask or pack, and where each sequence starts, are then read off the host copy,
        without a device-to-host sync."""
        self._check_input(input_ids)
        mask = attention_mask_for(attention_mask, input_ids)
        x = self.embeddings(input_ids, token_type_ids)
        dropout_p = self.config.attention_probs_dropout_prob if self.training else 0.0
        if mask is not None and should_unpad(mask, x, dropout_p, self.config.head_size):
            hidden = self._encode_packed(x, mask[:, 0, 0])
        else:
            hidden = self.encoder(x, None if mask is None else upload(mask, x.device))
        pooled = self.pooler(hidden) if self.pooler is not None else None
        return BaseModelOutput(last_hidden_state=hidden, pooler_output=pooled)

    def _encode_packed(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """The encoder on the real tokens only; padded positions of the result are zeros."""
        B, T, H = x.shape
        rows = upload(keep.reshape(-1).nonzero().squeeze(1), x.device)  # (B, T) -> real token indices
        packed = self.encoder(x.reshape(B * T, H).index_select(0, rows), Packed.from_mask(keep, x.device))  # (N, H)
        return x.new_zeros(B * T, H).index_copy(0, rows, packed).view(B, T, H)

    def _check_input(self, input_ids: torch.Tensor) -> None:
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (batch, seq_len), got shape {tuple(input_ids.shape)}")
        seq_len, limit = input_ids.shape[1], self.config.max_position_embeddings
        if seq_len > limit:
            raise ValueError(
                f"sequence length {seq_len} exceeds max_position_embeddings {limit}; "
                "truncate the input (tokenizer truncation=True)"
            )


def _masked_lm(
    head: BertLMPredictionHead, hidden: torch.Tensor, labels: torch.Tensor | None, masked_positions: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logits, loss) of the MLM head on (B, T, H) `hidden`, for BertForPreTraining and BertForMaskedLM.

    The head runs only where a prediction is wanted: at the True positions of a bool (B, T)
    `masked_positions`, by default where labels != -100, or everywhere when neither is given. Logits
    are (N, V) in row-major (batch, position) order, or (B, T, V); loss is None without labels.
    `masked_positions` may be on the CPU while `hidden` is on a GPU (the trainer passes it so): the
    rows are then found on the host, without the device sync a boolean index costs.
    """
    if masked_positions is None and labels is not None:
        masked_positions = labels != IGNORE_INDEX
    if masked_positions is None:
        logits = head(hidden)
        return logits, None if labels is None else _mlm_loss(logits, labels)
    rows = _rows(hidden, masked_positions)
    logits = head(hidden.reshape(-1, hidden.shape[-1]).index_select(0, rows))  # (B, T, H) -> (N, H)
    return logits, None if labels is None else _mlm_loss(logits, labels.reshape(-1).index_select(0, rows))


def _rows(hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Flat (batch, position) indices, on hidden's device, of the True positions of a bool (B, T) mask."""
    if positions.shape != hidden.shape[:2]:
        raise ValueError(
            f"masked_positions shape {tuple(positions.shape)} does not match the batch {tuple(hidden.shape[:2])}"
        )
    return upload(positions.reshape(-1).nonzero().squeeze(1), hidden.device)


def _mlm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    if labels.numel() == 0:  # nothing masked in this batch: a zero that still has a graph
        return logits.sum() * 0.0
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), ignore_index=IGNORE_INDEX)


class BertForPreTraining(BertPreTrainedModel):
    """Encoder + MLM head + NSP head; loss = MLM cross-entropy + NSP cross-entropy (paper, 3.1).

    The MLM head runs only where a prediction is wanted (labels != -100, or `masked_positions`):
    the decoder is (H x V), most of the arithmetic of a small BERT, and every other position's
    logits would be thrown away. Logits are then (N, V), in row-major (batch, position) order.
    """

    takes_host_masked_positions = True  # `masked_positions` may be a CPU tensor (see _masked_lm)

    def __init__(self, config: BertConfig):
        super().__init__(config)
        self.bert = BertModel(config)
        self.cls: Any = nn.Module()  # a bare holder, as BertLMPredictionHead.transform
        self.cls.predictions = BertLMPredictionHead(config, self.bert.embeddings.word_embeddings)
        self.cls.seq_relationship = nn.Linear(config.hidden_size, 2)
        self.init_weights()

    def forward(
        self,
        input_ids,
        attention_mask=None,
        token_type_ids=None,
        labels=None,
        next_sentence_label=None,
        masked_positions=None,
    ) -> PreTrainingOutput:
        out = self.bert(input_ids, attention_mask, token_type_ids)
        logits, mlm_loss = _masked_lm(self.cls.predictions, out.last_hidden_state, labels, masked_positions)
        nsp_logits = self.cls.seq_relationship(out.pooler_output)
        nsp_loss = None
        if next_sentence_label is not None:
            nsp_loss = F.cross_entropy(nsp_logits.float(), next_sentence_label.reshape(-1))
        losses = [x for x in (mlm_loss, nsp_loss) if x is not None]
        loss = sum(losses[1:], losses[0]) if losses else None
        return PreTrainingOutput(logits, nsp_logits, loss, mlm_loss, nsp_loss)


class BertForMaskedLM(BertPreTrainedModel):
    """Encoder (no pooler, as HF) + MLM head; see BertForPreTraining for `masked_positions`."""

    takes_host_masked_positions = True

    def __init__(self, config: BertConfig):
        super().__init__(config)
        self.bert = BertModel(config, add_pooling_layer=False)
        self.cls: Any = nn.Module()  # a bare holder, as BertLMPredictionHead.transform
        self.cls.predictions = BertLMPredictionHead(config, self.bert.embeddings.word_embeddings)
        self.init_weights()

    def forward(
        self, input_ids, attention_mask=None, token_type_ids=None, labels=None, masked_positions=None
    ) -> MaskedLMOutput:
        out = self.bert(input_ids, attention_mask, token_type_ids)
        return MaskedLMOutput(*_masked_lm(self.cls.predictions, out.last_hidden_state, labels, masked_positions))


class BertForSequenceClassification(BertPreTrainedModel):
    """Encoder + dropout + linear on the pooled [CLS] output (paper, 4.1); regression if 1 label."""

    def __init__(self, config: BertConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.bert = BertModel(config)
        p = config.classifier_dropout
        self.dropout = nn.Dropout(config.hidden_dropout_prob if p is None else p)
        self.classifier = nn.Linear(config.hidden_size, self.num_labels)
        self.init_weights()

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, labels=None) -> SequenceClassifierOutput:
        pooled = self.bert(input_ids, attention_mask, token_type_ids).pooler_output
        logits = dense(self.classifier, self.dropout(pooled))
        loss = None
        if labels is not None:
            if self.num_labels == 1:
                loss = F.mse_loss(logits.squeeze(-1).float(), labels.float())
            else:
                loss = F.cross_entropy(logits.float(), labels.reshape(-1))
        return SequenceClassifierOutput(logits, loss)


def _classifier_dropout(config: BertConfig) -> nn.Dropout:
    p = config.classifier_dropout
    return nn.Dropout(config.hidden_dropout_prob if p is None else p)


class BertForTokenClassification(BertPreTrainedModel):
    """Encoder (no pooler, as HF) + dropout + linear on every token's vector (paper, 4.3: NER).

    Loss: cross-entropy over the positions whose label is not -100 (the continuation pieces of a
    word and the special tokens, in the usual first-WordPiece labelling).
    """

    def __init__(self, config: BertConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.bert = BertModel(config, add_pooling_layer=False)
        self.dropout = _classifier_dropout(config)
        self.classifier = nn.Linear(config.hidden_size, self.num_labels)
        self.init_weights()

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, labels=None) -> TokenClassifierOutput:
        hidden = self.bert(input_ids, attention_mask, token_type_ids).last_hidden_state
        logits = dense(self.classifier, self.dropout(hidden))  # (B, T, num_labels)
        loss = None
        if labels is not None:  # (B, T, L) -> (B*T, L) against (B*T,)
            loss = F.cross_entropy(
                logits.reshape(-1, self.num_labels).float(), labels.reshape(-1), ignore_index=IGNORE_INDEX
            )
        return TokenClassifierOutput(logits, loss)


class BertForQuestionAnswering(BertPreTrainedModel):
    """Encoder (no pooler, as HF) + one linear giving each token a start and an end logit (paper, 4.2:
    SQuAD). No dropout before it, as in HF.

    Loss (HF's): the mean of the start and end cross-entropies; a position outside the sequence is
    clamped to T and ignored, so an answer cut off by a window does not count.
    """

    def __init__(self, config: BertConfig):
        super().__init__(config)
        self.bert = BertModel(config, add_pooling_layer=False)
        self.qa_outputs = nn.Linear(config.hidden_size, 2)  # start, end
        self.init_weights()

    def forward(
        self, input_ids, attention_mask=None, token_type_ids=None, start_positions=None, end_positions=None
    ) -> QuestionAnsweringModelOutput:
        hidden = self.bert(input_ids, attention_mask, token_type_ids).last_hidden_state
        logits = dense(self.qa_outputs, hidden)  # (B, T, 2)
        start_logits, end_logits = (t.squeeze(-1).contiguous() for t in logits.split(1, dim=-1))
        loss = None
        if start_positions is not None and end_positions is not None:
            ignored = start_logits.shape[1]
            start, end = (p.reshape(-1).clamp(0, ignored) for p in (start_positions, end_positions))
            loss = (
                F.cross_entropy(start_logits.float(), start, ignore_index=ignored)
                + F.cross_entropy(end_logits.float(), end, ignore_index=ignored)
            ) / 2
        return QuestionAnsweringModelOutput(start_logits, end_logits, loss)


class BertForMultipleChoice(BertPreTrainedModel):
    """Encoder + dropout + a linear scoring each choice's pooled [CLS] (paper, 4.4: SWAG).

    Inputs are (B, C, T): every choice is a sequence pair of its own, run as one (B*C, T) batch.
    """

    def __init__(self, config: BertConfig):
        super().__init__(config)
        self.bert = BertModel(config)
        self.dropout = _classifier_dropout(config)
        self.classifier = nn.Linear(config.hidden_size, 1)
        self.init_weights()

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, labels=None) -> MultipleChoiceModelOutput:
        if input_ids.dim() != 3:
            raise ValueError(f"input_ids must be (batch, num_choices, seq_len), got shape {tuple(input_ids.shape)}")
        B, C, T = input_ids.shape
        flat = [None if t is None else t.reshape(B * C, T) for t in (input_ids, attention_mask, token_type_ids)]
        pooled = self.bert(*flat).pooler_output  # (B*C, H)
        logits = dense(self.classifier, self.dropout(pooled)).view(B, C)  # (B*C, 1) -> (B, C)
        loss = None if labels is None else F.cross_entropy(logits.float(), labels.reshape(-1))
        return MultipleChoiceModelOutput(logits, loss)


# ---------------------------------------------------------------------------------------------
# Helpers: model classes by name and by heads, compiling, loading a directory as its class
# ---------------------------------------------------------------------------------------------

MODEL_CLASSES = {
    cls.__name__: cls
    for cls in (
        BertModel,
        BertForPreTraining,
        BertForMaskedLM,
        BertForSequenceClassification,
        BertForTokenClassification,
        BertForQuestionAnswering,
        BertForMultipleChoice,
    )
}
# The classes whose head is `classifier.*`: sequence (on the pooled [CLS]), token (on every token,
# no pooler) and multiple choice (one score per choice, on the pooled [CLS]).
CLASSIFIER_CLASSES = (BertForSequenceClassification, BertForTokenClassification, BertForMultipleChoice)


def class_for_heads(heads: set[str], architectures: list[str] | None = None) -> type[BertPreTrainedModel]:
    """The model class a directory loads as, from its weights' heads and config.json's `architectures`.

    The weights decide, richest class first: a QA head, a classifier, MLM + NSP + pooler, MLM, else
    the bare encoder. A `classifier.*` head alone does not say which task it serves, so there
    `architectures` (which transformers and save_pretrained both write) decides when it names one of
    the classifier classes; without it, a classifier with a pooler is a sequence classifier and one
    without is a token classifier (neither transformers' nor ours saves a pooler with it).
    """
    if "qa" in heads:
        return BertForQuestionAnswering
    if "classifier" in heads:
        named = [cls for cls in CLASSIFIER_CLASSES if cls.__name__ in (architectures or ())]
        if named:
            return named[0]
        return BertForSequenceClassification if "pooler" in heads else BertForTokenClassification
    if {"mlm", "nsp", "pooler"} <= heads:
        return BertForPreTraining
    if "mlm" in heads:
        return BertForMaskedLM
    return BertModel


def compile_model(model: BertPreTrainedModel, dynamic: bool = True, **options) -> BertPreTrainedModel:
    """torch.compile the model in place (nn.Module.compile) and return it. Opt-in, and not for CPU.

    On CPU it does not pay here: the eager model already fuses what inductor would (bias, GELU,
    residual add into oneDNN GEMMs), inductor's GEMMs are torch's own (MKL), so compiled runs were
    slower (small config, batch 8 x 128, one thread: 75 ms compiled, 40 ms eager), and the first call
    per new shape spent 12-37 s compiling. On CUDA it fuses the LayerNorm/GELU/dropout kernels;
    measure there before turning it on. Compiled, the model skips the packed (unpadded) path.
    `dynamic=True` compiles once for all batch sizes and lengths rather than once per shape.
    """
    model.compile(dynamic=dynamic, **options)
    return model


def class_for_dir(path: str | Path) -> type[BertPreTrainedModel]:
    """The class a model directory loads as (class_for_heads), from its config and weight names only."""
    path = Path(path)
    return class_for_heads(heads_in_dir(path), BertConfig.from_json_file(path / "config.json").architectures)


def load_model(path: str | Path, device: str | torch.device = "cpu") -> BertPreTrainedModel:
    """Load a model directory as the class its weights support (see class_for_heads)."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {path} does not exist")
    state = normalize_state_dict(load_state_dict(path))
    architectures = BertConfig.from_json_file(path / "config.json").architectures
    return class_for_heads(heads_of_keys(state), architectures)._from_state(path, state, device, False, {})
