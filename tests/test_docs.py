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


def test_the_readmes_links_lead_to_files_that_exist():
    readme = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(([^)\s#]+)(?:#[^)]*)?\)", readme)
    local = [t for t in targets if "://" not in t]
    assert local, "the README links to the documentation pages"
    for target in local:
        assert (ROOT / target).exists(), target
