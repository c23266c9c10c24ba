"""Hostile input, issue 20: a model whose code exits, hangs or is interrupted; a stdout that is
full or closed; torch globals set by the caller; random Job values. Each ends in exit 0, 1 or 2
(130 for Ctrl-C) with one line on stderr, in bounded time, and never a verdict for work that
did not run.

The property test over the Job's fields runs a few fixed examples in CI; for a long run set
``MEMCHECK_FUZZ_EXAMPLES`` (as tests/test_fuzz.py does):
``MEMCHECK_FUZZ_EXAMPLES=2000 pytest tests/test_hostile_exits.py -k fuzz --hypothesis-show-statistics``.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import threading

import pytest
import torch
from click.testing import CliRunner
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from torch import nn

import memcheck
from memcheck import cli
from memcheck.cli import main
from memcheck.errors import UsageError
from memcheck.job import SPELLINGS, Job, check_setting
from memcheck.trace.device_redirect import _default_device

_LONG = int(os.environ.get("MEMCHECK_FUZZ_EXAMPLES", "0"))

MODEL = """\
import torch
from torch import nn


class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 4)

    def forward(self, x):
{forward}
        return self.l(x)


def build_model():
{build}
    return M()


def make_batch(batch_size, max_len=None):
    return torch.zeros(batch_size, 4)
"""


def _model(tmp_path, name="model", forward="        pass", build="    pass"):
    path = tmp_path / f"{name}.py"
    path.write_text(MODEL.format(forward=forward, build=build))
    return path


def _config(tmp_path, model):
    path = tmp_path / f"{model.stem}.toml"
    path.write_text(f'model = "{model.name}"\ngpu_memory = "1GiB"\ndevice = "cpu"\n')
    return path


def _run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def _one_line(result, code, *words):
    """Exit ``code``, one line on stderr holding ``words``, no traceback, nothing on stdout."""
    lines = result.stderr.splitlines()
    assert result.exit_code == code, result.output
    assert len(lines) == 1 and "Traceback" not in result.output, result.stderr
    assert all(w in lines[0] for w in words), lines[0]
    assert result.stdout == ""


# ---- the model's code exits (item 1) --------------------------------------------------------

@pytest.mark.parametrize("forward, words", [
    ("        import sys; sys.exit(0)", ("exited (sys.exit(0)) while being traced",)),
    ("        raise GeneratorExit", ("raised GeneratorExit while being traced",)),
])
def test_a_forward_that_exits_is_a_model_error_not_a_pass(tmp_path, forward, words):
    model = _model(tmp_path, forward=forward)  # before: exit 0 (sys.exit) / 1 (GeneratorExit), no report
    _one_line(_run(model, "--device", "cpu"), 2, f"{model}:", *words)
    _one_line(_run("check", _config(tmp_path, model)), 2, f"{model}:", *words)


def test_a_build_model_that_exits_is_a_model_error(tmp_path):
    model = _model(tmp_path, build="    raise SystemExit(0)")
    _one_line(_run(model, "--device", "cpu"), 2, f"{model}:", "build_model() exited (sys.exit(0))")


def test_os_exit_in_the_model_is_a_model_error(tmp_path):
    """The CLI makes the model's os._exit raise (before: exit 0 and no report, a passing gate)."""
    model = _model(tmp_path, forward="        import os; os._exit(0)")
    _one_line(_run(model, "--device", "cpu"), 2, f"{model}:", "exited (os._exit(0)) while being traced")
    _one_line(_run("check", _config(tmp_path, model)), 2, f"{model}:", "exited (os._exit(0))")
    assert os._exit.__module__ == "posix" or os._exit.__module__ == "nt"  # put back after the command


