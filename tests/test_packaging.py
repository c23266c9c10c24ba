"""What a wheel of memcheck ships: pyproject.toml's package settings against the files memcheck/ holds.

setuptools puts a package's ``.py`` files in the wheel and nothing else unless
``[tool.setuptools.package-data]`` names them: a data file read from memcheck/ at run time (a
table of GPUs as JSON, say) would work from a checkout and be missing from ``pip install .``
of a wheel. The files are those a clone holds (git's tracked and untracked files, less the
ignored ones), so an editor's backup file does not count.
"""

from __future__ import annotations

import fnmatch
import importlib
import shutil
import subprocess
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _package_files() -> list[Path]:
    listed = None
    if shutil.which("git"):
        listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "memcheck"],
                                cwd=ROOT, capture_output=True)
    if listed is not None and listed.returncode == 0:
        return [ROOT / name for name in listed.stdout.decode().split("\0") if name and (ROOT / name).is_file()]
    return [p for p in (ROOT / "memcheck").rglob("*") if p.is_file() and "__pycache__" not in p.parts]


def test_every_file_in_the_package_is_a_module_or_named_as_package_data():
    data = PYPROJECT.get("tool", {}).get("setuptools", {}).get("package-data", {})
    files = _package_files()
    assert any(p.name == "cli.py" for p in files)
    unshipped = []
    for path in files:
        if path.suffix == ".py":
            continue
        parts = path.relative_to(ROOT).parts
        # a package's patterns are relative to its folder: memcheck = ["rules/*.json"] or memcheck.rules = ["*.json"]
        named = (fnmatch.fnmatch("/".join(parts[depth:]), pattern)
                 for depth in range(1, len(parts))
                 for pattern in [*data.get("*", []), *data.get(".".join(parts[:depth]), [])])
        if not any(named):
            unshipped.append("/".join(parts))
    assert unshipped == [], "not in a wheel unless [tool.setuptools.package-data] names them"


def test_each_command_of_the_wheel_names_a_function_that_exists():
    scripts = PYPROJECT["project"]["scripts"]
    assert "memcheck" in scripts
    for name, target in scripts.items():
        module, _, attr = target.partition(":")
        assert callable(getattr(importlib.import_module(module), attr)), (name, target)
