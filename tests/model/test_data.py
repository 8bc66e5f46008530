"""Tests for model/data (corpora, cache, packing, NSP, masking, resumption, fine-tuning tables) and
app/launcher/demo_data (converters on the real demo assets). Tiny synthetic corpora and a ~90-token vocabulary."""

from __future__ import annotations

import bz2
import csv
import importlib
import json
import random
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import torch

import model.data.corpus as corpus_mod
from app.launcher.demo_data import (
    AssetMissingError,
    find_asset,
    prepare_rotten_tomatoes,
    prepare_wiki,
    write_heldout_leads,
)
from model.data.corpus import detect_format, load_corpus, split_sentences
from model.data.finetune import ClassificationBatches, build_label_map, load_classification_data, split_holdout
from model.data.pretraining import (
    IGNORE_INDEX,
    InstancePlan,
    MaskingVocab,
    PretrainingData,
    mask_tokens,
    truncate_seq_pair,
)
from model.model_card import HELDOUT_FILE, heldout_leads
from model.tokenizer import BertTokenizer

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "[unused0]"]
WORDS = (
    "the a cat dog bird fish tree house river stone cloud rain sun moon star road car boat train plane "
    "red blue green small big old new fast slow happy walk run jump sing read write play look talk"
).split()
PIECES = ["##s", "##ing", "##ed", "##er", "##ly"]
VOCAB = SPECIALS + [".", ","] + WORDS + PIECES + [w + "s" for w in WORDS[:10]]


@pytest.fixture(scope="module")
def tok():
    return BertTokenizer.from_vocab(VOCAB)


def _sentence(rng: random.Random, lo=4, hi=14) -> str:
    words = []
    for _ in range(rng.randint(lo, hi)):
        w = rng.choice(WORDS)
        # Suffixes the vocab lacks as whole words give multi-piece words: "jumping" -> jump ##ing.
        words.append(w + rng.choice(["", "", "ing", "ed", "er"]) if len(w) > 3 else w)
    return " ".join(words).capitalize() + "."


def _google_corpus(path: Path, n_docs=30, sentences=(8, 20), seed=0) -> list[list[str]]:
    rng = random.Random(seed)
    docs = [[_sentence(rng) for _ in range(rng.randint(*sentences))] for _ in range(n_docs)]
    path.write_text("\n\n".join("\n".join(d) for d in docs) + "\n", encoding="utf-8")
    return docs


@pytest.fixture(scope="module")
def google(tmp_path_factory, tok):
    path = tmp_path_factory.mktemp("corpus") / "google.txt"
    docs = _google_corpus(path)
    return load_corpus(path, tok), docs


# ---------------------------------------------------------------------------- corpus formats


def test_split_sentences_keeps_abbreviations_and_initials():
    text = "Dr. Smith met J. R. R. Tolkien in 1950. They talked! Did it rain? Yes.\nNew line here"
    assert split_sentences(text) == [
        "Dr. Smith met J. R. R. Tolkien in 1950.",
        "They talked!",
        "Did it rain?",
        "Yes.",
        "New line here",
    ]


def test_cached_tokens_match_tokenizer_and_documents(google, tok):
    corpus, docs = google
    assert corpus.format == "google"
    assert corpus.num_documents == len(docs)
    assert corpus.num_sentences == sum(len(d) for d in docs)
    assert corpus.tokens.dtype == np.uint16 and isinstance(corpus.tokens, np.memmap)
    for d in (0, 7, len(docs) - 1):
        got = [s.tolist() for s in corpus.document(d)]
        assert got == [tok.encode(s)["input_ids"][1:-1] for s in docs[d]]


