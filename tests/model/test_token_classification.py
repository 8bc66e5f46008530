"""Tests for model/data/token_classification: CoNLL and JSONL readers, IOB2 checks, the tag map, label
alignment against transformers' first-subword rule (`word_ids()`), splitting of long sentences, and the
exact text of every error."""

from __future__ import annotations

import gzip
import json

import pytest

from model.data.token_classification import (
    TaggedSentence,
    build_tag_map,
    encode_tagged,
    load_token_classification_data,
    read_tagged,
)
from model.tokenizer import BertTokenizer

IGNORE = -100
IOB2 = "(IOB2: an entity opens with B-; convert IOB1 files first)"

CONLL = """-DOCSTART- -X- -X- O

EU NNP B-NP B-ORG
rejects VBZ B-VP O
German JJ B-NP B-MISC
call NN I-NP O
. . O O

Peter NNP B-NP B-PER
Blackburn NNP I-NP I-PER

"""

# Words that split into several pieces in the tiny vocab ("cats" -> cat ##s, "reading" -> read ##ing),
# one unknown word ([UNK]), punctuation inside a word ("dog." -> dog .) and accents to strip.
SENTENCES = [
    (["the", "cats", "sat", "on", "the", "mat"], ["O", "B-ANIMAL", "O", "O", "O", "B-THING"]),
    (
        ["she", "was", "reading", "a", "book", "in", "the", "city"],
        ["B-PER", "O", "O", "O", "B-THING", "O", "O", "B-LOC"],
    ),
    (["Zyx", "dog.", "eats", "Brëad"], ["B-PER", "B-ANIMAL", "O", "B-THING"]),
    (["the", "big", "red", "house", "runs"], ["O", "B-THING", "I-THING", "I-THING", "O"]),
]

MINILM_SENTENCES = [
    (
        ["Angela", "Merkel", "visited", "Washington", "on", "Tuesday", "."],
        ["B-PER", "I-PER", "O", "B-LOC", "O", "B-DATE", "O"],
    ),
    (
        ["Hugging", "Face", "Inc.", "is", "in", "New", "York", "City", "since", "2016"],
        ["B-ORG", "I-ORG", "I-ORG", "O", "O", "B-LOC", "I-LOC", "I-LOC", "O", "B-DATE"],
    ),
    (["Zürich", "hosts", "unbelievably", "antidisestablishmentarianism", "workshops"], ["B-LOC", "O", "O", "O", "O"]),
]


def write(path, text):
    path.write_text(text)
    return path


def sentences(pairs, path="mem.jsonl"):
    return [TaggedSentence(list(t), list(g), path, i + 1) for i, (t, g) in enumerate(pairs)]


def hf_aligned(hf_tokenizer, words, tags, label2id):
    """transformers' run_ner tokenize_and_align_labels (label_all_tokens=False), for one sentence."""
    enc = hf_tokenizer(words, is_split_into_words=True)
    labels, previous = [], None
    for w in enc.word_ids():
        labels.append(IGNORE if w is None or w == previous else label2id[tags[w]])
        previous = w
    return enc["input_ids"], labels, enc.word_ids()


# ---------------------------------------------------------------------------- reading


def test_conll_reads_sentences_skips_docstart_and_takes_last_column(tmp_path):
    path = write(tmp_path / "train.conll", CONLL)
    got = read_tagged(path)
    assert [(s.tokens, s.tags, s.line) for s in got] == [
        (["EU", "rejects", "German", "call", "."], ["B-ORG", "O", "B-MISC", "O", "O"], 3),
        (["Peter", "Blackburn"], ["B-PER", "I-PER"], 9),
    ]
    assert got[1].token_lines == [9, 10]


def test_conll_tab_separated_gzip_and_no_trailing_blank_line(tmp_path):
    path = tmp_path / "train.iob2.gz"
    with gzip.open(path, "wt") as f:
        f.write("New York\tB-LOC\nis\tO\n\nhi\tO")
    got = read_tagged(path)
    assert [(s.tokens, s.tags) for s in got] == [(["New York", "is"], ["B-LOC", "O"]), (["hi"], ["O"])]


