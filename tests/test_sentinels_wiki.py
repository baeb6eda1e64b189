"""Wiki markup -> plain text with the standard library, and the gensim excerpt prepared without importing gensim."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pytest

from sentinels.data.wiki import extract_pages, strip_markup

ROOT = Path(__file__).resolve().parent.parent


def test_strip_markup_keeps_the_running_text():
    wikitext = (
        "{{Infobox river|name=Ouse|length={{convert|230|km}}}}\n"
        "The '''River Ouse''' flows through [[York]] and [[Selby|the town of Selby]].<ref>Atlas, p. 3</ref>"
        "<!-- hidden --> It joins the [https://example.org Trent].\n\n"
        "== Course ==\n"
        "* It rises near [[Great Ouseburn]].\n"
        "{| class=\"wikitable\"\n| a || b\n|}\n"
        "[[File:Ouse.jpg|thumb|A [[bridge]] over the Ouse]]\n"
        "Floods&nbsp;are common.<ref name=\"x\"/>\n"
        "[[Category:Rivers of Yorkshire]]"
    )
    assert strip_markup(wikitext) == (
        "The River Ouse flows through York and the town of Selby. It joins the Trent.\n\n"
        "Course\nIt rises near Great Ouseburn.\n\nFloods are common.")


def test_extract_pages_yields_articles_only():
    xml = b"""<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.10/">
      <page><title>Ouse</title><ns>0</ns><id>12</id><revision><id>99</id><text>River text</text></revision></page>
      <page><title>Talk:Ouse</title><ns>1</ns><id>13</id><revision><id>98</id><text>talk</text></revision></page>
    </mediawiki>"""
    assert list(extract_pages(io.BytesIO(xml))) == [("Ouse", "River text", "12")]


def test_prepare_wiki_needs_gensim_files_not_its_import(tmp_path):
    pytest.importorskip("gensim")
    code = ("import sys; sys.modules['scipy'] = sys.modules['smart_open'] = None\n"  # `import gensim` now fails
            "from pathlib import Path\n"
            "from sentinels.data.prepare import prepare_wiki\n"
            f"print(prepare_wiki(Path({str(tmp_path / 'wiki.jsonl')!r}))['documents'])\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert int(proc.stdout.strip().splitlines()[-1]) >= 100
    check = subprocess.run([sys.executable, "-c", "import sys; sys.modules['scipy'] = None; import gensim"], cwd=ROOT,
                           capture_output=True, text=True, timeout=300)
    assert check.returncode != 0  # the simulated host really cannot import gensim
