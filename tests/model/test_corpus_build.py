"""The token store builder (model/data/corpus_build.py) and the readers under it: compressed files, byte
ranges, Wikipedia XML. Stores are checked by reading the .npy files and manifest.json directly, as the
training side does, and their token ids against the corpus cache's own encode path."""

from __future__ import annotations

import bz2
import gzip
import hashlib
import json
import lzma
import random
from pathlib import Path

import numpy as np
import pytest
import zstandard

from model.data import wikixml
from model.data.corpus import (
    MAX_LINE_CHARS,
    Bounds,
    detect_format,
    encode_sentences,
    read_documents,
    read_paragraphs,
    split_sentences,
    tokenizer_fingerprint,
)
from model.data.corpus_build import BuildOptions, _KeySet, build_store, expand_inputs, paragraph_key, plan_units
from tests.conftest import WORDS

WIKI_DUMP = """<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.10/" version="0.10" xml:lang="en">
  <siteinfo><sitename>Wikipedia</sitename></siteinfo>
  <page>
    <title>Foo</title><ns>0</ns><id>1</id>
    <revision><id>10</id><text xml:space="preserve">'''Foo''' is a [[bar|Bar]] thing.&lt;ref name="x"&gt;Cite \
{{cite web|url=x}}&lt;/ref&gt; It has {{convert|3|km}} size.

{{Infobox thing
| name = Foo
}}
== History ==
Foo was made in 1900 by [[John Smith]]. See [[File:Foo.jpg|thumb|A foo picture]] here.
{| class="wikitable"
|-
! Head !! Head2
|-
| cell || cell2
|}
* A list item about ''foo''.
&lt;!-- a comment --&gt;
[[Category:Things]]</text></revision>
  </page>
  <page><title>Bar</title><ns>0</ns><id>2</id><redirect title="Foo"/><revision><text>#REDIRECT [[Foo]]</text>\
</revision></page>
  <page><title>Talk:Foo</title><ns>1</ns><id>3</id><revision><text>Talk about the foo.</text></revision></page>
  <page><title>Baz</title><ns>0</ns><id>4</id><revision><text>Baz is [[Foo|like foo]] but smaller.&lt;ref&gt;A \
book.&lt;/ref&gt;</text></revision></page>
</mediawiki>
"""
WIKI_ARTICLES = [
    [
        ["Foo is a Bar thing.", "It has size."],
        ["Foo was made in 1900 by John Smith.", "See here."],
        ["A list item about foo."],
    ],
    [["Baz is like foo but smaller."]],
]


def sentence(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 9))).capitalize() + "."


def paragraphs(seed: int, n: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(sentence(rng) for _ in range(rng.randint(1, 4))) for _ in range(n)]


def write_inputs(root: Path) -> Path:
    """One file per format and compression, all distinct paragraphs; returns the folder."""
    root.mkdir()
    (root / "a_text.txt").write_text("\n\n".join(paragraphs(1, 40)) + "\n")
    with gzip.open(root / "b_google.txt.gz", "wt") as f:
        f.write("\n\n".join(p.replace(". ", ".\n") for p in paragraphs(2, 30)) + "\n")
    with bz2.open(root / "c_records.jsonl.bz2", "wt") as f:
        f.writelines(json.dumps({"text": "\n\n".join(paragraphs(3 + i, 3))}) + "\n" for i in range(20))
    with lzma.open(root / "d_pairs.tsv.xz", "wt") as f:
        f.writelines(f"{a}\t{b}\n" for a, b in zip(paragraphs(40, 25), paragraphs(41, 25)))
    (root / "e_text.txt.zst").write_bytes(
        zstandard.ZstdCompressor().compress(("\n\n".join(paragraphs(50, 30)) + "\n").encode())
    )
    return root


