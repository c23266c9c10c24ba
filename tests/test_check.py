"""``memcheck check FILE...`` and ``memcheck.config_gate``: configs read, checked and judged.

The model is a GPT-2 of two blocks of width 64 written into a temporary "repository"
(a directory holding ``.git``), traced at 128 tokens on the CPU target so that each job
costs one trace of about half a second. Whether a job fits is decided against real CPU
runs of the same steps measured by the profiler (``memcheck.measure.local.measure_cpu``), never
against memcheck's own figures; and the fix the gate prints is run for real too.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import sys
from dataclasses import FrozenInstanceError

import pytest
import torch
from click.testing import CliRunner
from terminal import run_cli

from memcheck.training.checkpointing import apply_checkpointing
from memcheck.cli import main
from memcheck.enums import Device, Precision, Strategy
from memcheck.errors import UsageError
from memcheck.cuda.gpus import GpuSpec
from memcheck.config_gate import JobConfig, load_config, load_configs
from memcheck.measure.local import measure_cpu
from memcheck.workloads.source import Workload, load_workload
from memcheck.units import GiB, MiB

MODEL = """\
from transformers import GPT2Config, GPT2LMHeadModel


def build_model():
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, n_positions=256, vocab_size=1000))
"""
# Parameters: wte 1000*64 + wpe 256*64 + 2 blocks * 49,984 + ln_f 128 = 180,480 (lm_head is tied).
# fp32 AdamW keeps 16 B of each (weight, gradient, two moments) = 2,887,680 B = 2.75 MiB.
FITS = 1 * GiB  # limit 1 GiB * 0.95 = 1,020,054,732 B = 972.8 MiB; measured below, micro-batch 2 uses ~10 MiB
OVER = 48 * MiB  # limit 48 MiB * 0.95 = 47,815,065 B = 45.6 MiB; measured below, micro-batch 16 uses more than 48 MiB
MAX_LEN, BIG_BATCH = 128, 16

SMALL_JOB = f'model = "model.py"\ndevice = "cpu"\nmax_len = {MAX_LEN}\nmicro_batch = 2\ngpu_memory = "1GiB"\n'
BIG_JOB = {"model": "model.py", "device": "cpu", "max_len": MAX_LEN, "micro_batch": BIG_BATCH, "gpu_memory": "48MiB"}
PREFLIGHT = importlib.import_module("memcheck.engine.preflight")  # memcheck.preflight the attribute is the function
FIX = re.compile(r'fix: micro_batch = (\d+), accumulation = (\d+), checkpointing = ("none"|"full"|\[[^\]]*\])')


def run(*args):
    return CliRunner().invoke(main, ["check", *map(str, args)])


def entries(stdout: str) -> list[str]:
    """The output's lines with their continuations joined: the report wraps a line at 80
    columns, continuing it on lines indented 8 (layout only)."""
    out: list[str] = []
    for line in stdout.splitlines():
        if line.startswith(" " * 8) and out:
            out[-1] += " " + line.strip()
        else:
            out.append(line)
    return out


@pytest.fixture
def repo(tmp_path):
    """A repository (a directory with .git) holding the model file; configs go in it."""
    root = tmp_path / "repo"
    (root / ".git").mkdir(parents=True)
    (root / "model.py").write_text(MODEL)
    return root


def _measured(model_dir, micro_batch: int, accumulation: int = 1, checkpointing="none") -> int:
    """The real steady-state peak of 2 AdamW steps on the CPU (weights and batch included) of
    the model file's worst-case batch, set up as a job with these settings would be."""
    path = model_dir / "model.py"

    def build():
        work = load_workload(str(path), batch_size=micro_batch, max_len=MAX_LEN, device="cpu")
        if checkpointing != "none":
            apply_checkpointing(work.model, checkpointing)
        return work.model, work.batch

    torch.manual_seed(0)
    return measure_cpu(build, lambda p: torch.optim.AdamW(p), steps=2, accumulate=accumulation).steady_peak_bytes


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("measure")
    (path / "model.py").write_text(MODEL)
    return path


@pytest.fixture(scope="module")
def measured(model_dir):
    """Real peaks of the two jobs the tests use: micro-batch 2 and micro-batch 16."""
    return {2: _measured(model_dir, 2), BIG_BATCH: _measured(model_dir, BIG_BATCH)}


