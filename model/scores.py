"""Task metrics over whole evaluation sets: entity-level scores for tagging, EM/F1 for SQuAD.

Tagging (token classification): entities are read from tag sequences as seqeval's default mode reads
them (conlleval's chunking: an entity ends at O, at a B-, or where the type changes; an I- after O or
after another type opens one), and one counts as found only when its type, first and last word all
match. Precision, recall and F1 are micro-averaged over all entities; `accuracy` is the share of
words whose tag is right. A denominator of 0 gives 0, as seqeval does.

SQuAD: the official evaluation scripts' normalisation (lowercase, punctuation dropped, the articles
a/an/the dropped, whitespace collapsed) and scores: exact match, and the F1 of the answer's tokens
against the gold's; the best over an example's gold answers. As in v2.0's script an impossible
question's only gold answer is "", and when either side has no tokens F1 is whether both have none.
Scores are fractions 0-1 (the scripts print percentages).

References: seqeval (chakki-works/seqeval, metrics/sequence_labeling.py, get_entities / f1_score);
conlleval.pl (CoNLL-2000); SQuAD evaluate-v1.1.py and evaluate-v2.0.py (Rajpurkar et al. 2016, 2018).
"""

from __future__ import annotations

import collections
import re
import string
from collections.abc import Iterable, Mapping, Sequence

# ---------------------------------------------------------------------------- tagging


def entities(tags: Sequence[str]) -> list[tuple[str, int, int]]:
    """(type, first, last) of each entity in one IOB2 tag sequence, read as seqeval's default mode."""
    found, prev_tag, prev_type, begin = [], "O", "", 0
    for i, tag in enumerate([*tags, "O"]):
        prefix, type_ = tag[0], (tag[2:] if len(tag) > 2 else "_")
        if _chunk_ends(prev_tag, prefix, prev_type, type_):
            found.append((prev_type, begin, i - 1))
        if _chunk_starts(prev_tag, prefix, prev_type, type_):
            begin = i
        prev_tag, prev_type = prefix, type_
    return found


def _chunk_ends(prev: str, tag: str, prev_type: str, type_: str) -> bool:
    return (prev in "BI" and tag in "BO") or (prev != "O" and prev_type != type_)


def _chunk_starts(prev: str, tag: str, prev_type: str, type_: str) -> bool:
    return tag == "B" or (prev == "O" and tag == "I") or (tag != "O" and prev_type != type_)


def tagging_counts(gold: Sequence[str], predicted: Sequence[str]) -> dict[str, int]:
    """Counts of one sentence that `tagging_metrics` sums: entities right, predicted, gold; words right, all."""
    if len(gold) != len(predicted):
        raise ValueError(f"{len(gold)} gold tags but {len(predicted)} predicted")
    true_entities, pred_entities = set(entities(gold)), set(entities(predicted))
    return {
        "entities_correct": len(true_entities & pred_entities),
        "entities_predicted": len(pred_entities),
        "entities_gold": len(true_entities),
        "words_correct": sum(g == p for g, p in zip(gold, predicted)),
        "words": len(gold),
    }


def tagging_metrics(counts: Mapping[str, float]) -> dict[str, float]:
    """precision, recall, f1 (entities, micro) and accuracy (words) from summed `tagging_counts`."""
    correct = counts["entities_correct"]
    precision = correct / counts["entities_predicted"] if counts["entities_predicted"] else 0.0
    recall = correct / counts["entities_gold"] if counts["entities_gold"] else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    accuracy = counts["words_correct"] / counts["words"] if counts["words"] else 0.0
    return {"precision": precision, "recall": recall, "f1": f1, "accuracy": accuracy}


def tagging_scores(gold: Iterable[Sequence[str]], predicted: Iterable[Sequence[str]]) -> dict[str, float]:
    """tagging_metrics over sentences of gold and predicted tags."""
    totals: collections.Counter[str] = collections.Counter()
    for g, p in zip(gold, predicted, strict=True):
        totals.update(tagging_counts(g, p))
    return tagging_metrics(totals)


# ---------------------------------------------------------------------------- SQuAD

_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)
_PUNCTUATION = set(string.punctuation)


def normalize_answer(s: str) -> str:
    """Lowercase, drop punctuation, drop articles, collapse whitespace (the official scripts' order)."""
    s = "".join(ch for ch in s.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", s).split())


def exact_match(prediction: str, gold: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(gold))


def answer_f1(prediction: str, gold: str) -> float:
    pred_tokens, gold_tokens = normalize_answer(prediction).split(), normalize_answer(gold).split()
    if not pred_tokens or not gold_tokens:
        return float(pred_tokens == gold_tokens)
    same = sum((collections.Counter(pred_tokens) & collections.Counter(gold_tokens)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred_tokens), same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def squad_scores(predictions: dict[str, str], golds: dict[str, list[str]]) -> dict[str, float]:
    """exact_match and f1 (fractions) of `predictions` (id -> text) against `golds` (id -> answer texts;
    [] for an impossible question), averaged over the gold ids; a missing prediction scores 0."""
    if not golds:
        raise ValueError("no gold answers to score against")
    em = f1 = 0.0
    for qid, answers in golds.items():
        answers = [a for a in answers if normalize_answer(a)] or [""]
        prediction = predictions.get(qid)
        if prediction is None:
            continue
        em += max(exact_match(prediction, a) for a in answers)
        f1 += max(answer_f1(prediction, a) for a in answers)
    return {"exact_match": em / len(golds), "f1": f1 / len(golds)}
