"""The documented ``repo: local`` pre-commit hook: ``memcheck check`` from the environment memcheck is in.

The hook is read from docs/check.md (its ```yaml block holding ``repo: local``; the README's
section before issue 37 moved it there), so the snippet
users copy is the one tested. The fast tests check that pre-commit accepts it, that it selects
the files the shipped hook (.pre-commit-hooks.yaml) selects, and run its entry in-process on
the files pre-commit would pass (a config that fits: exit 0, which pre-commit reports as
Passed). The slow one installs it with ``pre-commit install`` in a fresh git repository and
commits a config with a mistyped key: memcheck's one line is shown and the commit is refused
(one memcheck process, no trace). ``language: system`` builds no environment, so the commit
runs the ``memcheck`` script of the running interpreter's environment (its scripts folder goes
first on PATH, and this checkout first on PYTHONPATH, so that script imports this checkout).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from memcheck.cli import main

ROOT = Path(__file__).resolve().parent.parent  # this checkout
MODEL = """\
from transformers import GPT2Config, GPT2LMHeadModel


def build_model():
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, n_positions=256, vocab_size=1000))
"""
# Parameters: 180,480 (tests/test_check.py); fp32 AdamW keeps 16 B of each = 2,887,680 B = 2.75 MiB; a real
# run at micro-batch 2 x 128 tokens uses ~10 MiB (tests/test_check.py measures it), far under 1 GiB * 0.95.
FITS = 'model = "model.py"\ndevice = "cpu"\nmax_len = 128\nmicro_batch = 2\ngpu_memory = "1GiB"\n'
TYPO = FITS.replace("micro_batch", "micro_bach")
GIT = ["git", "-c", "user.name=memcheck tests", "-c", "user.email=tests@memcheck.invalid", "-c", "commit.gpgsign=false",
       "-c", "init.defaultBranch=main"]


def _readme_config() -> str:
    blocks = [b for b in re.findall(r"```yaml\n(.*?)```", (ROOT / "docs" / "check.md").read_text(), re.S)
              if "repo: local" in b]
    assert len(blocks) == 1, "docs/check.md has one ```yaml block with the repo: local hook"
    return blocks[0]


def _hook() -> dict:
    (repo,) = yaml.safe_load(_readme_config())["repos"]
    assert repo["repo"] == "local"
    (hook,) = repo["hooks"]
    return hook


def test_the_readme_local_hook_runs_memcheck_check_on_what_the_shipped_hook_selects():
    hook = _hook()
    (shipped,) = yaml.safe_load((ROOT / ".pre-commit-hooks.yaml").read_text())
    assert hook["language"] == "system"  # no environment of its own: the memcheck on PATH
    assert "pass_filenames" not in hook or hook["pass_filenames"] is True  # pre-commit's default: pass the files
    for key in ("id", "name", "entry", "files", "require_serial"):
        assert hook[key] == shipped[key], key


@pytest.mark.skipif(importlib.util.find_spec("pre_commit") is None, reason="pre-commit is not installed")
def test_pre_commit_accepts_the_readme_local_hook(tmp_path):
    from pre_commit.clientlib import load_config

    path = tmp_path / ".pre-commit-config.yaml"
    path.write_text(_readme_config())
    (repo,) = load_config(str(path))["repos"]  # raises InvalidConfigError on a key or value it does not know
    assert repo["hooks"][0]["entry"] == "memcheck check"


def test_the_entry_on_the_files_pre_commit_would_pass(tmp_path, monkeypatch):
    """pre-commit searches ``files`` in each changed path and appends the matches to ``entry``."""
    hook = _hook()
    (tmp_path / ".git").mkdir()  # a repository root: model files must lie inside it
    (tmp_path / "model.py").write_text(MODEL)
    (tmp_path / "memcheck.toml").write_text(FITS)
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "user-project"\n')  # no [tool.memcheck]
    changed = ["model.py", "memcheck.toml", "pyproject.toml", "README.md"]
    passed = [name for name in changed if re.search(hook["files"], name)]
    assert passed == ["memcheck.toml", "pyproject.toml"]
    program, *args = shlex.split(hook["entry"])
    assert program == "memcheck"  # the console script of pyproject.toml's [project.scripts]: memcheck.cli:main
    monkeypatch.chdir(tmp_path)  # pre-commit runs the entry at the repository's root, with paths relative to it
    result = CliRunner().invoke(main, [*args, *passed])
    assert result.exit_code == 0, result.output
    assert "ok    memcheck.toml: " in result.stdout
    assert "pyproject.toml has no [tool.memcheck] table; skipped" in result.stderr


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("pre_commit") is None, reason="pre-commit is not installed")
@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_a_commit_runs_the_readme_local_hook(tmp_path):
    scripts = Path(sysconfig.get_path("scripts"))
    if not (scripts / "memcheck").is_file():
        pytest.skip(f"no memcheck script in {scripts}: memcheck is not installed here (pip install -e .)")
    user = tmp_path / "project"
    user.mkdir()
    (user / ".pre-commit-config.yaml").write_text(_readme_config())
    (user / "model.py").write_text(MODEL)
    (user / "memcheck.toml").write_text(TYPO)
    (user / "pyproject.toml").write_text('[project]\nname = "user-project"\n')
    env = {
        **os.environ,
        "PATH": os.pathsep.join([str(scripts), os.environ.get("PATH", "")]),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "PRE_COMMIT_HOME": str(tmp_path / "pre-commit-home"),
        "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1",  # no core.hooksPath or hooks of the user's
        "HF_HUB_OFFLINE": "1",
        "CUDA_VISIBLE_DEVICES": "",
    }

    def run(*args):
        done = subprocess.run(args, cwd=user, env=env, capture_output=True, text=True, timeout=300)
        return done.returncode, done.stdout + done.stderr  # git gives hooks its stderr for their stdout

    subprocess.run([*GIT, "init", "-q"], cwd=user, env=env, check=True)
    code, out = run(sys.executable, "-m", "pre_commit", "install")
    assert code == 0, out
    run("git", "add", "-A")

    code, out = run(*GIT, "commit", "-q", "-m", "configs")
    assert code == 1, out
    assert re.search(r"memcheck \(will the training jobs fit in GPU memory\?\)\.+Failed", out), out
    assert "- exit code: 2" in out  # a config error (README: exit codes of memcheck check)
    assert "unknown key 'micro_bach' (did you mean 'micro_batch'?)" in out
    assert run("git", "rev-parse", "--verify", "-q", "HEAD")[0] != 0  # nothing was committed