def read_store(store: Path) -> tuple[dict, list[list[list[int]]]]:
    """The manifest and every document (sentences of token ids), checking the pinned format on the way."""
    manifest = json.loads((store / "manifest.json").read_text())
    assert (manifest["format"], manifest["version"]) == ("bertserve-token-store", 1)
    documents = []
    for shard in manifest["shards"]:
        arrays = {
            part: np.load(store / f"{shard['name']}.{part}.npy", mmap_mode="r")
            for part in ("tokens", "sentences", "documents")
        }
        tokens, sentences, docs = arrays["tokens"], arrays["sentences"], arrays["documents"]
        assert tokens.dtype == np.dtype(manifest["dtype"]) and sentences.dtype == docs.dtype == np.int64
        assert (len(tokens), len(sentences) - 1, len(docs) - 1) == (
            shard["tokens"],
            shard["sentences"],
            shard["documents"],
        )
        assert sentences[0] == 0 and sentences[-1] == len(tokens) and np.all(np.diff(sentences) > 0)
        assert docs[0] == 0 and docs[-1] == len(sentences) - 1 and np.all(np.diff(docs) > 0)
        for part in arrays:
            digest = hashlib.sha256((store / f"{shard['name']}.{part}.npy").read_bytes()).hexdigest()
            assert digest == shard["sha256"][part]
        for d in range(len(docs) - 1):
            documents.append([tokens[sentences[i] : sentences[i + 1]].tolist() for i in range(docs[d], docs[d + 1])])
    totals = {k: sum(s[k] for s in manifest["shards"]) for k in ("documents", "sentences", "tokens")}
    assert manifest["totals"] == totals and totals["documents"] == len(documents)
    return manifest, documents


def store_files(store: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(store.iterdir()) if p.name != "manifest.json"}


def manifest_without_time(store: Path) -> dict:
    manifest = json.loads((store / "manifest.json").read_text())
    del manifest["created_at"]
    return manifest


# ---------------------------------------------------------------------------- readers


def test_compressed_files_read_like_plain_ones(tmp_path):
    inputs = write_inputs(tmp_path / "in")
    formats = {p.name: detect_format(p) for p in sorted(inputs.iterdir())}
    assert formats == {
        "a_text.txt": "text",
        "b_google.txt.gz": "google",
        "c_records.jsonl.bz2": "jsonl",
        "d_pairs.tsv.xz": "pairs",
        "e_text.txt.zst": "text",
    }
    plain = tmp_path / "e_text.txt"
    plain.write_text("\n\n".join(paragraphs(50, 30)) + "\n")
    assert list(read_documents(inputs / "e_text.txt.zst")) == list(read_documents(plain))
    jsonl = list(read_paragraphs(inputs / "c_records.jsonl.bz2"))
    assert len(jsonl) == 20 and all(len(doc) == 3 for doc in jsonl)  # a record's blank lines part paragraphs


def test_byte_ranges_cut_at_document_boundaries(tmp_path):
    path = tmp_path / "big.txt"
    path.write_text("\n\n \n".join(paragraphs(7, 400)) + "\n")
    sources = [
        type("S", (), {"path": str(path), "bytes": path.stat().st_size, "format": "text", "compression": None})()
    ]
    units = plan_units(sources, unit_bytes=2048)
    assert len(units) > 10 and units[0].start == 0 and units[-1].end == path.stat().st_size
    assert all(a.end == b.start for a, b in zip(units, units[1:]))
    pieces = [d for u in units for d in read_paragraphs(path, "text", byte_range=(u.start, u.end))]
    assert pieces == list(read_paragraphs(path, "text"))


def test_wikipedia_dump_markup_is_stripped(tmp_path):
    dump = tmp_path / "enwiki-pages-articles1.xml.bz2"
    dump.write_bytes(bz2.compress(WIKI_DUMP.encode()))
    assert detect_format(dump) == "wikixml"
    stats = {}
    assert list(read_paragraphs(dump, stats=stats)) == WIKI_ARTICLES
    assert stats == {
        "wiki_redirects": 1,
        "wiki_other_namespaces": 1,
        "wiki_empty_articles": 0,
        "wiki_oversize_pages": 0,
    }