def test_jsonl_reads_sentences(tmp_path):
    rows = [{"tokens": ["EU", "rejects"], "tags": ["B-ORG", "O"]}, {"tokens": ["Peter"], "tags": ["B-PER"]}]
    path = write(tmp_path / "train.jsonl", "\n".join(json.dumps(r) for r in rows) + "\n\n")
    got = read_tagged(path)
    assert [(s.tokens, s.tags, s.line, s.token_lines) for s in got] == [
        (["EU", "rejects"], ["B-ORG", "O"], 1, None),
        (["Peter"], ["B-PER"], 2, None),
    ]


@pytest.mark.parametrize(
    "text, message",
    [
        ("EU B-ORG\nrejects\n", "line 2: 1 column, expected a token and a tag: 'rejects'"),
        ("EU NNP B-ORG\nrejects O\n", "line 2: 2 columns, expected 3 as on line 1: 'rejects O'"),
        ("EU\tB-ORG\n\tO\n", "line 2: empty token: '\\tO'"),
        ("EU B-ORG\nrejects o\n", "line 2: tag 'o' is not O, B-<type> or I-<type>"),
        ("EU B-ORG\nrejects B-\n", "line 2: tag 'B-' is not O, B-<type> or I-<type>"),
        ("EU O\nrejects I-ORG\n", f"line 2: tag 'I-ORG' follows 'O', not B-ORG or I-ORG {IOB2}"),
        ("EU B-PER\nrejects I-ORG\n", f"line 2: tag 'I-ORG' follows 'B-PER', not B-ORG or I-ORG {IOB2}"),
        ("EU B-ORG\n\nrejects I-ORG\n", f"line 3: tag 'I-ORG' follows 'O', not B-ORG or I-ORG {IOB2}"),
    ],
)
def test_conll_errors_name_file_and_line(tmp_path, text, message):
    path = write(tmp_path / "bad.conll", text)
    with pytest.raises(ValueError) as e:
        read_tagged(path)
    assert str(e.value) == f"{path}, {message}"


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"tokens": ["a"]}', "line 2: 'tags' must be a list of strings, got None"),
        ('{"tokens": "a b", "tags": ["O"]}', "line 2: 'tokens' must be a list of strings, got 'a b'"),
        ('{"tokens": ["a", 1], "tags": ["O", "O"]}', "line 2: 'tokens' must be a list of strings, got ['a', 1]"),
        ('{"tokens": [], "tags": []}', "line 2: 'tokens' is empty"),
        ('{"tokens": ["a", "b"], "tags": ["O"]}', "line 2: 2 tokens but 1 tags"),
        ('{"tokens": ["a", " "], "tags": ["O", "O"]}', "line 2: empty token: tokens[1] is ' '"),
        ('{"tokens": ["a", "b"], "tags": ["O", "PER"]}', "line 2, tags[1]: tag 'PER' is not O, B-<type> or I-<type>"),
        (  # a name rule is matched whole: `$` alone lets a final newline in
            '{"tokens": ["a", "b"], "tags": ["O", "B-PER\\n"]}',
            "line 2, tags[1]: tag 'B-PER\\n' is not O, B-<type> or I-<type>",
        ),
        (
            '{"tokens": ["a", "b"], "tags": ["O", "I-PER"]}',
            f"line 2, tags[1]: tag 'I-PER' follows 'O', not B-PER or I-PER {IOB2}",
        ),
        ("[1, 2]", "line 2: expected a JSON object, got list"),
        ('{"tokens": ', "line 2: not valid JSON (Expecting value)"),
    ],
)
def test_jsonl_errors_name_file_and_line(tmp_path, line, message):
    path = write(tmp_path / "bad.jsonl", '{"tokens": ["a"], "tags": ["O"]}\n' + line + "\n")
    with pytest.raises(ValueError) as e:
        read_tagged(path)
    assert str(e.value) == f"{path}, {message}"


def test_file_errors(tmp_path):
    with pytest.raises(FileNotFoundError) as e:
        read_tagged(tmp_path / "missing.conll")
    assert str(e.value) == f"data file not found: {tmp_path / 'missing.conll'}"
    path = write(tmp_path / "data.csv", "a,b\n")
    with pytest.raises(ValueError) as e:
        read_tagged(path)
    assert str(e.value) == (
        f"cannot tell the format of {path}: expected CoNLL columns (.conll, .iob, .iob2, "
        ".bio, .txt, .tsv) or JSONL (.jsonl, .ndjson)"
    )
    path = write(tmp_path / "empty.conll", "-DOCSTART- O\n\n\n")
    with pytest.raises(ValueError) as e:
        read_tagged(path)
    assert str(e.value) == f"{path} has no sentences"