@pytest.mark.skipif(not hasattr(os, "fork"), reason="memcheck check isolates its jobs with fork")
def test_check_fails_when_the_model_ends_the_process(tmp_path, monkeypatch):
    """What no Python code can catch (a SIGKILL, a C library's exit): memcheck check runs its jobs
    in one forked child (from the command line: this process has torch loaded, so it is asked
    for), and a child gone without an answer is exit 2 naming the job."""
    model = tmp_path / "model.py"
    model.write_text("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
    config = _config(tmp_path, model)
    monkeypatch.setattr(cli, "_ISOLATE", [True])
    _one_line(_run("check", config), 2, f"{config}: {model}, loading the model", "was killed by signal 9",
              "no job was judged")


def test_ctrl_c_is_one_line_and_exit_130(tmp_path):
    """KeyboardInterrupt, as Ctrl-C raises it (before: exit 1, "aborted", read by a gate as a misfit)."""
    model = _model(tmp_path, forward="        raise KeyboardInterrupt")
    _one_line(_run(model, "--device", "cpu"), 130, "interrupted")
    _one_line(_run("check", _config(tmp_path, model)), 130, "interrupted")


def test_memcheck_never_reads_stdin(tmp_path):
    model = _model(tmp_path, build="    input()")
    result = CliRunner().invoke(main, [str(model), "--device", "cpu"], input="y\n")
    _one_line(result, 2, "build_model() raised EOFError")


# ---- time limits (item 4) -------------------------------------------------------------------

@pytest.mark.skipif(threading.current_thread() is not threading.main_thread() or not hasattr(os, "fork"),
                    reason="SIGALRM reaches the main thread only")
@pytest.mark.parametrize("where, phase", [("build", "loading the model"), ("forward", "tracing")])
def test_a_model_that_never_returns_ends_at_the_timeout(tmp_path, where, phase):
    """Before: no limit, memcheck ran forever."""
    spin = "    while True:\n        pass" if where == "build" else "        while True:\n            pass"
    model = _model(tmp_path, **{where: spin})
    _one_line(_run(model, "--device", "cpu", "--timeout", "0.3"), 2, f"{phase} took longer than --timeout 0.3 s")


@pytest.mark.parametrize("value", ["nan", "-1", "inf", "1e9", "ten"])
def test_a_bad_timeout_is_refused(tmp_path, value):
    _one_line(_run(_model(tmp_path), "--timeout", value), 2, "--timeout")


# ---- writes (item 2) ------------------------------------------------------------------------

class _Failing:
    """A stdout whose writes fail with ``error``."""

    def __init__(self, error):
        self.error = error

    def write(self, text):
        raise self.error

    def flush(self):
        raise self.error


def test_a_full_stdout_is_exit_2_and_a_closed_one_is_quiet(monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdout", _Failing(OSError(28, "No space left on device")))
    with pytest.raises(SystemExit) as exit_:
        cli._print("the report")
    assert exit_.value.code == 2
    monkeypatch.setattr(sys, "stdout", _Failing(BrokenPipeError(32, "Broken pipe")))
    cli._print("the report")  # no exit: the command goes on to exit with its verdict
    monkeypatch.undo()
    assert capsys.readouterr().err == "memcheck: error: the report could not be written to stdout: No space left on device\n"


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_the_real_cli_on_dev_full():
    """One small subprocess (``--help`` loads no torch): the interpreter's last flush must not
    print a traceback either (before: a traceback, exit 1)."""
    with open("/dev/full", "w") as full:
        done = subprocess.run([sys.executable, "-m", "memcheck", "estimate", "--help"], stdout=full,
                              stderr=subprocess.PIPE, text=True, timeout=60)
    assert done.returncode == 2 and done.stderr.splitlines() == [
        "memcheck: error: the report could not be written to stdout: No space left on device"]


# ---- torch globals (item 3) -----------------------------------------------------------------

def _globals():
    return (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), _default_device(),
            torch.get_default_dtype())


def _entered(kind):
    if kind == "no_grad":
        return torch.no_grad()
    if kind == "inference_mode":
        return torch.inference_mode()
    return torch.device(kind)  # a default device: "meta", or "cuda" on a machine that may have none


@pytest.mark.parametrize("kind", ["no_grad", "inference_mode", "meta", "cuda"])
def test_estimate_plan_and_check_trace_under_the_callers_torch_globals(kind):
    """Each answers as it does with torch's defaults, and leaves the caller's globals as they
    were (before: exit 2 inside no_grad / inference_mode, "does not require grad")."""
    model, batch = nn.Linear(4, 4), torch.zeros(2, 4)

    def make(batch_size, max_len=None):
        return torch.zeros(batch_size, 4, device="cpu")

    def answers():
        est = memcheck.estimate(model, batch, device="cpu")
        verdict = memcheck.check(model, batch, device="cpu", budget_bytes=2**30, fix=False)
        best = memcheck.plan(model, make, device="cpu", budget_bytes=2**20, checkpointing_options="none")
        return est.peak_bytes, verdict.fits, verdict.estimate.peak_bytes, best.recommended.micro_batch_size

    plain = answers()
    with _entered(kind):
        before = _globals()
        got = answers()
        assert _globals() == before
    assert got == plain


# ---- random Job values (item 5) -------------------------------------------------------------

_ODD_STRINGS = st.sampled_from(["", " ", "0", "-1", "nan", "inf", "1e999", "9" * 400, "24GiB", "-24GiB", "0GiB",
                                "1e9GiB", "\x00", "é", "{name}", "{}", "%s", "none", "full", "every:0",
                                "every:-1", "cuda", "cpu", "a100-80gb", "A100-80GB", "fp32", "amp-bf16",
                                "adamw", "ddp", "fsdp", "r=0", "r=-1,alpha=nan", "routing=worst",
                                "causal-lm", "sdpa", "longest"])
_VALUES = st.one_of(
    st.none(), st.booleans(),
    st.integers(min_value=-2**80, max_value=2**80),
    st.sampled_from([0, 1, 2, -1, 2**31, 2**63, 2**64 + 1, 10**400]),
    st.floats(allow_nan=True, allow_infinity=True),
    _ODD_STRINGS, st.text(max_size=12),
    st.lists(st.sampled_from(["l", "a.b", "*", "", "h.*"]), max_size=3),
    st.just(object()), st.just({"r": 8}), st.just(b"bytes"),
)
# The fields the CLI fuzz gives a value to, as estimate's flags (the rest have no flag there, or take no
# value: on/off flags, read from their declarations).
_FLAGS = {s.field: s.flag for s in SPELLINGS
          if s.option is not None and "estimate" in s.option.commands and not s.option.negatable
          and not isinstance(Job.__dataclass_fields__[s.field].default, bool) and s.field != "margin"}


def _settings(ci_examples: int):
    return settings(max_examples=_LONG or ci_examples, deadline=None, derandomize=not _LONG, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much])


