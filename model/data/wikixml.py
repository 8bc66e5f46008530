"""Wikipedia XML dumps (`*-pages-articles*.xml[.bz2]`) as pretraining documents: one article, one document.

The dump is streamed through defusedxml's parser (a DTD, entity declarations and external references are
refused: an XML bomb expands nothing) into a target that keeps only the title, namespace, redirect flag
and text of the <page> being read, each at most MAX_PAGE_CHARS characters, so a dump of any size, or a
hostile one, is read in bounded memory. Pages outside the article namespace (ns 0: Talk:, User:,
Template: ...), redirects and pages whose text is longer than MAX_PAGE_CHARS are skipped and counted. An article's wikitext is parsed
with mwparserfromhell; templates, tables, <ref>s and other invisible tags, comments, headings and
File:/Image:/Category: links are removed, the rest goes through `strip_code()` (links keep their text,
bold and italics their words). Blank-line separated blocks are paragraphs (model/data/corpus.py splits them
into sentences).

References: the MediaWiki XML export format (https://www.mediawiki.org/xml/export-0.10.xsd);
mwparserfromhell (https://mwparserfromhell.readthedocs.io); attardi/wikiextractor, which does the same
cleaning with its own regular expressions.
"""

from __future__ import annotations

import io
import re
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import mwparserfromhell
from defusedxml import DefusedXmlException
from defusedxml.ElementTree import DefusedXMLParser
from mwparserfromhell.nodes import Comment, Heading, Tag, Template, Wikilink

# Tags whose content is not running text (tables, references, code, maths, galleries).
_DROPPED_TAGS = frozenset(
    "table ref references gallery math chem score syntaxhighlight source pre timeline "
    "imagemap templatedata graph mapframe".split()
)
# Link namespaces that are media or page metadata, not prose (and their aliases).
_DROPPED_LINKS = ("file:", "image:", "media:", "category:", ":category:")
_PARAGRAPH_BREAK = re.compile(r"\n\s*\n")
_SPACES = re.compile(r"[ \t]{2,}")
# Characters of one page's wikitext (the longest Wikipedia articles have about 1.5 M); a longer page is skipped.
MAX_PAGE_CHARS = 4 << 20
_READ_BYTES = 1 << 16
_STATS = ("wiki_redirects", "wiki_other_namespaces", "wiki_empty_articles", "wiki_oversize_pages")


def read_wiki_articles(
    f: IO[bytes] | io.BufferedIOBase, path: str | Path, stats: dict | None = None
) -> Iterator[list[str]]:
    """The articles of a MediaWiki XML export, each a list of its paragraphs' plain text.

    `stats` counts pages skipped: "wiki_redirects", "wiki_other_namespaces", "wiki_empty_articles",
    "wiki_oversize_pages".
    """
    stats = stats if stats is not None else {}
    for key in _STATS:
        stats.setdefault(key, 0)
    for page in _pages(f, path):
        if page["oversize"]:
            stats["wiki_oversize_pages"] += 1
        elif page["ns"] != "0":
            stats["wiki_other_namespaces"] += 1
        elif page["redirect"] or page["text"].lstrip()[:9].upper() == "#REDIRECT":
            stats["wiki_redirects"] += 1
        else:
            paragraphs = [p.strip() for p in _PARAGRAPH_BREAK.split(wikitext_to_text(page["text"])) if p.strip()]
            if paragraphs:
                yield paragraphs
            else:
                stats["wiki_empty_articles"] += 1


def _pages(f: IO[bytes] | io.BufferedIOBase, path: str | Path) -> Iterator[dict]:
    """title, ns, redirect, text and oversize of each <page>, in order; memory stays bounded."""
    target = _PageTarget(path)
    parser = DefusedXMLParser(target=target, forbid_dtd=True, forbid_entities=True, forbid_external=True)
    try:
        while block := f.read(_READ_BYTES):
            parser.feed(block)
            yield from target.take()
        parser.close()
    except ET.ParseError as e:
        raise ValueError(f"{path}: malformed XML ({e})") from None
    except DefusedXmlException as e:
        line = parser.parser.CurrentLineNumber
        raise ValueError(
            f"{path}, line {line}: not a MediaWiki XML dump: {type(e).__name__} (DTDs, entity "
            "declarations and external references are not read)"
        ) from None
    yield from target.take()


class _PageTarget:
    """An XML parser target that keeps, of the <page> being read, only what _pages yields: the texts of its
    <title>, <ns> and <revision><text>, each dropped once longer than MAX_PAGE_CHARS (and marked oversize)."""

    _KEPT: dict[tuple[str | None, str], str] = {  # (parent, element) -> field; the root's parent is None
        ("page", "title"): "title",
        ("page", "ns"): "ns",
        ("revision", "text"): "text",
    }

    def __init__(self, path: str | Path):
        self.path = path
        self.open: list[str] = []  # the names of the elements now open, outermost first
        self.done: list[dict] = []
        self.page: dict | None = None
        self.field: str | None = None
        self.parts: list[str] = []
        self.chars = 0

    def take(self) -> list[dict]:
        done, self.done = self.done, []
        return done

    def start(self, tag: str, attrib: dict) -> None:
        name = _local(tag)
        if not self.open and name != "mediawiki":
            raise ValueError(f"{self.path}: not a MediaWiki XML dump (root element <{name}>)")
        parent = self.open[-1] if self.open else None
        self.open.append(name)
        if name == "page":
            self.page = {"title": "", "ns": "", "redirect": False, "text": "", "oversize": False}
        elif self.page is not None and parent == "page" and name == "redirect":
            self.page["redirect"] = True
        elif self.page is not None and (parent, name) in self._KEPT:
            self.field, self.parts, self.chars = self._KEPT[parent, name], [], 0

    def data(self, text: str) -> None:
        if self.field is None:
            return
        assert self.page is not None  # a field is read only inside a <page>
        self.chars += len(text)
        if self.chars > MAX_PAGE_CHARS:
            self.page["oversize"], self.parts = True, []
        else:
            self.parts.append(text)

    def end(self, tag: str) -> None:
        self.open.pop()
        if self.field is not None:
            assert self.page is not None
            self.page[self.field] = "".join(self.parts)
            self.field, self.parts = None, []
        elif _local(tag) == "page" and self.page is not None:
            self.page["ns"] = self.page["ns"].strip() or "0"
            self.done.append(self.page)
            self.page = None

    def close(self) -> None:
        return None


def wikitext_to_text(wikitext: str) -> str:
    """Plain text of an article's wikitext: markup, templates, tables, references and media removed."""
    kept = []
    for node in mwparserfromhell.parse(wikitext).nodes:
        if _dropped(node):
            continue
        stripped = node.__strip__(normalize=True, collapse=True, keep_template_params=False)
        if stripped:
            kept.append(str(stripped))
    text = _SPACES.sub(" ", "".join(kept))  # a removed template or ref leaves a double space
    # Lines of leftover markup (a lone "|}" of a broken table, list bullets) carry no prose.
    lines = (line.strip() for line in text.split("\n"))
    return "\n".join(line if not line.startswith(("{|", "|", "!")) else "" for line in lines)


def _dropped(node) -> bool:
    if isinstance(node, (Template, Comment, Heading)):
        return True
    if isinstance(node, Tag):
        return str(node.tag).strip().lower() in _DROPPED_TAGS
    if isinstance(node, Wikilink):
        return str(node.title).strip().lower().startswith(_DROPPED_LINKS)
    return False


def _local(tag: str) -> str:
    return tag.rsplit("}", 1)[-1]