def test_a_file_that_is_not_a_dump_is_refused(tmp_path):
    bad = tmp_path / "notes.xml"
    bad.write_text("<notes><note>hi</note></notes>")
    with pytest.raises(ValueError, match=r"notes.xml: not a MediaWiki XML dump \(root element <notes>\)"):
        list(read_paragraphs(bad))


def test_xml_with_a_dtd_or_entities_is_refused_before_anything_expands(tmp_path):
    bomb = tmp_path / "bomb.xml"
    bomb.write_text(
        '<?xml version="1.0"?>\n<!DOCTYPE mediawiki [\n<!ENTITY a "aaaaaaaaaa">\n'
        '<!ENTITY b "&a;&a;&a;&a;&a;&a;&a;&a;&a;&a;">\n]>\n<mediawiki><page><title>&b;</title></page>'
        "</mediawiki>"
    )
    with pytest.raises(
        ValueError,
        match=r"bomb.xml, line 2: not a MediaWiki XML dump: DTDForbidden \(DTDs, "
        r"entity declarations and external references are not read\)",
    ):
        list(read_paragraphs(bomb))


def test_a_page_longer_than_the_bound_is_skipped_and_counted(tmp_path, monkeypatch):
    monkeypatch.setattr(wikixml, "MAX_PAGE_CHARS", 2_000)
    big = "<page><title>Big</title><ns>0</ns><revision><text>" + "word " * 1_000 + "</text></revision></page>"
    dump = tmp_path / "dump.xml"
    dump.write_text(WIKI_DUMP.replace("</mediawiki>", big + "</mediawiki>"))
    stats = {}
    assert list(read_paragraphs(dump, stats=stats)) == WIKI_ARTICLES
    assert stats["wiki_oversize_pages"] == 1


def test_a_txt_file_is_text_even_when_it_starts_like_a_dump(tmp_path):
    (tmp_path / "page.txt").write_text(WIKI_DUMP)
    (tmp_path / "page.xml").write_text(WIKI_DUMP)
    (tmp_path / "page").write_text(WIKI_DUMP)
    assert detect_format(tmp_path / "page.txt") in ("text", "google")
    assert detect_format(tmp_path / "page.xml") == detect_format(tmp_path / "page") == "wikixml"


def test_one_huge_compressed_line_is_cut_at_words_into_bounded_documents(tmp_path):
    words = [f"w{i % 997}" for i in range(700_000)]  # one 3.4 MiB line, a few KB compressed
    line = " ".join(words)
    path = tmp_path / "one-line.txt.bz2"
    path.write_bytes(bz2.compress(line.encode()))
    assert len(line) > 3 * MAX_LINE_CHARS and path.stat().st_size < 100_000
    docs = list(read_paragraphs(path, "google"))
    assert len(docs) == 4 and all(len(s) <= MAX_LINE_CHARS for d in docs for p in d for s in p)
    assert " ".join(s for d in docs for p in d for s in p).split() == words  # cut between words, nothing lost
    # A small bound: a line of one unbroken word is cut at the bound; a paragraph ends once it holds the bound.
    (tmp_path / "small.txt").write_text("x" * 25 + "\nab cd ef\ngh ij\nkl\n\nlast one\n")
    docs = list(read_paragraphs(tmp_path / "small.txt", "google", bounds=Bounds(line=10, paragraph=12)))
    assert docs == [[["x" * 10]], [["x" * 10]], [["x" * 5]], [["ab cd ef"]], [["gh ij", "kl"]], [["last one"]]]


