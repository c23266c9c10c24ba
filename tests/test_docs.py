"""The README and the documentation site under docs/ (issue 37): the generated reference page is
what docs/gen_reference.py writes, code fences close on a bare line, the README stays a short
front page whose links lead somewhere. `make docs` builds the site with `mkdocs build --strict`
(broken links and anchors fail); these checks need no MkDocs."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted((ROOT / "docs").glob("*.md"))


def _gen_reference():
    spec = importlib.util.spec_from_file_location("gen_reference", ROOT / "docs" / "gen_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_reference_page_is_what_gen_reference_writes():
    gen = _gen_reference()
    page = gen.PAGE.read_text()
    assert gen.render(page) == page, "docs/reference.md is out of date: run python docs/gen_reference.py"


def test_the_reference_table_has_one_row_per_job_spelling():
    from memcheck.job import SPELLINGS

    rows = [line for line in _gen_reference().settings_table() if line.startswith("| `")]
    assert [row.split("`")[1] for row in rows] == [s.field for s in SPELLINGS]


def test_every_code_fence_closes_on_a_bare_line():
    # a closing fence followed by text (```text) opens a new block on GitHub instead, and the
    # rest of the page reads as code (issue 37: README line 1250 hid two sections)
    for path in [ROOT / "README.md", *PAGES]:
        inside = False
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if not line.startswith("```"):
                continue
            if inside:
                assert line == "```", f"{path.name}:{number}: a closing fence followed by text: {line!r}"
            else:
                assert re.fullmatch(r"```[\w+-]*", line), f"{path.name}:{number}: {line!r}"
            inside = not inside
        assert not inside, f"{path.name}: a code block is never closed"


def test_the_readme_is_a_front_page_of_at_most_300_lines():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300


def _anchors(text: str) -> set[str]:
    """The anchors GitHub gives a page's headings (and mkdocs.yml's pymdownx slugify, the same):
    lower case, punctuation dropped, each space a hyphen."""
    anchors, inside = set(), False
    for line in text.splitlines():
        if line.startswith("```"):
            inside = not inside
        elif not inside and re.match(r"#{1,6} ", line):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


def test_the_readmes_links_lead_to_files_and_headings_that_exist():
    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)\s#]*)(?:#([^)]*))?\)", readme)
    local = [(path, anchor) for path, anchor in links if "://" not in path]
    assert any(path.startswith("docs/") for path, _ in local), "the README links to the documentation pages"
    for path, anchor in local:
        target = ROOT / path if path else ROOT / "README.md"
        assert target.exists(), path
        if anchor:
            assert anchor in _anchors(target.read_text()), f"{path}#{anchor}"