@pytest.fixture(scope="module")
def two_files(tmp_path_factory):
    """One run over a TOML config that fits and a JSON config that does not."""
    root = tmp_path_factory.mktemp("two") / "repo"
    (root / ".git").mkdir(parents=True)
    (root / "model.py").write_text(MODEL)
    (root / "configs").mkdir()
    (root / "configs" / "memcheck.toml").write_text(SMALL_JOB.replace('"model.py"', '"../model.py"'))
    (root / "big.memcheck.json").write_text(json.dumps({"jobs": {"big": BIG_JOB}}))
    cwd = os.getcwd()
    os.chdir(root)  # paths as pre-commit passes them: relative to the repository
    try:
        return run("configs/memcheck.toml", "big.memcheck.json")
    finally:
        os.chdir(cwd)


def test_the_budgets_are_on_either_side_of_real_runs(measured):
    assert measured[2] <= int(FITS * 0.95), measured
    assert measured[BIG_BATCH] > OVER, measured  # over the capacity itself, not only the margin


def test_a_config_that_fits_exits_0_with_one_line_per_job(repo):
    (repo / "memcheck.toml").write_text(
        'model = "model.py"\ndevice = "cpu"\nmax_len = 128\ngpu_memory = "1GiB"\n'
        "[jobs.one]\nmicro_batch = 1\n[jobs.two]\nmicro_batch = 2\n")
    result = run(repo / "memcheck.toml")
    assert result.exit_code == 0, result.output
    lines = entries(result.stdout)
    assert len(lines) == 2 and result.stderr == ""  # no progress: CliRunner's stderr is not a terminal
    for line, job in zip(lines, ("one", "two")):
        # 1 GiB * (1 - 0.05) = 972.8 MiB
        # and the headroom the job leaves, said as estimate and plan say it (one verdict rule)
        assert re.fullmatch(rf"ok    \S+memcheck\.toml \[jobs\.{job}\]: peak [\d.]+ MiB of the 972\.8 MiB limit; "
                            r"[\d.]+% headroom; the gate keeps 5%", line)


@pytest.mark.slow
def test_multiple_files_exit_1_when_any_job_does_not_fit(two_files):
    assert two_files.exit_code == 1, two_files.output
    lines = entries(two_files.stdout)
    assert lines[0].startswith("ok    configs/memcheck.toml: peak ")
    assert lines[1].startswith("FAIL  big.memcheck.json [jobs.big]: will not fit: ")
    assert len(lines) == 3


def test_a_job_over_budget_prints_its_file_job_peak_capacity_and_fix(two_files):
    fail, fix = entries(two_files.stdout)[1:3]
    # the peak, then the limit: 48 MiB * 0.95 = 45.6 MiB of the 48.0 MiB capacity
    assert re.search(r"needs [\d.]+ MiB \(peak, reached in \w+\) over the 45\.6 MiB limit \(cpu budget 48\.0 MiB "
                     r"minus a 5% margin\) at micro-batch 16 x 1", fail), fail
    assert FIX.search(fix) and "global batch 16 kept" in fix, fix


def test_the_printed_fix_fits_when_run_for_real(two_files, model_dir):
    micro, accumulation, ck = FIX.search("\n".join(entries(two_files.stdout))).groups()
    micro, accumulation = int(micro), int(accumulation)
    assert micro * accumulation == BIG_BATCH  # the job's own global batch
    checkpointing = json.loads(ck) if ck.startswith("[") else ck.strip('"')
    real = _measured(model_dir, micro, accumulation, checkpointing)
    assert real <= int(OVER * 0.95), f"the fix {micro} x {accumulation}, {checkpointing} really used {real} B"


