"""`python -m sentinels prepare ...`: build local JSONL corpora ({"text": ...} per line, the FineWeb-Edu format).

wiki: the English Wikipedia excerpt shipped in gensim's test data (gensim==4.4.0,
      gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2), markup
      stripped by sentinels/data/wiki.py. gensim is located, never imported (its wheel alone is enough, without
      scipy or smart_open). Wikipedia text is licensed CC BY-SA (see docs/sentinels.md); the output keeps each
      article's title and page id for attribution.
text: plain-text files, one document per blank-line-separated paragraph.
"""

from __future__ import annotations

import bz2
import importlib.util
import json
import os
import re
from pathlib import Path

WIKI_EXCERPT = "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
DEFAULT_WIKI_OUT = Path("data/sentinels/wiki.jsonl")


def gensim_wiki_excerpt() -> Path:
    spec = importlib.util.find_spec("gensim")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the Wikipedia excerpt ships with gensim: pip install 'gensim==4.4.0' "
                                "(or the project's `data` extra)")
    path = Path(list(spec.submodule_search_locations)[0]) / "test" / "test_data" / WIKI_EXCERPT
    if not path.is_file():
        raise FileNotFoundError(f"gensim is installed but {path} is missing")
    return path


def _clean(text: str) -> str:
    text = re.sub(r"[ \t]+", " ", text)
    text = re.sub(r"\n\s*\n+", "\n\n", text)
    return text.strip()


def prepare_wiki(out: Path, min_chars: int = 500) -> dict:
    """Articles of the gensim excerpt (redirects and stubs shorter than min_chars dropped) -> JSONL."""
    from .wiki import extract_pages, strip_markup

    source = gensim_wiki_excerpt()
    docs, dropped = [], 0
    with bz2.open(source) as fh:
        for title, raw, page_id in extract_pages(fh):
            text = _clean(strip_markup(raw))
            if text.upper().startswith("#REDIRECT") or len(text) < min_chars:
                dropped += 1
                continue
            docs.append({"text": text, "title": title, "id": page_id, "source": "enwiki excerpt in gensim 4.4.0",
                         "license": "CC BY-SA 3.0 (Wikipedia)"})
    _write_jsonl(out, docs)
    return {"out": str(out), "documents": len(docs), "dropped": dropped,
            "characters": sum(len(d["text"]) for d in docs), "source": str(source)}


def prepare_text(inputs: list[Path], out: Path) -> dict:
    docs = []
    for path in inputs:
        for para in re.split(r"\n\s*\n", path.read_text(encoding="utf-8", errors="strict")):
            if para.strip():
                docs.append({"text": _clean(para), "source": str(path)})
    _write_jsonl(out, docs)
    return {"out": str(out), "documents": len(docs)}


def _write_jsonl(out: Path, docs: list[dict]) -> None:
    if not docs:
        raise ValueError(f"no documents to write to {out}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as fh:
        for doc in docs:
            fh.write(json.dumps(doc, ensure_ascii=False) + "\n")
    os.replace(tmp, out)