def test_format_detection_and_override(tmp_path, tok):
    pairs = tmp_path / "pairs.txt"
    pairs.write_text("the cat.\tthe dog.\nred sun.\tblue moon.\n")
    text = tmp_path / "prose.txt"
    text.write_text("The cat ran. The dog sat. A bird sang.\nIt was red. It was big.\n\nNew paragraph. Second one.\n")
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text(json.dumps({"body": "The cat ran. The dog sat."}) + "\n" + json.dumps({"body": "Red sun."}) + "\n")
    google = tmp_path / "g.txt"
    google.write_text("The cat ran.\nThe dog sat.\n\nRed sun.\n")
    assert [detect_format(p) for p in (pairs, text, jsonl, google)] == ["pairs", "text", "jsonl", "google"]

    prose = load_corpus(text, tok)
    assert (prose.format, prose.num_documents, prose.num_sentences) == ("text", 2, 7)
    docs = load_corpus(jsonl, tok, text_field="body")
    assert (docs.num_documents, docs.num_sentences) == (2, 3)
    as_google = load_corpus(text, tok, format="google")  # override: every line is one sentence
    assert (as_google.format, as_google.num_sentences) == ("google", 3)
    with pytest.raises(ValueError, match=r"line 1: no 'text' field"):
        load_corpus(jsonl, tok)
    with pytest.raises(ValueError, match="unknown corpus format 'xml'"):
        load_corpus(text, tok, format="xml")
    single = tmp_path / "single.txt"
    single.write_text("The cat ran.\nThe dog sat.\n")
    one_doc = load_corpus(single, tok)
    assert (one_doc.format, one_doc.num_documents, one_doc.num_sentences) == ("google", 1, 2)
    with pytest.raises(ValueError, match="needs at least 2 documents"):
        PretrainingData(one_doc, tok).num_batches(0)


def test_empty_corpus_is_an_error_and_leaves_no_files(tmp_path, tok):
    path = tmp_path / "empty.txt"
    path.write_text("\n\n   \n")
    with pytest.raises(ValueError, match="empty"):
        load_corpus(path, tok)
    with pytest.raises(ValueError, match="has no text"):
        load_corpus(path, tok, format="google")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.txt"]


def test_pairs_line_without_tab_names_file_and_line(tmp_path, tok):
    path = tmp_path / "seed.tsv"
    path.write_text("the cat.\tthe dog.\nred sun.\tblue moon.\nno tab on this line\n")
    with pytest.raises(ValueError) as err:
        load_corpus(path, tok)
    assert str(path) in str(err.value) and "line 3" in str(err.value) and "no tab" in str(err.value)
    assert not list(tmp_path.glob("*.npy")) and not list(tmp_path.glob(".*"))  # no half-written cache left


def test_cache_is_reused_and_invalidated_when_corpus_changes(tmp_path, tok, monkeypatch):
    path = tmp_path / "c.txt"
    _google_corpus(path, n_docs=4, sentences=(2, 3))
    calls = []
    real = corpus_mod.encode_sentences
    monkeypatch.setattr(corpus_mod, "encode_sentences", lambda t, s: calls.append(len(s)) or real(t, s))

    first = load_corpus(path, tok)
    assert calls and first.num_documents == 4
    tokens_file = next(tmp_path.glob("c.txt.*.tokens.npy"))
    mtime = tokens_file.stat().st_mtime_ns
    calls.clear()
    again = load_corpus(path, tok)
    assert calls == [] and tokens_file.stat().st_mtime_ns == mtime
    np.testing.assert_array_equal(again.tokens, first.tokens)

    with open(path, "a") as f:
        f.write("\nThe red boat.\n")
    changed = load_corpus(path, tok)
    assert calls and changed.num_documents == 5
    assert changed.sentence(changed.num_sentences - 1).tolist() == tok.encode("The red boat.")["input_ids"][1:-1]

    other = BertTokenizer.from_vocab(VOCAB, lowercase=False)  # another tokenizer: its own cache files
    load_corpus(path, other)
    assert len(list(tmp_path.glob("c.txt.*.tokens.npy"))) == 2


# ---------------------------------------------------------------------------- packing and NSP


def test_packing_lengths(google, tok):
    corpus, _ = google
    data = PretrainingData(corpus, tok, max_seq_len=64, short_seq_prob=0.1, seed=1)
    lengths = np.array([len(data.example(0, i)["input_ids"]) for i in range(data.num_examples(0))])
    assert lengths.max() <= 64
    assert np.mean(lengths >= 56) > 0.6  # most fill (almost) the whole sequence
    assert 0 < np.mean(lengths < 40) < 0.3  # some are short on purpose (short_seq_prob), few