@_settings(60)
@given(field=st.sampled_from([s.field for s in SPELLINGS]), value=_VALUES)
def test_fuzz_every_job_field_takes_a_value_or_names_it(field, value):
    """A Job (and a config key) takes any value of any type, or refuses it with a UsageError
    naming the field; anything else would be exit 3 in the CLI."""
    for build in (lambda: Job(**{field: value}), lambda: check_setting(field, value)):
        try:
            build()
            event(f"{field}: accepted")
        except UsageError as exc:
            event(f"{field}: refused")
            assert str(exc).strip(), (field, value)


def _flag_value(value) -> str:
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    return str(value).replace("\x00", "")


@_settings(6)
@given(field=st.sampled_from(sorted(_FLAGS)), value=_VALUES)
def test_fuzz_the_cli_exits_0_1_or_2_with_one_line(tmp_path_factory, field, value):
    """The CLI with one flag at a random value: exit 0, 1 or 2, one line on stderr for 2, no
    traceback, and nothing written but the model file (a hang would be exit 2 at --timeout)."""
    where = tmp_path_factory.mktemp("fuzz")
    model = _model(where)
    before = os.getcwd()
    os.chdir(where)
    try:
        result = _run(model, "--device", "cpu", "--timeout", "20", _FLAGS[field], _flag_value(value))
    finally:
        os.chdir(before)
    event(f"{field}: exit {result.exit_code}")
    assert result.exit_code in (0, 1, 2), (field, value, result.output)
    assert "Traceback" not in result.output and "internal error" not in result.output, (field, value, result.output)
    if result.exit_code == 2:
        assert len(result.stderr.splitlines()) == 1, (field, value, result.stderr)
    assert sorted(p.name for p in where.iterdir()) == ["model.py"], (field, value)


def test_a_picture_written_short_is_an_error_and_leaves_nothing(tmp_path, monkeypatch):
    """write_atomically checks the file's size after the write (a short write that raised no
    error, as some network file systems give) and removes its temporary file."""
    import memcheck.report.timeline as timeline

    real = os.fdopen

    class Short:
        def __init__(self, f):
            self.f = f

        def write(self, data):
            return self.f.write(data[:3])

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    monkeypatch.setattr(timeline.os, "fdopen", lambda fd, mode: Short(real(fd, mode)))
    with pytest.raises(UsageError, match=r"--snapshot '.*step.pickle' could not be written: 3 of 10 bytes written"):
        timeline.write_atomically(tmp_path / "step.pickle", b"0123456789", "--snapshot")
    assert list(tmp_path.iterdir()) == []
