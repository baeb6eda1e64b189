"""MediaWiki export XML -> plain article text, with the standard library only (no gensim import, so a machine that
has only gensim's wheel files, without scipy or smart_open, can still build the corpus from its test data).

extract_pages yields (title, wikitext, page id) for the articles (namespace 0) of an export; strip_markup turns
wikitext into running text: templates, tables, references, comments, files and categories are dropped, links keep
their shown text, headings their title, lists their items.
"""

from __future__ import annotations

import html
import re
import xml.etree.ElementTree as ET
from typing import BinaryIO, Iterator

_COMMENT = re.compile(r"<!--.*?-->", re.S)
_REF = re.compile(r"<ref[^>/]*/>|<ref[^>]*>.*?</ref>", re.S | re.I)
_DROPPED_TAGS = re.compile(r"<(math|gallery|timeline|score|syntaxhighlight|source|pre)\b[^>]*>.*?</\1>", re.S | re.I)
_TEMPLATE = re.compile(r"\{\{[^{}]*\}\}")  # innermost first
_TABLE = re.compile(r"\{\|(?:(?!\{\|).)*?\|\}", re.S)  # innermost first
_LINK = re.compile(r"\[\[([^\[\]]*)\]\]")  # innermost first
_EXTERNAL = re.compile(r"\[(?:https?:|ftp:)?//[^\s\]]*\s*([^\]]*)\]")
_TAG = re.compile(r"</?[a-zA-Z][^>]*>")
_HEADING = re.compile(r"^(=+)\s*(.*?)\s*\1\s*$", re.M)
_QUOTES = re.compile(r"'{2,}")
_LIST = re.compile(r"^[*#:;]+\s*", re.M)
_DROPPED_NAMESPACES = ("file:", "image:", "category:", "media:")


def _local(tag: str) -> str:
    return tag.rsplit("}", 1)[-1]


def extract_pages(fh: BinaryIO) -> Iterator[tuple[str, str, str]]:
    """(title, wikitext, page id) of each article page (namespace 0) of a MediaWiki export."""
    title = ns = page_id = text = None
    for _, elem in ET.iterparse(fh, events=("end",)):
        tag = _local(elem.tag)
        if tag == "title":
            title = elem.text or ""
        elif tag == "ns":
            ns = (elem.text or "").strip()
        elif tag == "id" and page_id is None:  # the page id comes before the revision's ids
            page_id = (elem.text or "").strip()
        elif tag == "text":
            text = elem.text or ""
        elif tag == "page":
            if ns == "0" and text is not None:
                yield title or "", text, page_id or ""
            title = ns = page_id = text = None
            elem.clear()


def _replace_innermost(pattern: re.Pattern, repl, text: str) -> str:
    while True:
        new = pattern.sub(repl, text)
        if new == text:
            return text
        text = new


def _link_text(match: re.Match) -> str:
    inner = match.group(1)
    if inner.lower().startswith(_DROPPED_NAMESPACES) or inner.startswith(":category:"):
        return ""
    return inner.split("|")[-1]


def strip_markup(wikitext: str) -> str:
    """Plain text of an article's wikitext (paragraphs separated by blank lines)."""
    text = html.unescape(wikitext)
    text = _COMMENT.sub("", text)
    text = _REF.sub("", text)
    text = _DROPPED_TAGS.sub("", text)
    text = _replace_innermost(_TEMPLATE, "", text)
    text = _replace_innermost(_TABLE, "", text)
    text = _replace_innermost(_LINK, _link_text, text)
    text = _EXTERNAL.sub(lambda m: m.group(1), text)
    text = _TAG.sub("", text)
    text = _HEADING.sub(lambda m: m.group(2), text)
    text = _QUOTES.sub("", text)
    text = _LIST.sub("", text)
    text = html.unescape(text).replace("\u00a0", " ")
    text = re.sub(r"[ \t]+", " ", text)
    text = re.sub(r" *\n *", "\n", text)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip()