@pytest.mark.parametrize(
    "format, suffix, line", [("pairs", ".tsv", "a\t" + "b " * 20), ("jsonl", ".jsonl", '{"text": "' + "b " * 20 + '"}')]
)
def test_a_record_longer_than_the_bound_is_refused_naming_the_file_and_line(tmp_path, format, suffix, line):
    path = tmp_path / f"data{suffix}"
    path.write_text(('{"text": "a"}' if format == "jsonl" else "x\ty") + f"\n{line}\n")
    with pytest.raises(
        ValueError,
        match=rf"data{suffix}, line 2: longer than 30 characters, the most one line "
        "may hold",
    ):
        list(read_paragraphs(path, format, bounds=Bounds(line=30)))


# ---------------------------------------------------------------------------- the store


def test_store_holds_every_document_with_the_cache_encoding(tmp_path, tiny_tokenizer):
    inputs = write_inputs(tmp_path / "in")
    manifest = build_store([inputs], tiny_tokenizer, tmp_path / "store", options=BuildOptions(shard_tokens=500))
    manifest, documents = read_store(tmp_path / "store")
    expected = [
        encode_sentences(tiny_tokenizer, doc) for path in sorted(inputs.iterdir()) for doc in read_documents(path)
    ]
    assert documents == expected
    assert len(manifest["shards"]) > 3 and all(s["tokens"] >= 500 for s in manifest["shards"][:-1])
    assert manifest["tokenizer"] == {
        "fingerprint": tokenizer_fingerprint(tiny_tokenizer),
        "vocab_size": tiny_tokenizer.vocab_size,
        "lowercase": True,
    }
    assert manifest["dtype"] == "uint16"
    assert [(Path(s["path"]).name, s["bytes"], s["format"]) for s in manifest["sources"]] == [
        (p.name, p.stat().st_size, detect_format(p)) for p in sorted(inputs.iterdir())
    ]
    assert manifest["stats"]["paragraphs_duplicate"] == 0 and manifest["stats"]["documents_read"] == len(expected)
    assert sorted(p.name for p in (tmp_path / "store").iterdir() if not p.name.startswith("shard-")) == [
        "manifest.json"
    ]  # no work files left behind


def test_exact_duplicate_paragraphs_are_dropped_first_occurrence_wins(tmp_path, tiny_tokenizer):
    inputs = tmp_path / "in"
    inputs.mkdir()
    a, b, c = paragraphs(9, 3)
    (inputs / "1.txt").write_text(f"{a}\n\n{b}\n\n{a}\n")
    # The same paragraph with other spacing and line breaks is a duplicate; a jsonl record keeps its new one.
    (inputs / "2.jsonl").write_text(
        json.dumps({"text": f"{b.replace(' ', '   ')}\n\n{c}"}) + "\n" + json.dumps({"text": f"  {a}  "}) + "\n"
    )
    manifest = build_store([inputs], tiny_tokenizer, tmp_path / "store")
    _, documents = read_store(tmp_path / "store")
    enc = lambda p: encode_sentences(tiny_tokenizer, split_sentences(p))  # noqa: E731
    assert documents == [enc(a), enc(b), enc(c)]
    stats = manifest["stats"]
    assert (stats["paragraphs_read"], stats["paragraphs_duplicate"], stats["documents_duplicate"]) == (6, 3, 2)
    assert stats["unique_paragraphs"] == 3


def test_near_empty_and_non_text_sentences_are_dropped_and_counted(tmp_path, tiny_tokenizer):
    inputs = tmp_path / "in"
    inputs.mkdir()
    good = "The cat sat on the mat."
    (inputs / "g.txt").write_text(f"{good}\nthe\n! ? , . !\n\n| . | , | ! |\n\n{good} The dog ran.\n")
    manifest = build_store(
        [inputs / "g.txt"], tiny_tokenizer, tmp_path / "store", options=BuildOptions(format="google")
    )
    _, documents = read_store(tmp_path / "store")
    assert documents == [
        encode_sentences(tiny_tokenizer, [good]),
        encode_sentences(tiny_tokenizer, [f"{good} The dog ran."]),
    ]
    stats = manifest["stats"]
    assert (stats["sentences_near_empty"], stats["sentences_non_text"], stats["documents_empty"]) == (1, 2, 1)