# ---------------------------------------------------------------------------- tag map and loading


def test_tag_map_sorted_or_given(tmp_path):
    path = write(tmp_path / "train.conll", CONLL)
    got = read_tagged(path)
    assert build_tag_map(got) == (
        {0: "B-MISC", 1: "B-ORG", 2: "B-PER", 3: "I-PER", 4: "O"},
        {"B-MISC": 0, "B-ORG": 1, "B-PER": 2, "I-PER": 3, "O": 4},
    )
    given = ["O", "B-PER", "I-PER", "B-ORG", "I-ORG", "B-MISC", "I-MISC"]
    id2label, label2id = build_tag_map(got, given)
    assert list(id2label.values()) == given and label2id["B-ORG"] == 3
    with pytest.raises(ValueError) as e:
        build_tag_map(got, ["O", "B-PER", "I-PER", "B-ORG"])
    assert str(e.value) == (f"{path}, line 5: unknown tag 'B-MISC' (known tags: ['B-ORG', 'B-PER', 'I-PER', 'O'])")
    with pytest.raises(ValueError) as e:
        build_tag_map(got, ["O", "B-PER", "O"])
    assert str(e.value) == "labels ['O'] are given more than once"
    with pytest.raises(ValueError) as e:
        build_tag_map(got, ["O", "PER"])
    assert str(e.value) == "labels ['PER'] are not O, B-<type> or I-<type>"