def test_json_prints_one_object_with_a_result_per_job(repo):
    (repo / "memcheck.toml").write_text(SMALL_JOB)
    result = run(repo / "memcheck.toml", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["fits"] is True and data["skipped"] == []
    (one,) = data["results"]
    assert one["file"].endswith("memcheck.toml") and one["job"] is None and one["fits"] is True
    assert one["capacity_bytes"] == GiB and one["limit_bytes"] == int(GiB * 0.95) == 1_020_054_732
    assert one["fix_line"] is None and one["verdict_line"].startswith("fits: ")


def test_a_job_without_micro_batch_is_checked_at_micro_batch_1(repo):
    # micro_batch is optional in a config; the model's batch is then built with 1 row, as the
    # CLI's --batch-size defaults to 1 (a regression: the Job left it None and check() refused)
    (repo / "memcheck.toml").write_text(SMALL_JOB.replace("micro_batch = 2\n", ""))
    result = run(repo / "memcheck.toml", "--json")
    assert result.exit_code == 0, result.output
    (one,) = json.loads(result.stdout)["results"]
    assert one["estimate"]["batch"]["micro_batch_size"] == 1
    assert one["estimate"]["batch"]["input_shapes"]["input_ids"] == [1, MAX_LEN]


def test_pyproject_tool_memcheck_and_yaml_are_read(repo):
    (repo / "pyproject.toml").write_text(
        '[project]\nname = "x"\n\n[tool.memcheck]\nmodel = "model.py"\ndevice = "cpu"\nmax_len = 128\n'
        'gpu_memory = "1GiB"\n\n[tool.memcheck.jobs.tiny]\nmicro_batch = 1\n')
    (repo / "train.memcheck.yaml").write_text(
        "model: model.py\ndevice: cpu\nmax_len: 128\njobs:\n  small: {micro_batch: 2, gpu_memory: 1GiB}\n")
    result = run(repo / "pyproject.toml", repo / "train.memcheck.yaml")
    assert result.exit_code == 0, result.output
    first, second = entries(result.stdout)
    assert "pyproject.toml [tool.memcheck.jobs.tiny]: peak " in first
    assert "train.memcheck.yaml [jobs.small]: peak " in second


def test_a_pyproject_without_tool_memcheck_is_skipped_with_a_note(repo):
    (repo / "pyproject.toml").write_text('[project]\nname = "x"\n[tool.black]\nline-length = 100\n')
    result = run(repo / "pyproject.toml")
    assert result.exit_code == 0 and result.stdout == ""
    assert "has no [tool.memcheck] table; skipped" in result.stderr


def test_a_config_without_jobs_is_an_error(repo):
    (repo / "memcheck.toml").write_text("")
    result = run(repo / "memcheck.toml")
    assert result.exit_code == 2 and "no jobs" in result.stderr


def test_yaml_without_pyyaml_says_how_to_install_it(repo, monkeypatch):
    (repo / "memcheck.yaml").write_text("model: model.py\n")
    monkeypatch.setitem(sys.modules, "yaml", None)  # import yaml raises ImportError
    result = run(repo / "memcheck.yaml")
    assert result.exit_code == 2 and "pip install pyyaml" in result.stderr


BASE = 'model = "model.py"\ngpu = "T4"\n'


@pytest.mark.parametrize("text, words", [
    (BASE + "micro_bach = 2\n", ["unknown key 'micro_bach'", "did you mean 'micro_batch'?", "allowed: model, "]),
    (BASE + "[job.a]\nmicro_batch = 2\n", ["unknown key 'job'", "did you mean 'jobs'?"]),
    (BASE + 'precision = "bf61"\n', ["precision 'bf61'", "did you mean 'bf16'?", "allowed: fp32, bf16"]),
    (BASE + 'optimizer = "adamww"\n', ["optimizer 'adamww'", "did you mean 'adamw'?", "allowed: adamw, "]),
    (BASE + 'strategy = "fdsp"\n', ["strategy 'fdsp'", "did you mean 'fsdp'?", "allowed: single, "]),
    (BASE + 'checkpointing = "ful"\n', ["checkpointing 'ful'", "did you mean 'full'?"]),
    ('model = "model.py"\ngpu = "RTX4900"\n', ["gpu: unknown GPU 'RTX4900'", "did you mean 'RTX-4090'?"]),
    ('model = "modle.py"\ngpu = "T4"\n', ["model 'modle.py': no such file", "did you mean 'model.py'?"]),
    (BASE + 'micro_batch = "8"\n', ["micro_batch must be a positive integer, got '8'"]),
    (BASE + "accumulation = 0\n", ["accumulation must be a positive integer, got 0"]),
    (BASE + "max_len = -128\n", ["max_len must be a positive integer, got -128"]),
    (BASE + "eval_batch = 2.5\n", ["eval_batch must be a positive integer, got 2.5"]),
    ('model = "model.py"\ngpu_memory = "0GiB"\n', ["gpu_memory '0GiB' must be greater than zero"]),
    ('model = "model.py"\ngpu_memory = "24 gigs"\n', ["gpu_memory '24 gigs' is not a size"]),
    (BASE + "margin = 1.5\n", ["margin must be a fraction in [0, 1)"]),
    (BASE + 'reentrant = "yes"\n', ["reentrant must be true or false"]),
    (BASE + "checkpointing = 3\n", ["checkpointing must be 'none', 'full', 'half', 'every:N', 'selective-op' or a non-empty list"]),
    ('model = "model.py"\n', ["no capacity", "gpu", "gpu_memory"]),
    ('gpu = "T4"\n', ["no model"]),
    ('model = "model.py"\ndevice = "cpu"\ngpu = "T4"\n', ["gpu = 'T4' applies to device = \"cuda\" only"]),
    (BASE + 'strategy = "ddp"\ngpus = 1\n', ["strategy 'ddp' needs at least 2 GPUs"]),
    (BASE + 'model = "x"\n', ["not valid TOML"]),
    (BASE + "[jobs.a]\njobs = 1\n", ["[jobs.a]: unknown key 'jobs'"]),
    (BASE + "jobs = 3\n", ["jobs must be a table of named jobs"]),
])
def test_each_config_error_exits_2_naming_the_key_and_the_closest_name(repo, monkeypatch, text, words):
    monkeypatch.setattr(PREFLIGHT, "check", _no_tracing)
    (repo / "memcheck.toml").write_text(text)
    result = run(repo / "memcheck.toml")
    assert result.exit_code == 2, result.output
    assert result.stdout == "" and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert result.stderr.startswith(f"memcheck: error: {repo / 'memcheck.toml'}")
    for word in words:
        assert word in result.stderr, (word, result.stderr)


def _no_tracing(*args, **kwargs):
    raise AssertionError("a job was traced")


def test_an_error_in_any_file_stops_everything_before_the_first_trace(repo, monkeypatch):
    monkeypatch.setattr(PREFLIGHT, "check", _no_tracing)
    (repo / "good.memcheck.toml").write_text(SMALL_JOB)
    (repo / "bad.memcheck.json").write_text(json.dumps({"jobs": {"x": {**BIG_JOB, "precison": "fp32"}}}))
    result = run(repo / "good.memcheck.toml", repo / "bad.memcheck.json")
    assert result.exit_code == 2 and result.stdout == ""
    assert "bad.memcheck.json [jobs.x]: unknown key 'precison' (did you mean 'precision'?)" in result.stderr


def test_a_model_file_that_fails_to_load_exits_2_naming_the_job_before_any_trace(repo, monkeypatch):
    monkeypatch.setattr(PREFLIGHT, "check", _no_tracing)
    (repo / "broken.py").write_text("def build_model(:\n")
    (repo / "memcheck.toml").write_text(SMALL_JOB)
    (repo / "b.memcheck.toml").write_text(SMALL_JOB.replace("model.py", "broken.py"))
    result = run(repo / "memcheck.toml", repo / "b.memcheck.toml")
    assert result.exit_code == 2, result.output
    assert "b.memcheck.toml: " in result.stderr and "broken.py:1" in result.stderr


def test_checkpointed_module_names_are_matched_against_the_model_before_any_trace(repo, monkeypatch):
    monkeypatch.setattr(PREFLIGHT, "check", _no_tracing)
    (repo / "memcheck.toml").write_text(SMALL_JOB + '[jobs.a]\ncheckpointing = ["transformer.h.*", "transformer.hh"]\n')
    result = run(repo / "memcheck.toml")
    assert result.exit_code == 2, result.output
    assert "memcheck.toml [jobs.a]: checkpointing: no module of GPT2LMHeadModel is named 'transformer.hh' " \
           "(did you mean 'transformer.h'?)" in result.stderr


def test_a_bug_during_a_trace_exits_3_naming_the_job(repo, monkeypatch):
    def broken(*args, **kwargs):
        raise ValueError("boom")

    monkeypatch.setattr(PREFLIGHT, "check", broken)
    (repo / "memcheck.toml").write_text(SMALL_JOB)
    result = run(repo / "memcheck.toml")
    assert result.exit_code == 3 and result.stdout == ""
    assert f"memcheck: error: {repo / 'memcheck.toml'}: internal error (ValueError: boom)" in result.stderr


def test_a_model_outside_the_repository_is_refused(repo, tmp_path, monkeypatch):
    monkeypatch.setattr(PREFLIGHT, "check", _no_tracing)
    (tmp_path / "elsewhere.py").write_text(MODEL)
    (repo / "memcheck.toml").write_text('model = "../elsewhere.py"\ngpu = "T4"\n')
    result = run(repo / "memcheck.toml")
    assert result.exit_code == 2
    assert "outside" in result.stderr and "runs a model file's code" in result.stderr
    (repo / "link.py").symlink_to(tmp_path / "elsewhere.py")  # a link is judged by where it points
    (repo / "memcheck.toml").write_text('model = "link.py"\ngpu = "T4"\n')
    assert run(repo / "memcheck.toml").exit_code == 2


def test_outside_a_repository_the_config_directory_is_the_boundary(tmp_path):
    (tmp_path / "model.py").write_text(MODEL)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "m.py").write_text(MODEL)
    (tmp_path / "sub" / "memcheck.toml").write_text('model = "../model.py"\ngpu = "T4"\n')
    with pytest.raises(UsageError, match="no git repository holds it"):
        load_config(tmp_path / "sub" / "memcheck.toml")
    (tmp_path / "sub" / "memcheck.toml").write_text('model = "m.py"\ngpu = "T4"\n')
    (job,) = load_config(tmp_path / "sub" / "memcheck.toml")
    assert job.model == str((tmp_path / "sub" / "m.py").resolve())


