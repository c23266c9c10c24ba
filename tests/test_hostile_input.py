"""Hostile input (issue 20): every value a user can type ends in exit 2 with one line on stderr,
never exit 3 ("internal error"), a traceback or a hang.

One test a class of input: counts and sizes past their bounds (memcheck.job), nvidia-smi
printing figures that are not numbers, hf: configs transformers cannot build, config files
nested or expanded beyond their limits, a model nested deeper than memcheck can walk, and the
HF callback's optim_args. Every case here fails before anything is traced, so the file runs in
a few seconds (CliRunner in-process; one fake nvidia-smi subprocess).
"""

from __future__ import annotations

import json
import os
import stat
import sys
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner

import memcheck
from memcheck.cli import main
from memcheck.cuda.gpus import GpuSpec
from memcheck.errors import ModelLoadError, UsageError

BIG = str(2**70)  # past int64: tensor sizes and randint's size overflow with it
DIGITS = "9" * 400  # float() of it is inf


def _cli(*args):
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result


def _one_line_exit_2(result, *words):
    assert result.exit_code == 2, (result.exit_code, result.stderr, result.output)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("memcheck: error: "), result.stderr
    assert "Traceback" not in result.output and "internal error" not in result.stderr
    for word in words:
        assert word in result.stderr, result.stderr


# --- counts and sizes past their bounds (memcheck.job: checked before the model file runs) ---------


@pytest.mark.parametrize("args, named", ids=lambda v: None if isinstance(v, list) else v, argvalues=[
    (["--gpu-memory", DIGITS], "--gpu-memory"),  # was exit 3: OverflowError, float infinity to integer
    (["--gpu-memory", "1025TiB"], "at most 1 PiB"),
    (["--gpu", DIGITS + "GiB"], "--gpu"),  # was exit 3, as --gpu-memory
    (["--target-len", BIG], "--target-len"),
    (["--max-len", BIG], "--max-len"),
    (["-b", BIG], "--batch-size"),  # was exit 3: Storage size calculation overflowed
    (["--eval-batch-size", BIG], "--eval-batch-size"),  # was exit 3, as -b
    (["--eval-batch-size", "1", "--eval-accumulate-predictions", BIG], "--eval-accumulate-predictions"),
    (["--steps", "100000"], "--steps"),  # was a hang: one trace a step
    (["--steps", BIG], "--steps"),
    (["--compare", "--gpus", "100000"], "--gpus"),  # was a hang: DataParallel traces every GPU
    (["--strategy", "ddp", "--gpus", DIGITS], "--gpus"),  # was "the model failed": index-sized integer
    (["--strategy", "dp", "--gpus", "17"], "at most 16"),
    (["--strategy", "ddp", "--bucket-cap-mb", "1e300"], "--bucket-cap-mb"),  # was blamed on the model
    (["--lora", "r=99999999999999999999"], "lora r"),  # was exit 3; r=10**8 allocated 300 GB on the host
    (["--lora", "dropout=nan"], "lora dropout"),  # was accepted
])
def test_counts_and_sizes_past_their_bounds_are_one_line(args, named):
    _one_line_exit_2(_cli("examples/gpt2_small.py", *args), named)


@pytest.mark.parametrize("args, named", [
    (["--global-batch", BIG], "--global-batch"),  # was a hang: the divisors of 2**70 by trial division
    (["--measure-steps", "100000"], "--measure-steps"),
])
def test_plan_counts_past_their_bounds_are_one_line(args, named):
    _one_line_exit_2(_cli("plan", "examples/gpt2_small.py", "--gpu", "A100-80GB", *args), named)


def test_the_api_refuses_the_same_values_naming_the_keyword():
    with pytest.raises(UsageError, match="batch_size must be at most 16,777,216"):
        memcheck.Job(batch_size=2**70)
    with pytest.raises(UsageError, match="budget_bytes must be at most"):
        memcheck.Job(budget_bytes=10**400)
    with pytest.raises(UsageError, match="GPU capacity"):
        GpuSpec(name="x", capacity_bytes=2**51, arch=(8, 0), context_bytes=0)
    from memcheck.engine import plan
    from memcheck.job import MAX_GPUS

    assert MAX_GPUS == plan.MAX_GPUS  # one ceiling for the GPUs a user gives and the planner searches


@pytest.mark.slow  # a trace: ~4 s
def test_a_job_too_large_for_int64_sizes_names_the_batch_not_the_model(tmp_path):
    # 2**24 rows of 2**24 tokens into 65,536 logits: 2**64 elements, past int64
    path = tmp_path / "wide.py"
    path.write_text("import torch\nfrom torch import nn\n\n"
                    "def build_model():\n    return nn.Sequential(nn.Embedding(100, 8), nn.Linear(8, 65536))\n\n"
                    "def make_batch(batch_size, max_len):\n    return torch.randint(0, 100, (batch_size, max_len))\n\n"
                    "def compute_loss(model, batch):\n    return model(batch).mean()\n")
    _one_line_exit_2(_cli(path, "-b", 2**24, "--max-len", 2**24, "--device", "cpu"),
                     "too large to represent", "lower the batch size or the length")


# --- nvidia-smi printing figures that are not numbers ---------------------------------------------


@pytest.mark.parametrize("memory", ["1e999", "inf", "nan", "-5", "1e30", "[N/A]"])
def test_nvidia_smi_figures_that_are_not_a_memory_give_no_gpu(memory):
    from memcheck.cuda.gpus import gpu_from_smi

    assert gpu_from_smi(f"NVIDIA H100 80GB HBM3, {memory}, 9.0") is None  # 1e999 was OverflowError: exit 3