def test_truncate_seq_pair_trims_longer_side_to_budget():
    rng = np.random.default_rng(0)
    a, b = np.arange(30), np.arange(100, 110)
    ta, tb = truncate_seq_pair(a, b, 20, rng)
    assert (len(ta), len(tb)) == (10, 10)
    assert ta.tolist() == list(range(ta[0], ta[0] + 10))  # a contiguous slice: trimmed at the ends only
    ta, tb = truncate_seq_pair(np.arange(9), np.arange(9), 15, rng)
    assert (len(ta), len(tb)) == (8, 7)
    assert [len(x) for x in truncate_seq_pair(np.arange(3), np.arange(4), 10, rng)] == [3, 4]


def test_nsp_balanced_negatives_from_other_documents_positives_consecutive(google, tok):
    corpus, _ = google
    data = PretrainingData(corpus, tok, max_seq_len=48, seed=3)
    plans = [data.plan(e) for e in range(8)]  # each epoch packs anew: pool them for the statistics
    fields = ("a_lo", "a_hi", "b_lo", "b_hi", "is_random_next")
    plan = InstancePlan(*(np.concatenate([getattr(p, f) for p in plans]) for f in fields))
    rand = plan.is_random_next.astype(bool)
    assert 0.46 < rand.mean() < 0.54 and len(plan) > 1000
    doc_a = corpus.document_of_token(plan.a_lo)
    doc_a_end = corpus.document_of_token(plan.a_hi - 1)
    doc_b = corpus.document_of_token(plan.b_lo)
    doc_b_end = corpus.document_of_token(plan.b_hi - 1)
    assert (doc_a == doc_a_end).all() and (doc_b == doc_b_end).all()  # segments never straddle documents
    assert (doc_a[rand] != doc_b[rand]).all()
    assert (doc_a[~rand] == doc_b[~rand]).all() and (plan.b_lo[~rand] == plan.a_hi[~rand]).all()
    starts = set(corpus.sentence_offsets.tolist())
    assert all(int(x) in starts for x in np.r_[plan.a_lo, plan.a_hi, plan.b_lo, plan.b_hi])
    # The served example is [CLS] A [SEP] B [SEP] with the plan's label.
    ex = data.example(0, 0)
    assert ex["next_sentence_label"] == plan.is_random_next[0]
    ids, types = ex["input_ids"], ex["token_type_ids"]
    seps = np.flatnonzero(ids == tok.sep_token_id)
    assert ids[0] == tok.cls_token_id and len(seps) == 2 and seps[1] == len(ids) - 1
    assert (types[: seps[0] + 1] == 0).all() and (types[seps[0] + 1 :] == 1).all()


def test_pairs_format_negatives_are_other_lines_b(tmp_path, tok):
    rng = random.Random(0)
    lines = [(_sentence(rng, 2, 6), _sentence(rng, 2, 6)) for _ in range(200)]
    lines += [(lines[0][0], lines[0][1])]  # a duplicate line: its negatives must still differ from its B
    path = tmp_path / "seed.txt"
    path.write_text("".join(f"{a}\t{b}\n" for a, b in lines))
    corpus = load_corpus(path, tok)
    assert corpus.format == "pairs" and corpus.num_documents == len(lines)
    data = PretrainingData(corpus, tok, max_seq_len=64, seed=0)
    plan = data.plan(0)
    rand = plan.is_random_next.astype(bool)
    assert 0.4 < rand.mean() < 0.6
    line_a = corpus.document_of_token(plan.a_lo)
    line_b = corpus.document_of_token(plan.b_lo)
    assert (line_a[~rand] == line_b[~rand]).all() and (line_a[rand] != line_b[rand]).all()
    for i in np.flatnonzero(rand):
        own_b = corpus.sentence(corpus.document_offsets[line_a[i]] + 1)
        assert not np.array_equal(corpus.tokens[plan.b_lo[i] : plan.b_hi[i]], own_b)


# ---------------------------------------------------------------------------- masking


@pytest.fixture(scope="module")
def mvocab(tok):
    return MaskingVocab.from_tokenizer(tok)


def _sequences(tok, n, rng):
    body = rng.integers(6, len(VOCAB), size=(n, 98))
    return [np.r_[tok.cls_token_id, row[:40], tok.sep_token_id, row[40:], tok.sep_token_id, 0, 0] for row in body]


