"""Wikipedia XML dumps (`*-pages-articles*.xml[.bz2]`) as pretraining documents: one article, one document.

The dump is streamed with `xml.etree.ElementTree.iterparse`, each <page> cleared once read (and the root's
children with it), so a dump of any size is read in constant memory. Pages outside the article namespace
(ns 0: Talk:, User:, Template: ...) and redirects are skipped and counted. An article's wikitext is parsed
with mwparserfromhell; templates, tables, <ref>s and other invisible tags, comments, headings and
File:/Image:/Category: links are removed, the rest goes through `strip_code()` (links keep their text,
bold and italics their words). Blank-line separated blocks are paragraphs (model/data/corpus.py splits them
into sentences).

References: the MediaWiki XML export format (https://www.mediawiki.org/xml/export-0.10.xsd);
mwparserfromhell (https://mwparserfromhell.readthedocs.io); attardi/wikiextractor, which does the same
cleaning with its own regular expressions.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import mwparserfromhell
from mwparserfromhell.nodes import Comment, Heading, Tag, Template, Wikilink

# Tags whose content is not running text (tables, references, code, maths, galleries).
_DROPPED_TAGS = frozenset("table ref references gallery math chem score syntaxhighlight source pre timeline "
                          "imagemap templatedata graph mapframe".split())
# Link namespaces that are media or page metadata, not prose (and their aliases).
_DROPPED_LINKS = ("file:", "image:", "media:", "category:", ":category:")
_PARAGRAPH_BREAK = re.compile(r"\n\s*\n")
_SPACES = re.compile(r"[ \t]{2,}")


def read_wiki_articles(f: BinaryIO, path: str | Path, stats: dict | None = None) -> Iterator[list[str]]:
    """The articles of a MediaWiki XML export, each a list of its paragraphs' plain text.

    `stats` counts pages skipped: "wiki_redirects", "wiki_other_namespaces", "wiki_empty_articles".
    """
    stats = stats if stats is not None else {}
    for key in ("wiki_redirects", "wiki_other_namespaces", "wiki_empty_articles"):
        stats.setdefault(key, 0)
    for page in _pages(f, path):
        if page["ns"] != "0":
            stats["wiki_other_namespaces"] += 1
        elif page["redirect"] or page["text"].lstrip()[:9].upper() == "#REDIRECT":
            stats["wiki_redirects"] += 1
        else:
            paragraphs = [p.strip() for p in _PARAGRAPH_BREAK.split(wikitext_to_text(page["text"])) if p.strip()]
            if paragraphs:
                yield paragraphs
            else:
                stats["wiki_empty_articles"] += 1


def _pages(f: BinaryIO, path: str | Path) -> Iterator[dict]:
    """title, ns, redirect and text of each <page>, in order; memory stays flat (pages are cleared)."""
    root = None
    try:
        for event, elem in ET.iterparse(f, events=("start", "end")):
            if root is None:
                root = elem
                if _local(root.tag) != "mediawiki":
                    raise ValueError(f"{path}: not a MediaWiki XML dump (root element <{_local(root.tag)}>)")
            if event != "end" or _local(elem.tag) != "page":
                continue
            fields = {_local(child.tag): child for child in elem}
            revision = {_local(c.tag): c for c in fields["revision"]} if "revision" in fields else {}
            yield {
                "title": _text(fields.get("title")),
                "ns": _text(fields.get("ns")) or "0",
                "redirect": "redirect" in fields,
                "text": _text(revision.get("text")),
            }
            root.clear()  # drops this page (and any before it) from the tree
    except ET.ParseError as e:
        raise ValueError(f"{path}: malformed XML ({e})") from None


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


def _text(elem) -> str:
    return (elem.text or "") if elem is not None else ""
