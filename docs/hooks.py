"""MkDocs hook: the committed benchmark results become pages of the site, as they are.

``benchmarks/results/*.md`` (written by the benchmark scripts, never edited by hand) and the
published-measurement notes (``benchmarks/published/README.md`` and its ``multi_gpu/``) are added
under ``results/`` at build time, with an index page listing them, so the site shows the
measured tables the scripts committed rather than a copy that could drift from them.
"""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File, InclusionLevel

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
# (page under results/, source file, what it is)
NOTES = (
    ("published.md", ROOT / "benchmarks" / "published" / "README.md",
     "published GPU measurements: every case, its source, quote and unit conversion"),
    ("published-multi-gpu.md", ROOT / "benchmarks" / "published" / "multi_gpu" / "README.md",
     "published multi-GPU measurements: the records' fields and what each can check"),
)


def _title(path: Path) -> str:
    for line in path.read_text().splitlines():
        if line.startswith("# "):
            return line[2:].strip()
    return path.stem


def on_files(files, config):
    rows = []
    for path in sorted(RESULTS.glob("*.md")):
        uri = f"results/{path.name}"
        files.append(File.generated(config, uri, abs_src_path=str(path), inclusion=InclusionLevel.NOT_IN_NAV))
        rows.append(f"| [{_title(path)}]({path.name}) | `benchmarks/results/{path.name}` |")
    for name, path, what in NOTES:
        files.append(File.generated(config, f"results/{name}", abs_src_path=str(path),
                                    inclusion=InclusionLevel.NOT_IN_NAV))
        rows.append(f"| [{what}]({name}) | `{path.relative_to(ROOT)}` |")
    index = "\n".join([
        "# Committed results",
        "",
        "The measured tables as the benchmark scripts committed them (`benchmarks/results/`, each",
        "with the machine, the stacks and the date it was measured on), and the notes on the",
        "published GPU measurements the CUDA target is checked against. Each page is the committed",
        "file itself, added to the site when it is built (`docs/hooks.py`).",
        "",
        "| page | file |",
        "| --- | --- |",
        *rows,
        "",
    ])
    files.append(File.generated(config, "results/index.md", content=index))
    return files