def test_masking_statistics(tok, mvocab):
    rng = np.random.default_rng(0)
    selected = candidates = as_mask = as_random = kept = 0
    for ids in _sequences(tok, 1500, rng):
        out, labels = mask_tokens(ids, mvocab, rng)
        special = np.isin(ids, tok.all_special_ids)
        sel = labels != IGNORE_INDEX
        assert not (sel & special).any() and (out[special] == ids[special]).all()
        assert (labels[sel] == ids[sel]).all() and (out[~sel] == ids[~sel]).all()
        replaced = out[sel & (out != tok.mask_token_id)]
        assert not np.isin(replaced, tok.all_special_ids + [VOCAB.index("[unused0]")]).any()
        selected += sel.sum()
        candidates += (~special).sum()
        as_mask += (out[sel] == tok.mask_token_id).sum()
        kept += (out[sel] == ids[sel]).sum()
        as_random += ((out[sel] != ids[sel]) & (out[sel] != tok.mask_token_id)).sum()
    assert abs(selected / candidates - 0.15) < 0.005
    assert abs(as_mask / selected - 0.8) < 0.015
    assert abs(as_random / selected - 0.1) < 0.01
    assert abs(kept / selected - 0.1) < 0.01


def test_max_predictions_per_seq(tok, mvocab):
    rng = np.random.default_rng(1)
    for ids in _sequences(tok, 50, rng):
        _, labels = mask_tokens(ids, mvocab, rng, max_predictions=5)
        assert (labels != IGNORE_INDEX).sum() == 5


def test_whole_word_masking_masks_whole_words(tok, mvocab):
    rng = np.random.default_rng(2)
    text = " ".join(["jumping talked walker reads happily cat dog sings"] * 4)
    ids = np.array(tok.encode(text)["input_ids"])
    tokens = tok.convert_ids_to_tokens(ids.tolist())
    word_of = np.cumsum([not t.startswith("##") for t in tokens])
    assert sum(t.startswith("##") for t in tokens) >= 12
    for _ in range(200):
        _, labels = mask_tokens(ids, mvocab, rng, whole_word=True)
        sel = labels != IGNORE_INDEX
        for w in np.unique(word_of[sel]):
            assert sel[word_of == w].all(), f"part of word {w} masked: {tokens}"
        assert 0 < sel.sum() <= round(0.15 * (len(ids) - 2))


def test_batches_pad_to_longest_in_batch(google, tok):
    corpus, _ = google
    data = PretrainingData(corpus, tok, batch_size=4, max_seq_len=64, short_seq_prob=1.0, seed=0)
    for batch in list(data.iter_batches(0))[:10]:
        lengths = batch["attention_mask"].sum(1)
        assert batch["input_ids"].shape[1] == lengths.max() <= 64
        pad = batch["attention_mask"] == 0
        assert (batch["input_ids"][pad] == tok.pad_token_id).all() and (batch["labels"][pad] == IGNORE_INDEX).all()
        assert set(batch) == {"input_ids", "token_type_ids", "attention_mask", "labels", "next_sentence_label"}


# ---------------------------------------------------------------------------- determinism and resumption


def _same(b1, b2) -> bool:
    return b1.keys() == b2.keys() and all(torch.equal(b1[k], b2[k]) for k in b1)


def test_same_seed_and_epoch_same_batches_new_epoch_new_masks(google, tok):
    corpus, _ = google

    def make(seed):
        return PretrainingData(corpus, tok, batch_size=8, max_seq_len=48, seed=seed)

    one, two = list(make(5).iter_batches(0)), list(make(5).iter_batches(0))
    assert len(one) == len(two) > 5 and all(_same(a, b) for a, b in zip(one, two))
    assert not _same(one[0], next(make(6).iter_batches(0)))
    data = make(5)
    ex0, ex1 = data.example(0, 3), data.example(1, 3)
    assert not np.array_equal(ex0["labels"], ex1["labels"])
    # Same instance in two epochs: the masks still differ.
    p0, p1 = data.plan(0), data.plan(1)
    key1 = {(a, b): i for i, (a, b) in enumerate(zip(p1.a_lo.tolist(), p1.b_lo.tolist()))}
    shared = [(i, key1[k]) for i, k in enumerate(zip(p0.a_lo.tolist(), p0.b_lo.tolist())) if k in key1]
    assert shared
    differ = [not np.array_equal(data.example(0, i)["labels"], data.example(1, j)["labels"]) for i, j in shared[:20]]
    assert np.mean(differ) > 0.8


