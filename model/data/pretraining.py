"""Pretraining examples: Google-style segment packing, next-sentence pairs and dynamic MLM masking.

Per epoch, `plan_instances` walks the documents the way google-research/bert create_pretraining_data.py
does (accumulate sentences until a target length, random split point, 50% random next segment from
another document, unused segments put back), producing token ranges, not token copies. The plan is then
shuffled. Example i of epoch e is built from the plan with a random generator seeded by (seed, e, i):
truncation side and masking are drawn afresh every epoch yet reproducible, so any position resumes exactly.

Departures from Google's script, each on purpose:
  * the short target length (short_seq_prob) is drawn per instance, not once per document;
  * a one-sentence chunk that draws "B follows" takes the document's next sentence as B (or, at the
    document's end, the previous sentence as A), and a one-sentence document that draws it is skipped,
    rather than being forced to a random B: Google's rule tilts NSP towards label 1 on short documents;
  * the random document is drawn from the other documents, never from this one;
  * masking happens when an example is read (dynamic, as RoBERTa), and random replacements are drawn
    from non-special ids only.
For the "pairs" format each line is a fixed (A, B) pair; the negative B is another line's B whose tokens
differ from this line's B.

Reference: google-research/bert `create_pretraining_data.py`; Devlin et al. 2018 section 3.1 and appendix A.1.
"""

from __future__ import annotations

import random
from array import array
from dataclasses import dataclass

import numpy as np
import torch

from model.data.batches import ResumableBatches
from model.data.corpus import TokenizedCorpus

IGNORE_INDEX = -100
# Distinct streams of randomness, so the plan, the order and each example never share draws.
_PLAN, _ORDER, _EXAMPLE = 1, 2, 3


@dataclass
class InstancePlan:
    """One epoch's examples as token ranges of the corpus, in epoch order. B is empty (b_lo == b_hi) without NSP."""

    a_lo: np.ndarray
    a_hi: np.ndarray
    b_lo: np.ndarray
    b_hi: np.ndarray
    is_random_next: np.ndarray  # int8: 0 = B follows A, 1 = B from another document

    def __len__(self) -> int:
        return len(self.a_lo)

    def permuted(self, order: np.ndarray) -> InstancePlan:
        return InstancePlan(*(getattr(self, f)[order] for f in ("a_lo", "a_hi", "b_lo", "b_hi", "is_random_next")))


class _PlanBuilder:
    """Plan columns grown as compact int64 arrays (40 bytes an instance, not a tuple of Python ints)."""

    def __init__(self):
        self.columns = [array("q") for _ in range(5)]

    def add(self, a_lo, a_hi, b_lo, b_hi, is_random):
        for column, value in zip(self.columns, (a_lo, a_hi, b_lo, b_hi, is_random)):
            column.append(value)

    def build(self) -> InstancePlan:
        a_lo, a_hi, b_lo, b_hi, is_random = (np.frombuffer(c, dtype=np.int64) for c in self.columns)
        return InstancePlan(a_lo, a_hi, b_lo, b_hi, is_random.astype(np.int8))


def plan_instances(
    corpus: TokenizedCorpus, max_num_tokens: int, short_seq_prob: float, nsp: bool, rng: random.Random
) -> InstancePlan:
    """Token ranges of every instance of one pass over the corpus, in corpus order."""
    if nsp and corpus.num_documents < 2:
        raise ValueError(
            f"next-sentence prediction needs at least 2 documents; {corpus.path} has {corpus.num_documents}"
        )
    if corpus.format == "pairs":
        return _plan_pairs(corpus, nsp, rng)
    plan = _PlanBuilder()
    for d in range(corpus.num_documents):
        _plan_document(corpus, d, max_num_tokens, short_seq_prob, nsp, rng, plan)
    return plan.build()


