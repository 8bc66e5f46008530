"""Tests for model/data/question_answering: the SQuAD reader and the exact text of each of its errors, and
the training windows against a straight re-implementation of transformers' run_qa.py
`prepare_train_features` on transformers' own BertTokenizerFast (tiny vocab and MiniLM's)."""

from __future__ import annotations

import bz2
import copy
import json

import pytest

from model.data.question_answering import (
    QABatches,
    QAExample,
    WindowMisfit,
    answer_tokens,
    check_window,
    cut_questions,
    default_doc_stride,
    encode_squad,
    load_qa_data,
    read_squad,
)
from model.tokenizer import BertTokenizer

CONTEXT = "the cat sat on the mat . the dog eats bread"
SQUAD = {
    "version": "v2.0",
    "data": [
        {
            "title": "pets",
            "paragraphs": [
                {
                    "context": CONTEXT,
                    "qas": [
                        {
                            "id": "q1",
                            "question": "what sat on the mat ?",
                            "answers": [{"text": "the cat", "answer_start": 0}],
                        },
                        {
                            "id": "q2",
                            "question": "what does the dog eat ?",
                            "answers": [
                                {"text": "bread", "answer_start": 38},
                                {"text": "eats bread", "answer_start": 33},
                            ],
                        },
                        {"id": "q3", "question": "what is blue ?", "answers": [], "is_impossible": True},
                    ],
                }
            ],
        }
    ],
}


def write(path, doc):
    path.write_text(json.dumps(doc))
    return path


# ---------------------------------------------------------------------------- reading


def test_reads_v2_questions_all_answers_and_impossible(tmp_path):
    examples = read_squad(write(tmp_path / "dev.json", SQUAD))
    assert [(e.id, e.answers, e.answer_starts, e.is_impossible) for e in examples] == [
        ("q1", ["the cat"], [0], False),
        ("q2", ["bread", "eats bread"], [38, 33], False),
        ("q3", [], [], True),
    ]
    assert {e.context for e in examples} == {CONTEXT}


def test_reads_bz2_and_holds_out(tmp_path):
    path = tmp_path / "train.json.bz2"
    path.write_bytes(bz2.compress(json.dumps(SQUAD).encode()))
    data = load_qa_data(path, eval_fraction=0.34, seed=0)
    assert sorted(e.id for e in data.train + data.eval) == ["q1", "q2", "q3"]
    assert len(data.eval) == 1 and data.has_impossible


def broken(edit):
    doc = copy.deepcopy(SQUAD)
    edit(doc, doc["data"][0]["paragraphs"][0])
    return doc


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda d, p: p["qas"][0]["answers"][0].update(answer_start=4),
            "question 'q1': answers[0] 'the cat' is not at answer_start 4 of the context (found 'cat sat')",
        ),
        (
            lambda d, p: p["qas"][1]["answers"][1].update(text="eats  bread"),
            "question 'q2': answers[1] 'eats  bread' is not at answer_start 33 of the context (found 'eats bread')",
        ),
        (lambda d, p: p["qas"][1].update(id="q1"), "question id 'q1' appears more than once"),
        (lambda d, p: p["qas"][0].update(question="  "), "question 'q1': 'question' is empty or not text"),
        (lambda d, p: p.update(context=""), "data[0].paragraphs[0]: 'context' is empty or not text"),
        (lambda d, p: p["qas"][0].update(answers=[]), "question 'q1' has no answers (and is not is_impossible)"),
        (
            lambda d, p: p["qas"][2].update(answers=[{"text": "the", "answer_start": 0}]),
            "question 'q3' is_impossible but has 1 answer(s)",
        ),
        (
            lambda d, p: p["qas"][0]["answers"][0].pop("answer_start"),
            "question 'q1': answers[0] needs a non-empty 'text' and an integer 'answer_start', got {'text': 'the cat'}",
        ),
        (lambda d, p: p["qas"][0].pop("id"), "data[0].paragraphs[0].qas[0]: a question needs an 'id'"),
        (lambda d, p: d.pop("data"), "not SQuAD JSON: expected an object with a 'data' list of articles"),
        (lambda d, p: d["data"][0].update(paragraphs={}), "data[0]: 'paragraphs' must be a list"),
    ],
)
def test_errors_name_file_and_question(tmp_path, edit, message):
    path = write(tmp_path / "bad.json", broken(edit))
    sep = ", " if message.startswith("data[") else ": "
    with pytest.raises(ValueError) as e:
        read_squad(path)
    assert str(e.value) == f"{path}{sep}{message}"