def test_resume_at_batch_k_matches_uninterrupted(google, tok):
    corpus, _ = google
    data = PretrainingData(corpus, tok, batch_size=8, max_seq_len=48, seed=7, whole_word_mask=True)
    full = list(data.iter_batches(1))
    k = 4
    fresh = PretrainingData(corpus, tok, batch_size=8, max_seq_len=48, seed=7, whole_word_mask=True)
    resumed = list(fresh.iter_batches(1, k))
    assert len(resumed) == len(full) - k and all(_same(a, b) for a, b in zip(full[k:], resumed))


def test_state_dict_round_trip(google, tok):
    corpus, _ = google
    kwargs = {"batch_size": 8, "max_seq_len": 48, "seed": 9}
    data = PretrainingData(corpus, tok, **kwargs)
    stream = iter(data)
    for _ in range(3):
        next(stream)
    state = json.loads(json.dumps(data.state_dict()))  # JSON-safe, as a checkpoint stores it
    assert state == {"epoch": 0, "example": 24, "seed": 9}
    rest = list(stream)
    assert data.state_dict() == {"epoch": 1, "example": 0, "seed": 9}

    again = PretrainingData(corpus, tok, **kwargs)
    again.load_state_dict(state)
    assert all(_same(a, b) for a, b in zip(rest, list(again), strict=True))
    with pytest.raises(ValueError, match="seed 9"):
        PretrainingData(corpus, tok, batch_size=8, max_seq_len=48, seed=1).load_state_dict(state)


def test_epoch_dataset_with_dataloader_matches_iter_batches(google, tok):
    corpus, _ = google
    data = PretrainingData(corpus, tok, batch_size=8, max_seq_len=48, seed=2, nsp=False)
    loader = torch.utils.data.DataLoader(data.epoch_dataset(0), batch_size=8, collate_fn=data.collate)
    assert all(_same(a, b) for a, b in zip(loader, data.iter_batches(0), strict=True))
    assert "next_sentence_label" not in next(iter(loader))
    assert (next(iter(loader))["token_type_ids"] == 0).all()


# ---------------------------------------------------------------------------- fine-tuning data


def _write_csv(path: Path, header, rows, delimiter=","):
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f, delimiter=delimiter)
        w.writerow(header)
        w.writerows(rows)


def test_label_map_sorted_and_stable(tmp_path):
    assert build_label_map(["pos", "neg", "neutral", "neg"]) == (
        {0: "neg", 1: "neutral", 2: "pos"},
        {"neg": 0, "neutral": 1, "pos": 2},
    )
    assert build_label_map(["10", "2", "1"])[0] == {0: "1", 1: "2", 2: "10"}
    train, evals = tmp_path / "train.csv", tmp_path / "eval.csv"
    _write_csv(train, ["text", "label"], [("good film", "pos"), ("bad film", "neg"), ("ok film", "pos")])
    _write_csv(evals, ["text", "label"], [("great", "pos"), ("awful", "neg")])
    data = load_classification_data(train, evals)
    assert data.id2label == {0: "neg", 1: "pos"} and data.num_labels == 2
    assert [e.label for e in data.train] == [1, 0, 1] and [e.label for e in data.eval] == [1, 0]
    assert data.config_updates()["label2id"] == {"neg": 0, "pos": 1}


def test_finetune_errors_name_the_problem(tmp_path):
    train, evals = tmp_path / "train.csv", tmp_path / "eval.csv"
    _write_csv(train, ["sentence", "label"], [("a", "x")])
    with pytest.raises(ValueError, match=r"missing column\(s\) \['text'\]; found \['label', 'sentence'\]"):
        load_classification_data(train)
    _write_csv(train, ["text", "label"], [("a", "x"), ("b", "y")])
    _write_csv(evals, ["text", "label"], [("c", "x"), ("d", "z")])
    with pytest.raises(ValueError, match=r"eval.csv, line 3: unknown label 'z'"):
        load_classification_data(train, evals)
    empty = tmp_path / "empty.csv"
    empty.write_text("")
    with pytest.raises(ValueError, match="empty"):
        load_classification_data(empty)
    header_only = tmp_path / "header.tsv"
    header_only.write_text("text\tlabel\n")
    with pytest.raises(ValueError, match="no data rows"):
        load_classification_data(header_only)
    with pytest.raises(ValueError, match=r"missing column\(s\) \['premise'\]"):
        load_classification_data(train, text_pair_column="premise")
    with pytest.raises(ValueError, match=r"line 2: 'label' is 'x', not a number"):
        load_classification_data(train, regression=True)