@pytest.mark.slow  # two spawned worker processes
def test_store_is_the_same_for_any_worker_count_and_unit_size(tmp_path, tiny_tokenizer):
    inputs = write_inputs(tmp_path / "in")
    (inputs / "f_big.txt").write_text("\n\n".join(paragraphs(60, 300) + paragraphs(1, 40)) + "\n")
    build_store([inputs], tiny_tokenizer, tmp_path / "one", options=BuildOptions(shard_tokens=700))
    build_store(
        [inputs], tiny_tokenizer, tmp_path / "two", workers=2, options=BuildOptions(shard_tokens=700, unit_bytes=4096)
    )
    assert store_files(tmp_path / "one") == store_files(tmp_path / "two")
    one, two = manifest_without_time(tmp_path / "one"), manifest_without_time(tmp_path / "two")
    assert one["stats"]["paragraphs_duplicate"] == 40
    assert {**one, "build": None} == {**two, "build": None}  # only the unit size (an option) differs


def test_units_written_in_many_parts_give_the_same_store(tmp_path, tiny_tokenizer, monkeypatch):
    import model.data.corpus_build as cb

    inputs = write_inputs(tmp_path / "in")
    build_store([inputs], tiny_tokenizer, tmp_path / "whole", options=BuildOptions(shard_tokens=500))
    monkeypatch.setattr(cb, "PART_TOKENS", 40)
    monkeypatch.setattr(cb, "ENCODE_CHARS", 100)
    build_store([inputs], tiny_tokenizer, tmp_path / "parts", options=BuildOptions(shard_tokens=500))
    assert store_files(tmp_path / "parts") == store_files(tmp_path / "whole")
    assert manifest_without_time(tmp_path / "parts") == manifest_without_time(tmp_path / "whole")


def test_a_finished_store_is_kept_and_another_build_into_it_refused(tmp_path, tiny_tokenizer):
    inputs = write_inputs(tmp_path / "in")
    first = build_store([inputs], tiny_tokenizer, tmp_path / "store")
    assert build_store([inputs], tiny_tokenizer, tmp_path / "store") == first
    with pytest.raises(ValueError, match=f"^{tmp_path / 'store'} holds a finished store built from other inputs"):
        build_store([inputs / "a_text.txt"], tiny_tokenizer, tmp_path / "store")


def test_resume_after_a_crash_gives_the_uninterrupted_store(tmp_path, tiny_tokenizer, monkeypatch):
    import model.data.corpus_build as cb

    inputs = write_inputs(tmp_path / "in")
    options = BuildOptions(shard_tokens=300, unit_bytes=2048)
    monkeypatch.setattr(cb, "PART_TOKENS", 100)  # units in several parts: a resume skips into the middle of one
    build_store([inputs], tiny_tokenizer, tmp_path / "whole", options=options)
    real, calls = cb._ShardWriter.consume, []

    def crash_on_fourth_unit(self, result, skip):
        calls.append(result["unit"])
        if len(calls) == 4:
            raise KeyboardInterrupt  # as if killed between two units
        real(self, result, skip)

    monkeypatch.setattr(cb._ShardWriter, "consume", crash_on_fourth_unit)
    with pytest.raises(KeyboardInterrupt):
        build_store([inputs], tiny_tokenizer, tmp_path / "store", options=options)
    assert not (tmp_path / "store" / "manifest.json").exists()
    assert len(list((tmp_path / "store" / ".build").glob("*.done.json"))) >= 1
    monkeypatch.setattr(cb._ShardWriter, "consume", real)
    build_store([inputs], tiny_tokenizer, tmp_path / "store", options=options)
    assert store_files(tmp_path / "store") == store_files(tmp_path / "whole")
    assert manifest_without_time(tmp_path / "store") == manifest_without_time(tmp_path / "whole")