def test_top_level_keys_are_defaults_each_job_overrides(repo):
    (repo / "memcheck.toml").write_text(
        'model = "model.py"\ngpu = "A100-80GB"\nprecision = "amp-bf16"\nmax_len = 64\n'
        '[jobs.a]\nmicro_batch = 8\n[jobs.b]\nprecision = "fp32"\ncheckpointing = ["transformer.h.0"]\n'
        'strategy = "fsdp"\ngpus = 4\noffload = "params"\n')
    a, b = load_config(repo / "memcheck.toml")
    assert (a.name, a.where, a.job.batch_size, a.job.precision) == ("a", "jobs.a", 8, Precision.AMP_BF16)
    assert (b.name, b.job.batch_size, b.job.precision, b.job.checkpointing) == (
        "b", None, Precision.FP32, ("transformer.h.0",))  # no micro_batch: the model's make_batch default (1)
    assert b.job.strategy is Strategy.FSDP and b.job.gpus == 4 and a.job.max_len == b.job.max_len == 64
    assert a.model == str(repo / "model.py") and a.job.device is Device.CUDA
    with pytest.raises(FrozenInstanceError):
        a.job.batch_size = 2
    with pytest.raises(FrozenInstanceError):
        a.job = b.job


def test_gpu_memory_alone_on_cuda_is_a_gpu_of_that_size_never_the_local_one(repo):
    (repo / "memcheck.json").write_text(json.dumps({"model": "model.py", "gpu_memory": "24GiB"}))
    (job,) = load_config(repo / "memcheck.json")
    work = Workload(name="m", model=None, batch=None, loss_fn=None, make_optimizer=None, batch_size=1, max_len=None,
                    target_len=None)  # what check_job reads of a loaded workload
    checked = job.check_job(work)
    assert isinstance(checked.gpu, GpuSpec) and checked.gpu.capacity_bytes == 24 * GiB
    assert checked.budget_bytes == 24 * GiB and job.name is None and job.label.endswith("memcheck.json")


