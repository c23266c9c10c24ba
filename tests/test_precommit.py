"""The pre-commit hook (.pre-commit-hooks.yaml) run by the real ``pre-commit try-repo``.

try-repo clones a git repository at a commit (plus, for the repository it is pointed at,
its *tracked* uncommitted changes: new files that are not committed are left out). So the
test snapshots this checkout's working tree (tracked and untracked files, as git lists
them, minus ignored ones) into a fresh repository with one commit and points try-repo at
that: it tests the hook as the working tree is, on a clean CI checkout or mid-edit.

pre-commit installs the hook with ``pip install .`` into a new virtualenv. A fresh one
would download torch; ``VIRTUALENV_SYSTEM_SITE_PACKAGES=1`` (read by virtualenv, which
pre-commit runs) lets it see the torch and transformers already installed, and
``PIP_NO_INDEX=1`` proves that nothing is downloaded: pip would fail rather than fetch.
``PIP_NO_BUILD_ISOLATION=0`` (pip's inverted spelling of --no-build-isolation) builds
memcheck with the installed setuptools instead of fetching one into an isolated env.

virtualenv builds the hook's environment on the *base* interpreter (it resolves a venv's
python to the one the venv was made from), so "system site-packages" there means the base's,
not those of a venv the tests run in: when pytest runs inside a venv (``make test`` from a
fresh one), torch and transformers may be in the venv only. Then the venv's own site-packages
go on the hook's ``PYTHONPATH``, through a folder of links that leaves memcheck out (an
installed or editable memcheck there would otherwise shadow, or be reinstalled over, the
snapshot's).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent  # this checkout
MODEL = """\
from transformers import GPT2Config, GPT2LMHeadModel


def build_model():
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, n_positions=256, vocab_size=1000))
"""
# Parameters: 180,480 (tests/test_check.py); fp32 AdamW's weights, gradients and two moments
# alone are 16 B each = 2,887,680 B, over a 2 MiB budget (2,097,152 B) before any activation;
# a real run at micro-batch 16 x 128 tokens measures 72.5 MB (tests/test_check.py checks that
# it is over 48 MiB and that the fix this hook prints, run for real, fits).
FITS = {"model": "model.py", "device": "cpu", "max_len": 128, "micro_batch": 2, "gpu_memory": "1GiB"}
OVER = {**FITS, "micro_batch": 16, "gpu_memory": "48MiB"}
# memcheck's own entries in a site-packages: memcheck/, memcheck-0.1.0.dist-info, and an editable
# install's __editable__.memcheck-0.1.0.pth and __editable___memcheck_0_1_0_finder.py
MEMCHECK_FILE = re.compile(r"(__editable___?\.?)?memcheck([-_.].*)?$", re.IGNORECASE)
GIT = ["git", "-c", "user.name=memcheck tests", "-c", "user.email=tests@memcheck.invalid", "-c", "commit.gpgsign=false",
       "-c", "init.defaultBranch=main"]

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("pre_commit") is None, reason="pre-commit is not installed"),
    pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed"),
]


def _git(*args, cwd):
    subprocess.run([*GIT, *args], cwd=cwd, check=True, capture_output=True, text=True)


def _snapshot(dest: Path) -> Path:
    """A one-commit repository holding this checkout's working tree as git sees it."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True)
    if listed.returncode != 0:
        pytest.skip(f"{ROOT} is not a git checkout; pre-commit needs the hook in a git repository")
    for name in listed.stdout.decode().split("\0"):
        source = ROOT / name
        if name and source.is_file():  # a deleted tracked file is listed but gone
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    _git("init", "-q", cwd=dest)
    _git("add", "-A", cwd=dest)
    _git("commit", "-q", "-m", "snapshot", cwd=dest)
    return dest


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """A user's repository with a model file, a config that fits and one that does not."""
    base = tmp_path_factory.mktemp("precommit")
    hook_repo = _snapshot(base / "memcheck")
    user = base / "project"
    user.mkdir()
    (user / "model.py").write_text(MODEL)
    (user / "memcheck.toml").write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in FITS.items()))
    (user / "big.memcheck.json").write_text(json.dumps({"jobs": {"big": OVER}}))
    (user / "pyproject.toml").write_text('[project]\nname = "user-project"\n')  # no [tool.memcheck]
    _git("init", "-q", cwd=user)
    _git("add", "-A", cwd=user)
    _git("commit", "-q", "-m", "configs", cwd=user)
    return hook_repo, user, base