def test_an_unfinished_build_of_other_inputs_is_refused(tmp_path, tiny_tokenizer):
    inputs = write_inputs(tmp_path / "in")
    (tmp_path / "store" / ".build").mkdir(parents=True)
    (tmp_path / "store" / ".build" / "plan.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(ValueError, match="holds an unfinished build of other inputs, tokenizer or options"):
        build_store([inputs], tiny_tokenizer, tmp_path / "store")


def test_inputs_expand_folders_and_globs_sorted_once(tmp_path):
    write_inputs(tmp_path / "in")
    (tmp_path / "in" / ".hidden").write_text("x")
    files = expand_inputs([tmp_path / "in", str(tmp_path / "in" / "*.txt")])
    assert [p.name for p in files] == [
        "a_text.txt",
        "b_google.txt.gz",
        "c_records.jsonl.bz2",
        "d_pairs.tsv.xz",
        "e_text.txt.zst",
    ]
    with pytest.raises(FileNotFoundError, match=r"^input not found: /nowhere/\*\.txt$"):
        expand_inputs(["/nowhere/*.txt"])


def test_key_set_finds_exactly_what_was_added():
    keys, rng = _KeySet(), np.random.default_rng(0)
    added = rng.integers(0, 2**64, size=5000, dtype=np.uint64)
    for chunk in np.array_split(added, 37):
        keys.add(chunk)
    assert len(keys) == 5000 and len(keys.levels) <= 14
    assert keys.contains(added).all()
    assert not keys.contains(rng.integers(0, 2**64, size=5000, dtype=np.uint64)).any()
    assert paragraph_key(["A  b", "c"]) == paragraph_key(["A b c"]) != paragraph_key(["a b c"])


def test_a_built_store_trains_as_the_files_it_came_from(tmp_path, tiny_tokenizer):
    """Builder and reader agree: the store `build_store` writes opens with the run's tokenizer, holds the
    documents of its inputs in order, and gives pretraining batches; another tokenizer is refused."""
    from model.data.pretraining import PretrainingData
    from model.data.store import open_store
    from model.tokenizer import BertTokenizer
    from tests.conftest import TINY_VOCAB

    inputs = write_inputs(tmp_path / "in")
    build_store([inputs], tiny_tokenizer, tmp_path / "store", options=BuildOptions(shard_tokens=500))
    store = open_store(tmp_path / "store", tiny_tokenizer)
    _, documents = read_store(tmp_path / "store")
    assert len(store.shards) > 1 and store.num_documents == len(documents)
    data = PretrainingData(store, tiny_tokenizer, batch_size=4, max_seq_len=32, seed=0)
    batch = next(data.iter_batches(0, 0))
    assert batch["input_ids"].shape[0] == 4 and batch["input_ids"].shape[1] <= 32
    assert int(batch["input_ids"].max()) < tiny_tokenizer.vocab_size
    other = BertTokenizer.from_vocab(TINY_VOCAB + ["extra"])
    with pytest.raises(ValueError, match="fingerprint"):
        open_store(tmp_path / "store", other)


def test_an_input_that_is_not_text_is_refused_naming_the_file(tmp_path, tiny_tokenizer):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text("the cat sat .\n")
    (tmp_path / "in" / "b.txt.tokens.npy").write_bytes(b"\x93NUMPY\x01\x00")  # a cache file globbed in by mistake
    with pytest.raises(
        ValueError,
        match=r"corpus .*b\.txt\.tokens\.npy is not UTF-8 text \(byte 0x93 where "
        r"UTF-8 was expected\)",
    ):
        build_store([tmp_path / "in"], tiny_tokenizer, tmp_path / "store")
    assert not (tmp_path / "store" / "manifest.json").exists()