CLOSE_IT = 'close the field with a " (a " inside a quoted field is written "")'
NEVER_CLOSED = f"a quoted field opens here and is never closed (the file ends inside it); {CLOSE_IT}"


@pytest.mark.parametrize(
    "text, message",
    [
        # csv would read lines 2-4 as one row whose label is missing (an empty label on line 4)
        ('text,label\n"hello,pos\nworld,neg\nfoo,pos\n', f"line 2: {NEVER_CLOSED}"),
        ('text,label\r\n"hello,pos\r\nworld,neg', f"line 2: {NEVER_CLOSED}"),
        ('text,label\nok,pos\n"hello,pos\n\n', f"line 3: {NEVER_CLOSED}"),  # on the last line
        ('text,"label\nok,pos\n', f"line 1: {NEVER_CLOSED}"),  # in the header
        ('text,label\n"a\nb",pos\nok,neg\nx,"never\n', f"line 5: {NEVER_CLOSED}"),  # after a row of two lines
        # a quote-everything file: the stray quote pairs with the next one, and csv would join rows 3 and 4
        (
            'text,label\n"hello",pos\n"oops,neg\n"world",pos\n"x",neg\n',
            "line 3: a quoted field opens in this row and is not closed where the field ends: the row runs on to the "
            f'" on line 4, which other text follows; {CLOSE_IT}',
        ),
    ],
)
def test_an_unclosed_quote_is_named_where_it_opens(tmp_path, text, message):
    path = tmp_path / "train.csv"
    path.write_bytes(text.encode())
    with pytest.raises(ValueError) as e:
        load_classification_data(path)
    assert str(e.value) == f"{path}, {message}"


def test_quoted_fields_over_lines_are_read(tmp_path):
    path = tmp_path / "train.csv"
    path.write_text('text,label\n"two\n\nparagraphs",pos\n\n"a ""quote""",neg\n"ends in a break\n",pos')
    data = load_classification_data(path, eval_fraction=0.5)
    assert sorted(e.text for e in data.train + data.eval) == ['a "quote"', "ends in a break\n", "two\n\nparagraphs"]


def test_group_split_keeps_groups_on_one_side(tmp_path):
    rows = [(f"review {i}", ["fresh", "rotten"][i % 2], f"film{i % 23}") for i in range(400)]
    path = tmp_path / "train.tsv"
    _write_csv(path, ["text", "label", "film"], rows, delimiter="\t")
    data = load_classification_data(path, eval_fraction=0.2, group_column="film", seed=4)
    assert not set(data.groups["train"]) & set(data.groups["eval"])
    assert len(data.train) + len(data.eval) == 400 and 0.15 < len(data.eval) / 400 < 0.3
    film_of = {t: f for t, _, f in rows}
    assert not {film_of[e.text] for e in data.train} & {film_of[e.text] for e in data.eval}
    again = load_classification_data(path, eval_fraction=0.2, group_column="film", seed=4)
    assert [e.text for e in again.eval] == [e.text for e in data.eval]  # seeded
    tr, ev = split_holdout(10, 0.3, seed=0)
    assert len(ev) == 3 and sorted(np.r_[tr, ev].tolist()) == list(range(10))