def _venv_site_packages(dest: Path) -> list[str]:
    """The running venv's site-packages, memcheck left out, for the hook's PYTHONPATH ([] outside a venv).

    Outside a venv the running interpreter is the base one, and VIRTUALENV_SYSTEM_SITE_PACKAGES
    already shows the hook its packages. Inside one, each entry of the venv's site-packages but
    memcheck's own (its package, its dist-info, an editable install's path file and finder) is
    linked into ``dest``: pip in the hook's environment then finds torch and the rest installed
    and installs the snapshot's memcheck, which is the one the hook imports.
    """
    if sys.prefix == sys.base_prefix:
        return []
    if not dest.exists():
        dest.mkdir()
        for site_dir in dict.fromkeys(sysconfig.get_path(key) for key in ("purelib", "platlib")):
            for entry in Path(site_dir).iterdir() if Path(site_dir).is_dir() else ():
                if not MEMCHECK_FILE.match(entry.name) and not (dest / entry.name).exists():
                    (dest / entry.name).symlink_to(entry)
    return [str(dest)]


def _try_repo(project, *files):
    hook_repo, user, base = project
    pythonpath = [*_venv_site_packages(base / "venv-site-packages"), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {
        **os.environ,
        **({"PYTHONPATH": os.pathsep.join(pythonpath)} if pythonpath else {}),
        "VIRTUALENV_SYSTEM_SITE_PACKAGES": "1",
        "PIP_NO_INDEX": "1",
        "PIP_NO_BUILD_ISOLATION": "0",
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
        "PRE_COMMIT_HOME": str(base / "pre-commit-home"),
        "HF_HUB_OFFLINE": "1",
        "CUDA_VISIBLE_DEVICES": "",
    }
    return subprocess.run([sys.executable, "-m", "pre_commit", "try-repo", str(hook_repo), "memcheck",
                           "--verbose", "--files", *files], cwd=user, env=env, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.slow
def test_the_hook_passes_a_config_that_fits_and_skips_a_pyproject_without_the_table(project):
    done = _try_repo(project, "memcheck.toml", "pyproject.toml")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Passed" in done.stdout and "ok    memcheck.toml: peak " in done.stdout
    assert "pyproject.toml has no [tool.memcheck] table; skipped" in done.stdout
    # a virtualenv that tried to download torch fails instead (PIP_NO_INDEX), so no clock is needed here


@pytest.mark.slow
def test_the_hook_fails_a_config_over_budget_and_prints_the_fix(project):
    done = _try_repo(project, "big.memcheck.json")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Failed" in done.stdout and "- exit code: 1" in done.stdout
    assert "FAIL  big.memcheck.json [jobs.big]: will not fit: " in done.stdout
    flat = " ".join(done.stdout.split())  # the report wraps its lines at 80 columns
    assert "over the 45.6 MiB limit (cpu budget 48.0 MiB minus a 5% margin)" in flat  # 48 MiB * 0.95
    assert "fix: micro_batch = " in flat and "global batch 16 kept" in flat


def test_the_hook_selects_memcheck_configs_only(project):
    """The hook's files pattern, as pre-commit applies it (a Python regex searched in the path)."""
    import yaml

    (hook,) = yaml.safe_load((ROOT / ".pre-commit-hooks.yaml").read_text())
    assert hook["id"] == "memcheck" and hook["entry"] == "memcheck check" and hook["pass_filenames"] is True
    pattern = re.compile(hook["files"])
    for name in ("memcheck.toml", "memcheck.json", "cfg/memcheck.yaml", "train.memcheck.toml", "a/b.memcheck.yml",
                 "pyproject.toml", "pkg/pyproject.toml"):
        assert pattern.search(name), name
    for name in ("memcheck/cli.py", "notmemcheck.toml", "memcheck.toml.bak", "config.toml", "memcheck.py"):
        assert not pattern.search(name), name