def _plan_document(corpus, d, max_num_tokens, short_seq_prob, nsp, rng, plan: _PlanBuilder) -> None:
    s0, s1 = int(corpus.document_offsets[d]), int(corpus.document_offsets[d + 1])
    starts = corpus.sentence_offsets[s0 : s1 + 1].tolist()  # token offset of each sentence, then the end
    n = s1 - s0

    def target() -> int:
        # Mostly fill the sequence; sometimes aim short so the model also sees short inputs.
        return rng.randint(2, max_num_tokens) if rng.random() < short_seq_prob else max_num_tokens

    chunk_start, length, goal, i = 0, 0, target(), 0
    while i < n:
        length += starts[i + 1] - starts[i]
        if i == n - 1 or length >= goal:
            k = i - chunk_start + 1  # sentences in the chunk
            a_end = chunk_start + (rng.randint(1, k - 1) if k >= 2 else 1)  # A is sentences [chunk_start, a_end)
            a_lo, a_hi = starts[chunk_start], starts[a_end]
            if not nsp:
                plan.add(a_lo, starts[i + 1], 0, 0, 0)
            else:
                is_random = rng.random() < 0.5
                if not is_random and k >= 2:
                    plan.add(a_lo, a_hi, a_hi, starts[i + 1], 0)
                elif not is_random and i + 1 < n:  # one sentence: B = the next one, which this chunk consumes
                    i += 1
                    plan.add(a_lo, a_hi, starts[i], starts[i + 1], 0)
                elif not is_random and chunk_start > 0:  # the document's last sentence: A = the one before
                    plan.add(starts[chunk_start - 1], a_lo, a_lo, a_hi, 0)
                # (a one-sentence document has no "B follows A" pair: skipped, rather than skew NSP to 1)
                if is_random:
                    b_lo, b_hi = _random_segment(corpus, d, goal - (a_hi - a_lo), rng)
                    plan.add(a_lo, a_hi, b_lo, b_hi, 1)
                    i = a_end - 1  # put the unused sentences back for the next chunk
            chunk_start, length, goal = i + 1, 0, target()
        i += 1


def _random_segment(corpus: TokenizedCorpus, d: int, target_length: int, rng: random.Random) -> tuple[int, int]:
    """Sentences from a random point of a document other than `d`, until `target_length` tokens (at least one)."""
    other = rng.randrange(corpus.num_documents - 1)
    other += other >= d
    s0, s1 = int(corpus.document_offsets[other]), int(corpus.document_offsets[other + 1])
    start = rng.randrange(s0, s1)
    offsets = corpus.sentence_offsets
    lo = int(offsets[start])
    j = int(np.searchsorted(offsets[start + 1 : s1 + 1], lo + target_length, side="left"))
    hi = int(offsets[min(start + 1 + j, s1)])
    return lo, hi


def _plan_pairs(corpus: TokenizedCorpus, nsp: bool, rng: random.Random) -> InstancePlan:
    # Each document is one line: sentence A then sentence B.
    first = corpus.document_offsets[:-1]
    a_lo, a_hi = corpus.sentence_offsets[first], corpus.sentence_offsets[first + 1]
    b_lo, b_hi = a_hi.copy(), corpus.sentence_offsets[first + 2]
    n = corpus.num_documents
    is_random = np.zeros(n, dtype=np.int8)
    if not nsp:  # one segment: the whole line
        return InstancePlan(a_lo, b_hi, np.zeros(n, np.int64), np.zeros(n, np.int64), is_random)
    tokens = corpus.tokens
    for i in range(n):
        if rng.random() >= 0.5:
            continue
        mine = tokens[b_lo[i] : b_hi[i]]
        for _ in range(10):  # another line's B, and not one that reads the same as this line's B
            j = rng.randrange(n - 1)
            j += j >= i
            if not np.array_equal(tokens[b_lo[j] : b_hi[j]], mine):
                b_lo[i], b_hi[i], is_random[i] = b_lo[j], b_hi[j], 1
                break
    return InstancePlan(a_lo, a_hi, b_lo, b_hi, is_random)


# ---------------------------------------------------------------------------- truncation and masking


def truncate_seq_pair(a: np.ndarray, b: np.ndarray, max_num_tokens: int, rng: np.random.Generator):
    """Google's truncate_seq_pair in closed form: trim the longer side one token at a time, each from the
    front or the back at random, until len(a) + len(b) <= max_num_tokens."""
    la, lb = len(a), len(b)
    excess = la + lb - max_num_tokens
    if excess <= 0:
        return a, b
    cut_a = min(excess, max(la - lb, 0))
    cut_b = min(excess - cut_a, max(lb - la, 0))
    rest = excess - cut_a - cut_b
    cut_b += (rest + 1) // 2  # at a tie Google trims b first, then they alternate
    cut_a += rest // 2
    return _trim(a, cut_a, rng), _trim(b, cut_b, rng)


def _trim(x: np.ndarray, cut: int, rng: np.random.Generator) -> np.ndarray:
    if cut == 0:
        return x
    front = int(rng.binomial(cut, 0.5))
    return x[front : len(x) - (cut - front)]