def test_load_holds_out_or_reads_eval_file(tmp_path):
    rows = [{"tokens": [f"w{i}", "x"], "tags": ["B-PER", "O"]} for i in range(10)]
    train = write(tmp_path / "train.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    data = load_token_classification_data(train, eval_fraction=0.2, seed=1)
    assert (len(data.train), len(data.eval)) == (8, 2)
    assert sorted(s.tokens[0] for s in data.train + data.eval) == sorted(f"w{i}" for i in range(10))
    assert data.num_labels == 2
    assert data.config_updates() == {"id2label": {0: "B-PER", 1: "O"}, "label2id": {"B-PER": 0, "O": 1}}
    evals = write(tmp_path / "eval.conll", "Paris B-LOC\n")
    with pytest.raises(ValueError) as e:
        load_token_classification_data(train, evals)
    assert str(e.value) == f"{evals}, line 1: unknown tag 'B-LOC' (known tags: ['B-PER', 'O'])"
    evals = write(tmp_path / "eval.conll", "Ann B-PER\nsings O\n")
    data = load_token_classification_data(train, evals)
    assert (len(data.train), [s.tokens for s in data.eval]) == (10, [["Ann", "sings"]])


# ---------------------------------------------------------------------------- alignment


def check_alignment_matches_transformers(tokenizer, hf_tokenizer, pairs):
    given = sentences(pairs)
    _, label2id = build_tag_map(given)
    examples = encode_tagged(given, tokenizer, label2id, max_seq_len=128)
    assert [(e.sentence, e.part, e.parts, e.first_word) for e in examples] == [(i, 0, 1, 0) for i in range(len(pairs))]
    for example, (words, tags) in zip(examples, pairs):
        ids, labels, word_ids = hf_aligned(hf_tokenizer, words, tags, label2id)
        assert (example.input_ids, example.labels, example.word_ids) == (ids, labels, word_ids)


def test_alignment_equals_transformers_first_subword_rule_tiny_vocab(tmp_path, tiny_tokenizer):
    from transformers import BertTokenizerFast

    tiny_tokenizer.save_pretrained(tmp_path)
    hf = BertTokenizerFast.from_pretrained(tmp_path)
    check_alignment_matches_transformers(tiny_tokenizer, hf, SENTENCES)
    # The words that make this a real test: several pieces, [UNK], punctuation splitting a word.
    example = encode_tagged(sentences(SENTENCES[2:3]), tiny_tokenizer, build_tag_map(sentences(SENTENCES))[1])[0]
    assert tiny_tokenizer.convert_ids_to_tokens(example.input_ids) == [
        "[CLS]",
        "[UNK]",
        "dog",
        ".",
        "eats",
        "bread",
        "[SEP]",
    ]
    assert example.word_ids == [None, 0, 1, 1, 2, 3, None]


def test_alignment_equals_transformers_first_subword_rule_minilm(minilm_dir):
    from transformers import BertTokenizerFast

    tokenizer = BertTokenizer.from_pretrained(minilm_dir)
    hf = BertTokenizerFast.from_pretrained(minilm_dir)
    check_alignment_matches_transformers(tokenizer, hf, MINILM_SENTENCES)
    assert any(
        e.labels.count(IGNORE) > 3
        for e in encode_tagged(sentences(MINILM_SENTENCES), tokenizer, build_tag_map(sentences(MINILM_SENTENCES))[1])
    )


# ---------------------------------------------------------------------------- splitting


def test_long_sentence_split_at_word_boundaries(tiny_tokenizer):
    # pieces per word: the 1, cats 2, sat 1, reading 2, the 1, book 1, dog 1 -> 9 pieces
    words = ["the", "cats", "sat", "reading", "the", "book", "dog"]
    tags = ["O", "B-A", "O", "B-B", "I-B", "I-B", "O"]
    given = sentences([(words, tags), (["the"], ["O"])])
    _, label2id = build_tag_map(given)
    examples = encode_tagged(given, tiny_tokenizer, label2id, max_seq_len=6)  # 4 pieces a part
    pieces = [tiny_tokenizer.convert_ids_to_tokens(e.input_ids) for e in examples]
    assert pieces == [
        ["[CLS]", "the", "cat", "##s", "sat", "[SEP]"],
        ["[CLS]", "read", "##ing", "the", "book", "[SEP]"],
        ["[CLS]", "dog", "[SEP]"],
        ["[CLS]", "the", "[SEP]"],
    ]
    assert [(e.sentence, e.part, e.parts, e.first_word) for e in examples] == [
        (0, 0, 3, 0),
        (0, 1, 3, 3),
        (0, 2, 3, 6),
        (1, 0, 1, 0),
    ]
    assert [e.word_ids for e in examples[:3]] == [[None, 0, 1, 1, 2, None], [None, 3, 3, 4, 5, None], [None, 6, None]]
    lab = label2id
    assert [e.labels for e in examples[:3]] == [
        [IGNORE, lab["O"], lab["B-A"], IGNORE, lab["O"], IGNORE],
        [IGNORE, lab["B-B"], IGNORE, lab["I-B"], lab["I-B"], IGNORE],
        [IGNORE, lab["O"], IGNORE],
    ]
    # Every word's label survives exactly once across the parts, in order.
    firsts = [(w, label) for e in examples[:3] for w, label in zip(e.word_ids, e.labels) if label != IGNORE]
    assert firsts == [(i, lab[t]) for i, t in enumerate(tags)]
    assert all(len(e.input_ids) <= 6 for e in examples)


def test_word_longer_than_a_part_is_cut_keeping_its_first_piece(tiny_tokenizer):
    # "cats" is 2 pieces; with max_seq_len 3 there is room for one.
    given = sentences([(["cats", "sat"], ["B-A", "O"])])
    _, label2id = build_tag_map(given)
    examples = encode_tagged(given, tiny_tokenizer, label2id, max_seq_len=3)
    assert [tiny_tokenizer.convert_ids_to_tokens(e.input_ids) for e in examples] == [
        ["[CLS]", "cat", "[SEP]"],
        ["[CLS]", "sat", "[SEP]"],
    ]
    assert [e.labels for e in examples] == [[IGNORE, label2id["B-A"], IGNORE], [IGNORE, label2id["O"], IGNORE]]


def test_encode_errors(tiny_tokenizer):
    given = sentences([(["the"], ["B-X"])])
    with pytest.raises(ValueError) as e:
        encode_tagged(given, tiny_tokenizer, {"B-X": 0}, max_seq_len=2)
    assert str(e.value) == "max_seq_len must be an int >= 3 ([CLS], a token, [SEP]), got 2"
    with pytest.raises(ValueError) as e:
        encode_tagged(given, tiny_tokenizer, {"O": 0})
    assert str(e.value) == "mem.jsonl, line 1, tags[0]: unknown tag 'B-X' (known tags: ['O'])"