def test_file_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"data file not found: {tmp_path / 'none.json'}"):
        read_squad(tmp_path / "none.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"bad.json: not JSON: Expecting property name"):
        read_squad(tmp_path / "bad.json")
    empty = write(tmp_path / "empty.json", {"data": []})
    with pytest.raises(ValueError) as e:
        read_squad(empty)
    assert str(e.value) == f"{empty} has no questions"


# ---------------------------------------------------------------------------- windows vs run_qa.py


def run_qa_features(hf, example: QAExample, max_seq_len: int, doc_stride: int):
    """transformers' run_qa.py prepare_train_features for one example (pad_on_right, no padding)."""
    enc = hf(
        example.question.lstrip(),
        example.context,
        truncation="only_second",
        max_length=max_seq_len,
        stride=doc_stride,
        return_overflowing_tokens=True,
        return_offsets_mapping=True,
    )
    features = []
    for i, offsets in enumerate(enc["offset_mapping"]):
        input_ids = enc["input_ids"][i]
        cls_index = input_ids.index(hf.cls_token_id)
        sequence_ids = enc.sequence_ids(i)
        if not example.answers:
            features.append((input_ids, cls_index, cls_index))
            continue
        start_char = example.answer_starts[0]
        end_char = start_char + len(example.answers[0])
        token_start_index = 0
        while sequence_ids[token_start_index] != 1:
            token_start_index += 1
        token_end_index = len(input_ids) - 1
        while sequence_ids[token_end_index] != 1:
            token_end_index -= 1
        if not (offsets[token_start_index][0] <= start_char and offsets[token_end_index][1] >= end_char):
            features.append((input_ids, cls_index, cls_index))
        else:
            while token_start_index < len(offsets) and offsets[token_start_index][0] <= start_char:
                token_start_index += 1
            start = token_start_index - 1
            while offsets[token_end_index][1] >= end_char:
                token_end_index -= 1
            features.append((input_ids, start, token_end_index + 1))
    return features


def check_windows_equal_run_qa(tokenizer, hf, examples, max_seq_len, doc_stride):
    windows = encode_squad(examples, tokenizer, max_seq_len=max_seq_len, doc_stride=doc_stride)
    expected = [(i, f) for i, e in enumerate(examples) for f in run_qa_features(hf, e, max_seq_len, doc_stride)]
    assert len(windows) == len(expected) > len(examples)  # several windows per context
    quirks = 0
    for w, (i, (ids, start, end)) in zip(windows, expected):
        assert (w.example, w.input_ids) == (i, ids)
        if start == len(ids) - 1 and ids[start] == hf.sep_token_id:
            # run_qa's start search runs past [SEP] when the answer starts on the window's last context
            # token; ours stops there.
            quirks += 1
            last = max(t for t, o in enumerate(w.offsets) if o is not None)
            assert (w.start_position, w.end_position) == (last, end)
        else:
            assert (w.start_position, w.end_position) == (start, end)
        context = [t for t, o in enumerate(w.offsets) if o is not None]
        assert all(w.token_type_ids[t] == 1 for t in context) and context[-1] == len(ids) - 2
    assert sum(w.start_position > 0 for w in windows) >= len([e for e in examples if e.answers])
    return windows, quirks


def examples_from(context, questions):
    out = []
    for n, (question, answer) in enumerate(questions):
        if answer is None:
            out.append(QAExample(f"q{n}", question, context, [], [], True))
        else:
            out.append(QAExample(f"q{n}", question, context, [answer[0]], [answer[1]]))
    return out


def test_windows_equal_run_qa_tiny_vocab(tmp_path, tiny_tokenizer):
    from transformers import BertTokenizerFast

    tiny_tokenizer.save_pretrained(tmp_path)
    hf = BertTokenizerFast.from_pretrained(tmp_path)
    context = (
        "the cat sat on the mat . the dog eats bread . she reads a book in the city at night . " * 3
        + "the big red house is on the mountain by the river"
    )
    answers = [
        ("the dog", 25),
        ("reads a book", context.index("reads")),
        ("river", len(context) - 5),
        ("city", context.rindex("city")),
        ("mat", 19),
    ]
    questions = [
        (" what eats bread ?", answers[0]),
        ("what does she do ?", answers[1]),
        ("where is the house ?", answers[2]),
        ("where is she ?", answers[3]),
        ("what is blue ?", None),
        ("what ?", answers[4]),
    ]
    examples = examples_from(context, questions)
    for ex in examples:
        assert all(ex.context[s : s + len(a)] == a for a, s in zip(ex.answers, ex.answer_starts))
    windows, quirks = check_windows_equal_run_qa(tiny_tokenizer, hf, examples, max_seq_len=40, doc_stride=8)
    assert quirks == 1  # "river" is the context's last token
    river = [w for w in windows if w.example == 2 and w.start_position]
    assert [tiny_tokenizer.decode(w.input_ids[w.start_position : w.end_position + 1]) for w in river] == ["river"]


def test_windows_equal_run_qa_minilm(minilm_dir):
    from transformers import BertTokenizerFast

    tokenizer = BertTokenizer.from_pretrained(minilm_dir)
    hf = BertTokenizerFast.from_pretrained(minilm_dir)
    context = (
        "Zürich is the largest city in Switzerland and the capital of the canton of Zürich. It is located "
        "in north-central Switzerland, at the northwestern tip of Lake Zürich. As of January 2020, the "
        "municipality has 434,335 inhabitants, the urban area 1.315 million (2009), and the Zürich "
        "metropolitan area 1.83 million (2011). Zürich is a hub for railways, roads, and air traffic. "
        "Both Zürich Airport and Zürich's main railway station are the largest and busiest in the country."
    )
    questions = [
        ("What is the largest city in Switzerland?", ("Zürich", 0)),
        ("How many inhabitants did the municipality have?", ("434,335", context.index("434,335"))),
        ("When was the metropolitan area counted?", ("2011", context.index("2011"))),
        ("Which airport is the busiest?", ("Zürich Airport", context.index("Zürich Airport"))),
        ("Who founded the city?", None),
        ("Where is the lake?", ("north-central Switzerland", context.index("north-central"))),
    ]
    check_windows_equal_run_qa(tokenizer, hf, examples_from(context, questions), max_seq_len=48, doc_stride=16)


def test_long_question_cut_to_max_query_length_tokens(minilm_dir):
    from transformers import BertTokenizerFast

    tokenizer = BertTokenizer.from_pretrained(minilm_dir)
    hf = BertTokenizerFast.from_pretrained(minilm_dir)
    question = "In which unbelievably antidisestablishmentarian city, " * 6 + "is the lake?"
    assert len(hf.tokenize(question)) > 20
    (cut, n), short = cut_questions(tokenizer, [question, "Where?"], 20)
    assert n == 20 and short == ("Where?", 2)
    assert hf.tokenize(cut) == hf.tokenize(question)[:20]
    example = QAExample("q", question, "Lake Zürich is in Zürich.", ["Zürich"], [18])
    (window,) = encode_squad([example], tokenizer, max_seq_len=64, doc_stride=8, max_query_length=20)
    assert window.input_ids[1:21] == hf.convert_tokens_to_ids(hf.tokenize(question)[:20])
    assert window.input_ids[21] == hf.sep_token_id
    assert tokenizer.decode(window.input_ids[window.start_position : window.end_position + 1]) == "zurich"


def test_answer_tokens_rule():
    offsets = [None, None, None, (0, 3), (4, 7), (7, 10), (11, 14), None]  # [CLS] q [SEP] ctx... [SEP]
    assert answer_tokens(offsets, 4, 10) == (4, 5)
    assert answer_tokens(offsets, 5, 8) == (4, 5)  # partial tokens: the tokens holding the characters
    assert answer_tokens(offsets, 0, 3) == (3, 3)
    assert answer_tokens(offsets, 11, 14) == (6, 6)  # the last context token (run_qa's quirk mended)
    assert answer_tokens(offsets, 11, 20) == (0, 0)  # runs past the window
    assert answer_tokens(offsets[:3] + [None] + offsets[4:], 0, 3) == (0, 0)  # starts before it
    assert answer_tokens([None, None, None], 0, 1) == (0, 0)  # no context tokens at all


def test_encode_errors(tiny_tokenizer):
    example = QAExample("q7", "what is on the mat ?", CONTEXT, ["the cat"], [0])
    with pytest.raises(ValueError) as e:
        encode_squad([example], tiny_tokenizer, max_seq_len=16, doc_stride=10)
    assert str(e.value) == (
        "question 'q7': doc_stride 10 must be at least 0 and less than the 7 context tokens "
        "that fit beside its 6 tokens in a window of max_seq_len 16"
    )
    with pytest.raises(ValueError, match="must be >= 1, got 0"):
        encode_squad([example], tiny_tokenizer, max_query_length=0)
    assert default_doc_stride(384) == 128 and default_doc_stride(128) == 30


@pytest.mark.parametrize(
    "question, doc_stride, room, fits",
    [(10, 0, 3, True), (10, 2, 3, True), (10, 3, 3, False), (10, -1, 3, False), (12, 0, 1, True), (13, 0, 0, False)],
)
def test_the_window_check_that_training_jobs_and_the_route_share(question, doc_stride, room, fits):
    """A window of 16 tokens holds the question, [CLS] and two [SEP], and the context: at least one of
    its tokens, and more than the doc_stride tokens the next window repeats."""
    if fits:
        assert check_window(16, question, doc_stride) == room
        return
    with pytest.raises(WindowMisfit) as e:
        check_window(16, question, doc_stride)
    assert (e.value.room, e.value.no_room) == (room, room < 1)


def test_batches_pad_and_keep_positions(tiny_tokenizer, tmp_path):
    examples = read_squad(write(tmp_path / "dev.json", SQUAD))
    data = QABatches(examples, tiny_tokenizer, batch_size=3, max_seq_len=24, max_query_length=8, shuffle=False)
    (batch,) = list(data.iter_batches(0))
    assert batch["input_ids"].shape == batch["attention_mask"].shape == batch["token_type_ids"].shape
    assert batch["start_positions"].tolist() == [w.start_position for w in data.rows]
    assert batch["input_ids"][batch["attention_mask"] == 0].eq(tiny_tokenizer.pad_token_id).all()
    assert data.allow_impossible