@dataclass(frozen=True)
class MaskingVocab:
    """What masking needs to know about the vocabulary, as lookup tables over token ids."""

    mask_id: int
    never_mask: np.ndarray  # bool (V,): specials ([CLS], [SEP], [PAD], ...)
    replacement_ids: np.ndarray  # ids a "random token" is drawn from: not special, not [unusedN]
    is_continuation: np.ndarray  # bool (V,): "##" word pieces

    @classmethod
    def from_tokenizer(cls, tokenizer) -> MaskingVocab:
        vocab = tokenizer.convert_ids_to_tokens(list(range(tokenizer.vocab_size)))
        never = np.zeros(len(vocab), dtype=bool)
        never[list(tokenizer.all_special_ids)] = True
        bracketed = np.array([t.startswith("[") and t.endswith("]") for t in vocab], dtype=bool)
        replacement = np.flatnonzero(~never & ~bracketed)
        if len(replacement) == 0:
            raise ValueError("the vocabulary has no ordinary tokens to draw random replacements from")
        continuation = np.array([t.startswith("##") for t in vocab], dtype=bool)
        return cls(tokenizer.mask_token_id, never, replacement, continuation)


def mask_tokens(
    input_ids: np.ndarray,
    vocab: MaskingVocab,
    rng: np.random.Generator,
    masked_lm_prob: float = 0.15,
    max_predictions: int | None = None,
    whole_word: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """BERT's masked-LM corruption of one sequence -> (corrupted ids, labels).

    round(masked_lm_prob * candidates) positions are chosen (at least 1, at most `max_predictions`) among
    non-special tokens; with `whole_word`, a word's "##" pieces are chosen together. A chosen position
    becomes [MASK] 80% of the time, a random ordinary token 10%, stays 10%. Labels hold the original
    id at chosen positions and IGNORE_INDEX elsewhere.
    """
    ids = np.asarray(input_ids, dtype=np.int64)
    labels = np.full_like(ids, IGNORE_INDEX)
    candidates = np.flatnonzero(~vocab.never_mask[ids])
    if len(candidates) == 0:
        return ids.copy(), labels
    num = max(1, int(round(len(candidates) * masked_lm_prob)))
    if max_predictions is not None:
        num = min(num, max_predictions)
    if whole_word:
        chosen = _choose_words(ids, candidates, vocab, num, rng)
    else:
        chosen = rng.choice(candidates, num, replace=False)
    labels[chosen] = ids[chosen]
    out = ids.copy()
    u = rng.random(len(chosen))
    out[chosen[u < 0.8]] = vocab.mask_id
    randomised = chosen[u >= 0.9]
    out[randomised] = rng.choice(vocab.replacement_ids, len(randomised))
    return out, labels


def _choose_words(ids, candidates, vocab: MaskingVocab, num: int, rng) -> np.ndarray:
    # A word starts at a candidate that is not a "##" piece, or that follows a non-candidate (e.g. [SEP]).
    cont = vocab.is_continuation[ids[candidates]]
    follows_prev = np.r_[False, np.diff(candidates) == 1]
    starts = np.flatnonzero(~(cont & follows_prev))
    words = np.split(candidates, starts[1:])
    chosen: list[int] = []
    for w in rng.permutation(len(words)):  # Google: shuffled words, skip any that would overshoot
        if len(chosen) >= num:
            break
        if len(chosen) + len(words[w]) <= num:
            chosen.extend(words[w].tolist())
    return np.array(sorted(chosen), dtype=np.int64)


# ---------------------------------------------------------------------------- the dataset


class PretrainingData(ResumableBatches):
    """Masked-LM (+ next-sentence) batches from a TokenizedCorpus, resumable at any (epoch, batch).

    Batch: input_ids, token_type_ids, attention_mask, labels (B, T) LongTensors padded to the longest
    example in the batch, plus next_sentence_label (B,) when `nsp`.
    """

    def __init__(
        self,
        corpus: TokenizedCorpus,
        tokenizer,
        *,
        batch_size: int = 32,
        max_seq_len: int = 128,
        seed: int = 0,
        nsp: bool = True,
        short_seq_prob: float = 0.1,
        masked_lm_prob: float = 0.15,
        max_predictions_per_seq: int | None = None,
        whole_word_mask: bool = False,
        drop_last: bool = False,
    ):
        super().__init__(batch_size, seed, drop_last)
        specials = 3 if nsp else 2  # [CLS] A [SEP] B [SEP]  or  [CLS] A [SEP]
        if not isinstance(max_seq_len, int) or max_seq_len < specials + 2:
            raise ValueError(f"max_seq_len must be an int >= {specials + 2}, got {max_seq_len!r}")
        if not 0.0 <= short_seq_prob <= 1.0:
            raise ValueError(f"short_seq_prob must be in [0, 1], got {short_seq_prob!r}")
        if not 0.0 < masked_lm_prob < 1.0:
            raise ValueError(f"masked_lm_prob must be in (0, 1), got {masked_lm_prob!r}")
        if max_predictions_per_seq is not None and max_predictions_per_seq < 1:
            raise ValueError(f"max_predictions_per_seq must be >= 1 or None, got {max_predictions_per_seq!r}")
        self.corpus, self.nsp, self.max_seq_len = corpus, nsp, max_seq_len
        self.max_num_tokens = max_seq_len - specials
        self.short_seq_prob, self.masked_lm_prob = short_seq_prob, masked_lm_prob
        self.max_predictions_per_seq, self.whole_word_mask = max_predictions_per_seq, whole_word_mask
        self.vocab = MaskingVocab.from_tokenizer(tokenizer)
        self.cls_id, self.sep_id, self.pad_id = tokenizer.cls_token_id, tokenizer.sep_token_id, tokenizer.pad_token_id
        self._plans: dict[int, InstancePlan] = {}

    def plan(self, epoch: int) -> InstancePlan:
        """This epoch's instances in the order they are served (kept for the two most recent epochs)."""
        if epoch not in self._plans:
            rng = random.Random(hash_seed(self.seed, epoch, _PLAN))
            plan = plan_instances(self.corpus, self.max_num_tokens, self.short_seq_prob, self.nsp, rng)
            order = np.random.default_rng([self.seed, epoch, _ORDER]).permutation(len(plan))
            if len(self._plans) >= 2:
                self._plans.pop(min(self._plans))
            self._plans[epoch] = plan.permuted(order)
        return self._plans[epoch]

    def num_examples(self, epoch: int) -> int:
        return len(self.plan(epoch))

    def example(self, epoch: int, index: int) -> dict[str, np.ndarray | int]:
        """Example `index` of `epoch`, masked; always the same for the same (seed, epoch, index)."""
        p = self.plan(epoch)
        if not 0 <= index < len(p):
            raise IndexError(f"example {index} out of range for epoch {epoch} ({len(p)} examples)")
        rng = np.random.default_rng([self.seed, epoch, index, _EXAMPLE])
        tokens = self.corpus.tokens
        a = np.asarray(tokens[p.a_lo[index] : p.a_hi[index]], dtype=np.int64)
        b = np.asarray(tokens[p.b_lo[index] : p.b_hi[index]], dtype=np.int64)
        a, b = truncate_seq_pair(a, b, self.max_num_tokens, rng)
        ids = np.concatenate([[self.cls_id], a, [self.sep_id]] + ([b, [self.sep_id]] if self.nsp else []))
        types = np.zeros(len(ids), dtype=np.int64)
        types[len(a) + 2 :] = 1
        ids, labels = mask_tokens(
            ids, self.vocab, rng, self.masked_lm_prob, self.max_predictions_per_seq, self.whole_word_mask
        )
        out = {"input_ids": ids, "token_type_ids": types, "labels": labels}
        if self.nsp:
            out["next_sentence_label"] = int(p.is_random_next[index])
        return out

    def collate(self, examples: list[dict]) -> dict[str, torch.Tensor]:
        return collate_pretraining(examples, self.pad_id)


def collate_pretraining(examples: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """Pad to the longest example in this batch (not a global maximum)."""
    length = max(len(e["input_ids"]) for e in examples)
    batch = {
        "input_ids": torch.full((len(examples), length), pad_id, dtype=torch.long),
        "token_type_ids": torch.zeros((len(examples), length), dtype=torch.long),
        "attention_mask": torch.zeros((len(examples), length), dtype=torch.long),
        "labels": torch.full((len(examples), length), IGNORE_INDEX, dtype=torch.long),
    }
    for row, e in enumerate(examples):
        n = len(e["input_ids"])
        batch["input_ids"][row, :n] = torch.from_numpy(np.asarray(e["input_ids"], dtype=np.int64))
        batch["token_type_ids"][row, :n] = torch.from_numpy(np.asarray(e["token_type_ids"], dtype=np.int64))
        batch["labels"][row, :n] = torch.from_numpy(np.asarray(e["labels"], dtype=np.int64))
        batch["attention_mask"][row, :n] = 1
    if "next_sentence_label" in examples[0]:
        batch["next_sentence_label"] = torch.tensor([e["next_sentence_label"] for e in examples], dtype=torch.long)
    return batch


def hash_seed(*parts: int) -> int:
    """One integer seed from several (stable across runs and Python versions, unlike hash())."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(2, dtype=np.uint64)[0])
