"""A model card's measured scores: a short, fixed held-out evaluation of masked-token and next-sentence prediction.

    evaluation = evaluate_card(model_dir_or_model, tokenizer=None)       # the card's "evaluation" dict
    card = write_card(model_dir, job_eval=None, source=None)             # measure, then update card.json
    table = before_after(job_eval)                                       # the card's "before_after" rows
    row = measure_precisions(model_dir)                                  # this CPU's row of the card's "precision"

`write_card` also measures each precision this CPU runs natively against fp32 (model.precision_choice) on the
first precision_choice.MAX_TEXTS held-out leads, and keeps the row under the card's "precision" table, keyed by
the kind of CPU (precision_choice.cpu_kind): what a service's `auto` chooses from.

The set, wiki-heldout-v1 (model/heldout/), is the English Wikipedia leads whose title's sha256, read as
an integer, is divisible by 64 and that have at least two sentences: 156 leads, left out of the bootstrap
corpus (app/launcher/demo_data.py), so a model pretrained here never saw them.

Sequence i pairs lead i's first sentence (A) with its second (B follows, NSP label 0) or with a sentence
of another lead (label 1): exactly half of each, by a seeded shuffle. The pair is cut to MAX_TOKENS as
the tokenizer cuts a pair; then 15% of its tokens other than [CLS], [SEP] and [UNK] (at least one), drawn
by a generator seeded by (seed, i), are all replaced by [MASK] (BERT's 80/10/10 is a training device;
here every chosen token is masked). Scores: the MLM head's top-1 and top-5 accuracy over the masked tokens, the same over the
content words among them (a token that is a whole word, alphabetic and not in STOPWORDS), and the NSP
head's accuracy. Every draw is seeded, so a model scores the same on every run. The cost is bounded:
MAX_SEQUENCES sequences of at most MAX_TOKENS tokens, one forward pass each.
Reference: Devlin et al. 2018, section 3.1 (masked LM, next sentence prediction).

A job that evaluated its base model before the first step (the trainer's baseline: `base_<metric>` beside
each `<metric>` of its evaluation) also gets `before_after` on the card: one row per metric, its value
before training and after.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import random
from pathlib import Path
from typing import Any

import torch

from datadir.cards import read_card, update_card
from model import precision_choice
from model.config import BertConfig
from model.modeling import BertForMaskedLM, BertForPreTraining, load_model
from model.options import BASE_PREFIX
from model.tokenizer import BertTokenizer

log = logging.getLogger("bertserve.model_card")

SET_NAME = "wiki-heldout-v1"
HELDOUT_FILE = Path(__file__).parent / "heldout" / f"{SET_NAME}.jsonl"
MASK_FRACTION = 0.15
MAX_SEQUENCES = 128  # with MAX_TOKENS: at most 8192 tokens, a few seconds of bert-base on two CPU cores
MAX_TOKENS = 64
BATCH_SIZE = 32
STOPWORDS = frozenset(
    "a an the and or but nor so yet of in on at to for from by with as into onto about than then "
    "is are was were be been being am has have had do does did will would shall should can could may might must "
    "it its this that these those he him his she her hers they them their theirs we us our you your i me my "
    "who whom whose which what where when why how not no all any some such also there here".split()
)


def is_heldout(title: str) -> bool:
    """The rule that picks the held-out leads by title (with at least two sentences: `heldout_leads`)."""
    return int(hashlib.sha256(title.encode("utf-8")).hexdigest(), 16) % 64 == 0


@functools.cache
def heldout_leads() -> tuple[tuple[str, tuple[str, ...]], ...]:
    """(title, sentences) of every held-out lead, in the file's order."""
    with open(HELDOUT_FILE, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return tuple((row["title"], tuple(row["sentences"])) for row in rows)


def heldout_titles() -> frozenset[str]:
    """The titles of the held-out leads (the bootstrap corpus leaves these out)."""
    return frozenset(title for title, _ in heldout_leads())


# ---------------------------------------------------------------------------- the sequences


def build_sequences(
    tokenizer: BertTokenizer, seed: int = 0, max_sequences: int = MAX_SEQUENCES, max_tokens: int = MAX_TOKENS
) -> list[dict[str, Any]]:
    """The masked sentence pairs, each {input_ids (masked), token_type_ids, positions, targets, content,
    next_sentence_label}; positions ascend, targets are the original ids there, content says which are
    content words."""
    if max_sequences < 1 or max_tokens < 5:
        raise ValueError(f"max_sequences must be >= 1 and max_tokens >= 5, got {max_sequences} and {max_tokens}")
    leads = heldout_leads()
    n = min(max_sequences, len(leads))
    rng = random.Random(f"{SET_NAME}/{seed}")
    order = list(range(n))
    rng.shuffle(order)
    random_b = set(order[: n // 2])  # exactly half of the pairs get a random B
    sequences = []
    for i in range(n):
        sentences = leads[i][1]
        b, label = sentences[1], 0
        if i in random_b:
            j = rng.choice([k for k in range(len(leads)) if k != i])
            b, label = rng.choice(leads[j][1]), 1
        pair = tokenizer.pair_from_ids(tokenizer.token_ids(sentences[0]), tokenizer.token_ids(b), max_tokens)
        sequences.append(
            {**_masked(tokenizer, pair, random.Random(f"{SET_NAME}/{seed}/{i}")), "next_sentence_label": label}
        )
    return sequences


def _masked(tokenizer: BertTokenizer, pair: dict[str, list[int]], rng: random.Random) -> dict[str, Any]:
    ids = pair["input_ids"]
    special = set(tokenizer.all_special_ids)
    candidates = [p for p, t in enumerate(ids) if t not in special]
    count = max(1, round(MASK_FRACTION * len(candidates))) if candidates else 0  # [UNK]s only: nothing to ask
    positions = sorted(rng.sample(candidates, count))
    tokens = tokenizer.convert_ids_to_tokens(ids)
    masked = list(ids)
    for p in positions:
        masked[p] = tokenizer.mask_token_id
    return {
        "input_ids": masked,
        "token_type_ids": pair["token_type_ids"],
        "positions": positions,
        "targets": [ids[p] for p in positions],
        "content": [is_content_word(tokens, p) for p in positions],
    }


def is_content_word(tokens: list[str], p: int) -> bool:
    """Token p is a whole word (not a ## piece, not followed by one), alphabetic, and not a stopword."""
    token = tokens[p]
    whole = not token.startswith("##") and not (p + 1 < len(tokens) and tokens[p + 1].startswith("##"))
    return whole and token.isalpha() and token.lower() not in STOPWORDS


# ---------------------------------------------------------------------------- the scores


@torch.no_grad()
def evaluate_card(
    model: torch.nn.Module | str | os.PathLike,
    tokenizer: BertTokenizer | None = None,
    *,
    seed: int = 0,
    max_sequences: int = MAX_SEQUENCES,
    max_tokens: int = MAX_TOKENS,
) -> dict[str, Any]:
    """The card's "evaluation": scores of a model (on its device) or model directory (on the CPU) on the
    held-out set.

    Keys: set, seed, sequences, tokens, masked_tokens, content_tokens, mlm_top1, mlm_top5, content_top1,
    content_top5 (None when no token of that kind is masked), nsp_accuracy (None without an NSP head); a
    model without an MLM head gets {"set", "skipped": why}.
    """
    if not isinstance(model, torch.nn.Module):
        tokenizer = tokenizer or BertTokenizer.from_pretrained(model)
        model = load_model(Path(model), "cpu")
    if tokenizer is None:
        raise ValueError("evaluate_card needs the tokenizer when it is given a model object")
    if not isinstance(model, (BertForPreTraining, BertForMaskedLM)):
        return {"set": SET_NAME, "skipped": f"{type(model).__name__} has no masked-LM or next-sentence head"}
    has_nsp = isinstance(model, BertForPreTraining)
    max_tokens = min(max_tokens, model.config.max_position_embeddings)
    sequences = build_sequences(tokenizer, seed, max_sequences, max_tokens)
    was_training = model.training
    model.eval()
    try:
        counts = _count(model, tokenizer, sequences)
    finally:
        model.train(was_training)
    masked, content = counts["masked"], counts["content"]
    return {
        "set": SET_NAME,
        "seed": seed,
        "sequences": len(sequences),
        "tokens": sum(len(s["input_ids"]) for s in sequences),
        "masked_tokens": masked,
        "content_tokens": content,
        "mlm_top1": counts["top1"] / masked if masked else None,
        "mlm_top5": counts["top5"] / masked if masked else None,
        "content_top1": counts["content_top1"] / content if content else None,
        "content_top5": counts["content_top5"] / content if content else None,
        "nsp_accuracy": counts["nsp"] / len(sequences) if has_nsp else None,
    }


def _count(model: torch.nn.Module, tokenizer: BertTokenizer, sequences: list[dict]) -> dict[str, int]:
    counts = dict.fromkeys(("masked", "content", "top1", "top5", "content_top1", "content_top5", "nsp"), 0)
    device = next(model.parameters()).device
    for start in range(0, len(sequences), BATCH_SIZE):
        batch = sequences[start : start + BATCH_SIZE]
        inputs = _collate(batch, tokenizer.pad_token_id)
        out = model(**{k: v.to(device) for k, v in inputs.items()})
        logits = out.prediction_logits if hasattr(out, "prediction_logits") else out.logits  # (N, V), row-major
        targets = torch.tensor([t for s in batch for t in s["targets"]], device=device)
        content = torch.tensor([c for s in batch for c in s["content"]], dtype=torch.bool, device=device)
        top = logits.float().topk(min(5, logits.shape[-1]), dim=-1).indices  # (N, 5)
        hit1, hit5 = top[:, 0] == targets, (top == targets[:, None]).any(-1)
        counts["masked"] += targets.numel()
        counts["content"] += int(content.sum())
        counts["top1"] += int(hit1.sum())
        counts["top5"] += int(hit5.sum())
        counts["content_top1"] += int(hit1[content].sum())
        counts["content_top5"] += int(hit5[content].sum())
        if isinstance(model, BertForPreTraining):
            labels = torch.tensor([s["next_sentence_label"] for s in batch], device=device)
            counts["nsp"] += int((out.seq_relationship_logits.argmax(-1) == labels).sum())
    return counts


def _collate(batch: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """(B, T) input_ids, token_type_ids, attention_mask and the bool masked_positions, padded to the longest."""
    longest = max(len(s["input_ids"]) for s in batch)
    ids = torch.full((len(batch), longest), pad_id, dtype=torch.long)
    types = torch.zeros_like(ids)
    attention = torch.zeros_like(ids)
    masked = torch.zeros(ids.shape, dtype=torch.bool)
    for row, s in enumerate(batch):
        n = len(s["input_ids"])
        ids[row, :n] = torch.tensor(s["input_ids"])
        types[row, :n] = torch.tensor(s["token_type_ids"])
        attention[row, :n] = 1
        masked[row, s["positions"]] = True
    return {"input_ids": ids, "token_type_ids": types, "attention_mask": attention, "masked_positions": masked}


# ---------------------------------------------------------------------------- the card


def write_card(
    model_dir: str | os.PathLike, *, job_eval: dict | None = None, source: dict | None = None
) -> dict[str, Any]:
    """Measure the model directory and merge the result into its card.json (with `job_eval` and `source`
    when given); returns the card. A failed evaluation is logged and recorded as {"error": ...}: it never
    fails the import or job that asked for it."""
    try:
        evaluation = evaluate_card(model_dir)
    except Exception as e:
        log.exception("the held-out evaluation of %s failed", model_dir)
        evaluation = {"set": SET_NAME, "error": f"{type(e).__name__}: {e}"}
    fields: dict[str, Any] = {"evaluation": evaluation, **precision_fields(model_dir)}
    if job_eval is not None:
        fields["job_eval"] = job_eval
        if table := before_after(job_eval):
            fields["before_after"] = table
    if source is not None:
        fields["source"] = source
    return update_card(model_dir, **fields)


def before_after(job_eval: dict[str, Any] | None) -> list[dict[str, Any]]:
    """[{"metric", "before", "after"}] for each metric of a job's evaluation that has its `base_<metric>` (the
    base model's value, before the first step), in the evaluation's order; [] without a baseline."""
    if not job_eval:
        return []
    return [
        {"metric": name, "before": job_eval[BASE_PREFIX + name], "after": value}
        for name, value in job_eval.items()
        if not name.startswith(BASE_PREFIX) and BASE_PREFIX + name in job_eval
    ]


# ---------------------------------------------------------------------------- the precision table


def precision_inputs(
    tokenizer: BertTokenizer, max_tokens: int, long_tokens: int = precision_choice.LONG_TOKENS
) -> dict[str, dict[str, torch.Tensor]]:
    """model.precision_choice.measure's batches from the held-out leads: "texts" (lead i's first sentence),
    "pairs" (RERANK_QUERIES first sentences, each with the second sentences of RERANK_CANDIDATES leads, its own
    among them) and "masked" (build_sequences' masked pairs), at most MAX_TEXTS rows of `max_tokens` each; and
    "long", LONG_ROWS rows of `long_tokens` tokens: the leads' text one after another, cut into rows."""
    pc, leads = precision_choice, heldout_leads()
    n, cls, sep = min(pc.MAX_TEXTS, len(leads)), tokenizer.cls_token_id, tokenizer.sep_token_id
    texts = [tokenizer.token_ids(sentences[0])[: max_tokens - 2] for _, sentences in leads[:n]]
    singles = [{"input_ids": [cls, *ids, sep], "token_type_ids": [0] * (len(ids) + 2)} for ids in texts]
    width = long_tokens - 2
    stream: list[int] = []  # the leads' tokens, only as many as the long rows take
    for _, sentences in leads:
        if len(stream) >= pc.LONG_ROWS * width:
            break
        stream += [i for sentence in sentences for i in tokenizer.token_ids(sentence)]
    long = [
        {"input_ids": [cls, *stream[r * width : (r + 1) * width], sep], "token_type_ids": [0] * long_tokens}
        for r in range(pc.LONG_ROWS)
        if len(stream) >= (r + 1) * width
    ]
    pairs = [
        tokenizer.pair_from_ids(texts[q], tokenizer.token_ids(leads[(q + c) % len(leads)][1][1]), max_tokens)
        for q in range(pc.RERANK_QUERIES)
        for c in range(pc.RERANK_CANDIDATES)
    ]
    return {
        "texts": _unmasked(singles, tokenizer.pad_token_id),
        "pairs": _unmasked(pairs, tokenizer.pad_token_id),
        "masked": _collate(build_sequences(tokenizer, 0, n, max_tokens), tokenizer.pad_token_id),
        "long": _unmasked(long or singles, tokenizer.pad_token_id),
    }


def _unmasked(rows: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    batch = _collate([{**row, "positions": []} for row in rows], pad_id)
    del batch["masked_positions"]
    return batch


def measure_precisions(model_dir: str | os.PathLike) -> dict[str, Any]:
    """This CPU's row of the card's "precision" table (model.precision_choice.measure) for a model directory."""
    tokenizer = BertTokenizer.from_pretrained(model_dir)

    def load() -> torch.nn.Module:
        return load_model(Path(model_dir), "cpu").eval()

    config = BertConfig.from_json_file(Path(model_dir) / "config.json")
    limit = config.max_position_embeddings
    inputs = precision_inputs(
        tokenizer, min(precision_choice.MAX_TOKENS, limit), min(precision_choice.LONG_TOKENS, limit)
    )
    return {"set": SET_NAME, **precision_choice.measure(load, inputs)}


def precision_fields(model_dir: str | os.PathLike) -> dict[str, Any]:
    """{"precision": the card's table with this CPU's row measured again}; a failed measurement is logged and
    recorded as the row {"error": ...}, never failing the import or job that asked."""
    try:
        row = measure_precisions(model_dir)
    except Exception as e:
        log.exception("measuring the precisions of %s failed", model_dir)
        row = {"set": SET_NAME, "error": f"{type(e).__name__}: {e}"}
    table = read_card(model_dir).get("precision")
    return {"precision": {**(table if isinstance(table, dict) else {}), precision_choice.cpu_kind(): row}}


def write_precision_row(model_dir: str | os.PathLike) -> dict[str, Any]:
    """Measure this CPU's row and merge it into the card (a service's background measurement); the row."""
    fields = precision_fields(model_dir)
    update_card(model_dir, **fields)
    return fields["precision"][precision_choice.cpu_kind()]