def test_a_job_config_checks_itself(repo):
    with pytest.raises(UsageError, match=r"x\.toml \[jobs\.a\]: unknown precision 'fp33'"):
        JobConfig.parse(file="x.toml", where="jobs.a", model="hf:gpt2", gpu="T4", precision="fp33")
    with pytest.raises(UsageError, match="eval_accumulate_predictions needs eval_batch"):
        JobConfig.parse(file="x.toml", where="", model="hf:gpt2", gpu="T4", eval_accumulate_predictions=2)


def test_files_named_twice_are_read_once(repo):
    (repo / "memcheck.toml").write_text(SMALL_JOB)
    jobs, skipped = load_configs([repo / "memcheck.toml", str(repo / "memcheck.toml")])
    assert len(jobs) == 1 and skipped == []


def test_check_has_help_with_its_exit_codes():
    result = CliRunner().invoke(main, ["check", "--help"])
    assert result.exit_code == 0
    for word in ("FILE...", "--json", "[tool.memcheck]", "Exit codes", "git repository"):
        assert word in result.output, word
    assert "check" in CliRunner().invoke(main, ["--help"]).output


@pytest.mark.slow
def test_progress_goes_to_a_terminal_only_and_stdout_stays_clean(repo):
    (repo / "memcheck.toml").write_text(SMALL_JOB)
    stdout, stderr, code = run_cli(["check", str(repo / "memcheck.toml")], tty=True)
    assert code == 0, stderr
    assert "memcheck.toml: tracing model" in stderr and stderr.rstrip(" ").endswith("\r\033[K")
    assert stdout.startswith("ok    ") and len(entries(stdout)) == 1 and "\r" not in stdout
