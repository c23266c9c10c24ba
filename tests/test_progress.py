"""Progress goes to stderr only when stderr is a terminal, and never with --json.

The CLI runs in a subprocess whose stderr is a pseudo-terminal (``pty``), as in
a user's shell, and again with stderr piped, as in CI logs and pre-commit.
"""

from __future__ import annotations

import pytest
from terminal import ERASE, run_cli as _run

MODEL = """\
from transformers import GPT2Config, GPT2LMHeadModel


def build_model():
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=500, n_positions=128))
"""


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("progress") / "tiny.py"
    path.write_text(MODEL)
    return str(path)


ESTIMATE = ["--max-len", "32", "--device", "cpu", "--gpu-memory", "1GiB"]
PLAN = ["plan", "--max-len", "32", "--device", "cpu", "--gpu-memory", "64MiB", "--checkpointing-options", "none"]


@pytest.mark.slow
@pytest.mark.parametrize("args", [ESTIMATE, PLAN], ids=["estimate", "plan"])
def test_a_terminal_sees_progress_that_is_erased_before_the_result(model_file, args):
    args = [args[0], model_file, *args[1:]] if args[0] == "plan" else [model_file, *args]
    stdout, stderr, code = _run(args, tty=True)
    assert code == 0, stderr
    assert "tracing " in stderr and ERASE in stderr
    assert stderr.rstrip(" ").endswith(ERASE)  # the last thing written to the terminal erases the line
    assert "\r" not in stdout and "\033[" not in stdout  # the result itself is clean


@pytest.mark.slow
@pytest.mark.parametrize("args", [ESTIMATE, PLAN], ids=["estimate", "plan"])
@pytest.mark.parametrize("tty, extra", [(True, ["--json"]), (False, [])], ids=["json-on-a-terminal", "piped"])
def test_no_progress_with_json_or_when_piped(model_file, args, tty, extra):
    args = [args[0], model_file, *args[1:]] if args[0] == "plan" else [model_file, *args]
    stdout, stderr, code = _run([*args, *extra], tty=tty)
    assert code == 0, stderr
    assert "tracing" not in stderr and ERASE not in stderr


def test_an_error_on_a_terminal_is_one_clean_line(model_file):
    stdout, stderr, code = _run([model_file, "--max-len", "32", "--device", "cpu", "--optimizer", "adamm"], tty=True)
    assert code == 2
    lines = [line for line in stderr.replace(ERASE, "\n").splitlines() if line.strip()]
    assert lines[-1].startswith("memcheck: error: ") and "adamm" in lines[-1]