@pytest.mark.skipif(os.name != "posix", reason="fake nvidia-smi is a POSIX script")
def test_a_fake_nvidia_smi_printing_1e999_is_no_local_gpu(tmp_path, monkeypatch):
    from memcheck.cuda.gpus import device_used_bytes, local_gpu

    script = tmp_path / "nvidia-smi"
    script.write_text(f"#!{sys.executable}\nprint('NVIDIA H100 80GB HBM3, 1e999, 9.0')\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert local_gpu() is None
    script.write_text(f"#!{sys.executable}\nprint('1e999')\n")
    assert device_used_bytes() is None


# --- hf: configs transformers cannot build ----------------------------------------------------------

_GPT2 = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 64, "n_head": 2, "n_layer": 2,
         "n_positions": 128, "vocab_size": 1000}


@pytest.mark.parametrize("change, named", [
    ({"n_head": 0}, "n_head"),  # was exit 3: ZeroDivisionError
    ({"n_layer": "twelve"}, "n_layer"),  # was exit 3: transformers' strict field types
    ({"n_positions": -5}, "n_positions"),  # was exit 3: negative dimension
    ({"n_embd": 10**9}, "n_embd"),  # was exit 3: storage size overflowed
    ({"n_layer": 10**6}, "n_layer"),  # was a hang: a million blocks built
    ({"vocab_size": -1}, "vocab_size"),
    # AutoTokenizer (the case) takes the same path but imports the tokenizers (~3 s)
    ({"architectures": ["AutoConfig"]}, "AutoConfig"),  # was exit 3: no _from_config
    ({"architectures": "GPT2LMHeadModel"}, "architectures"),  # was read as the class "G"
])
def test_hf_configs_that_cannot_form_a_model_name_the_field(tmp_path, change, named):
    (tmp_path / "config.json").write_text(json.dumps({**_GPT2, **change}))
    _one_line_exit_2(_cli(f"hf:{tmp_path}", "--max-len", "64"), named)


# --- config files nested or expanded beyond their limits ---------------------------------------------

_DEEP = "[" * 5000 + "]" * 5000  # past Python's 1000 frames, as 100,000 is (and 20x faster to fail)


@pytest.mark.parametrize("name, text", ids=["deep-json", "deep-toml", "deep-yaml", "100-levels", "laughs"], argvalues=[
    ("deep.json", '{"model": "m.py", "a": ' + _DEEP + "}"),  # was exit 3: RecursionError
    ("deep.toml", 'model = "m.py"\na = ' + _DEEP + "\n"),
    ("deep.yaml", "model: m.py\na: " + _DEEP + "\n"),
    ("nested.json", '{"model": "m.py", "a": ' + "[" * 100 + "]" * 100 + "}"),  # parses; past the 64 levels
    ("laughs.yaml", "model: m.py\na: &a [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]\n"
     + "".join(f"{c}: &{c} [{', '.join(['*' + p] * 10)}]\n" for p, c in zip("abcdefgh", "bcdefghi"))
     + "micro_batch: *i\n"),  # 10**9 values once expanded
])
def test_config_files_past_the_limits_are_one_line(tmp_path, name, text):
    if name.endswith(".yaml"):
        pytest.importorskip("yaml")
    (tmp_path / name).write_text(text)
    _one_line_exit_2(_cli("check", tmp_path / name), name)


def test_an_hf_config_json_nested_5000_deep_is_one_line(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "gpt2", "a": ' + _DEEP + "}")
    _one_line_exit_2(_cli(f"hf:{tmp_path}"), "config.json", "nested too deeply")


# --- a model nested deeper than memcheck can walk ----------------------------------------------------


def test_3000_nested_sequentials_are_one_line(tmp_path):
    path = tmp_path / "deep.py"
    path.write_text("import torch\nfrom torch import nn\n\n"
                    "def build_model():\n    m = nn.Linear(4, 4)\n    for _ in range(3000):\n"
                    "        m = nn.Sequential(m)\n    return m\n\n"
                    "def make_batch(batch_size, max_len=None):\n    return torch.randn(batch_size, 4)\n")
    _one_line_exit_2(_cli(path, "--device", "cpu"), "nests modules more than 100 levels")  # was RecursionError
    model = torch.nn.Linear(4, 4)
    for _ in range(3000):
        model = torch.nn.Sequential(model)
    with pytest.raises(ModelLoadError, match="nests modules more than 100 levels"):
        memcheck.estimate(model, torch.randn(2, 4), device="cpu")


# --- the HF callback's optim_args --------------------------------------------------------------------


@pytest.mark.parametrize("optim_args, words", [
    ("momentum=abc", "optim_args momentum must be a number"),  # was exit 3: ValueError from float()
    ("momentum", "is not key=value"),
    ("momentum=nan", "finite number"),
    (5, "optim_args must be a string"),
])
def test_unparsable_optim_args_are_one_line(optim_args, words):
    from memcheck.integrations.transformers import _optimizer

    with pytest.raises(UsageError, match=words) as caught:
        _optimizer(SimpleNamespace(optim="sgd", optim_args=optim_args), None)
    assert len(str(caught.value).splitlines()) == 1


def test_a_control_character_in_an_extra_argument_stays_on_one_line():
    # found by the longer CLI fuzz: click's "unexpected extra argument" echoed a typed \r, which
    # split memcheck's one-line error in two
    from click.testing import CliRunner

    from memcheck.cli import main

    result = CliRunner().invoke(main, ["examples/gpt2_small.py", "--trust-remote-code", "a\rb\x02"])
    assert result.exit_code == 2
    assert result.stderr.splitlines() == ["memcheck: error: Got unexpected extra argument (a\\rb\\x02)"]