def test_jsonl_pairs_regression_and_batches(tmp_path, tok):
    path = tmp_path / "sts.jsonl"
    records = [{"text": f"the cat {w}", "text_pair": f"the dog {w}", "label": i / 10} for i, w in enumerate(WORDS[:20])]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    data = load_classification_data(path, regression=True, eval_fraction=0.25)
    assert data.is_pair and data.regression and data.num_labels == 1
    assert data.config_updates() == {
        "id2label": {0: "LABEL_0"},
        "label2id": {"LABEL_0": 0},
        "problem_type": "regression",
    }
    batches = ClassificationBatches(data.train, tok, batch_size=4, max_seq_len=12, regression=True, seed=1)
    batch = next(batches.iter_batches(0))
    assert batch["labels"].dtype == torch.float32 and batch["input_ids"].shape[0] == 4
    assert batch["input_ids"].shape[1] <= 12 and (batch["token_type_ids"].sum(1) > 0).all()
    assert len(list(batches.iter_batches(0))) == 4 == batches.num_batches(0)
    epoch2 = [b["labels"].tolist() for b in batches.iter_batches(2)]
    assert [b["labels"].tolist() for b in batches.iter_batches(2, 1)] == epoch2[1:]
    assert epoch2 != [b["labels"].tolist() for b in batches.iter_batches(3)]  # reshuffled each epoch


# ---------------------------------------------------------------------------- demo converters (real assets)


def test_find_asset_missing_tells_how_to_install(monkeypatch):
    assert (find_asset("minilm") / "vocab.txt").is_file()
    monkeypatch.setitem(importlib.import_module("app.launcher.demo_data").ASSETS, "wiki", "no_such_pkg/x.json")
    with pytest.raises(AssetMissingError, match="make demo-data"):
        find_asset("wiki")


def test_prepare_wiki_google_format_without_the_heldout_leads(tmp_path):
    out = tmp_path / "wiki.txt"
    stats = prepare_wiki(out)
    assert stats["articles"] == 10033 - 156 and stats["sentences"] > 2 * stats["articles"]
    blocks = out.read_text(encoding="utf-8").split("\n\n")
    assert len(blocks) == stats["articles"]
    # The held-out leads model cards are measured on are the shipped file's, and none is in the corpus.
    assert write_heldout_leads(tmp_path / "heldout.jsonl") == 156
    assert (tmp_path / "heldout.jsonl").read_bytes() == HELDOUT_FILE.read_bytes()
    lines = [line for b in blocks for line in b.strip("\n").split("\n")]
    assert not {sentences[0] for _, sentences in heldout_leads()} & set(lines)
    assert len(lines) == stats["sentences"] and all(line.strip() == line and line for line in lines)
    assert lines[0].startswith("20th-century classical music is Western art music")
    assert detect_format(out) == "google"
    small = prepare_wiki(tmp_path / "small.txt", limit=5)
    assert small["articles"] == 5 and (tmp_path / "small.txt").read_text().count("\n\n") == 4


def test_prepare_rotten_tomatoes_split_by_film(tmp_path):
    stats = prepare_rotten_tomatoes(tmp_path, eval_fraction=0.15, seed=0)
    splits = {}
    for split in ("train", "eval"):
        with open(tmp_path / f"{split}.csv", newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            assert reader.fieldnames == ["text", "label"]
            splits[split] = list(reader)
    labels = [r["label"] for rows in splits.values() for r in rows]
    assert labels.count("fresh") == 7403 and labels.count("rotten") == 5405 and len(labels) == 12808
    assert 0.1 < len(splits["eval"]) / len(labels) < 0.2 and stats["eval_rows"] == len(splits["eval"])
    # Trace each review back to its film through the asset itself (reviews with a unique text).
    films_of = defaultdict(set)
    with bz2.open(find_asset("rotten_tomatoes"), "rt", encoding="utf-8", newline="") as f:
        for row in csv.DictReader(f):
            films_of[row["text"].strip()].add(row["movie_name"])
    film_sets = {
        split: {next(iter(films_of[r["text"]])) for r in rows if len(films_of[r["text"]]) == 1}
        for split, rows in splits.items()
    }
    assert film_sets["train"] and film_sets["eval"] and not film_sets["train"] & film_sets["eval"]
    again = prepare_rotten_tomatoes(tmp_path / "again", eval_fraction=0.15, seed=0)
    assert (tmp_path / "again" / "eval.csv").read_bytes() == (tmp_path / "eval.csv").read_bytes()
    assert again["train_rows"] == stats["train_rows"]
    data = load_classification_data(tmp_path / "train.csv", tmp_path / "eval.csv")
    assert data.id2label == {0: "fresh", 1: "rotten"}
