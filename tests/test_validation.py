"""Bad input, at every entry point, ends in one line naming the flag or key, the bad value
and what is allowed (or the closest valid name), with exit code 2; never a traceback.

The entry points are the CLI (``memcheck estimate/plan/check``, through click's CliRunner),
the config files ``memcheck check`` reads, and the Python API (``memcheck.engine.estimate``,
``plan``, ``check``, ``preflight``, ``compare``), which raises ``UsageError``. Every case
fails before anything is traced: the model is a two-block MLP in a file, and the
transformers models are one-layer configs built on the meta device.
"""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

import memcheck
from memcheck.cli import main
from memcheck.errors import UsageError
from memcheck.workloads.source import load_workload

TINY = """\
import torch
from torch import nn


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.sum()


def build_model():
    return Tiny()


def make_batch(batch_size, max_len):
    return torch.randn(batch_size, max_len, 8)
"""
STRATEGIES = "allowed: single, dp, dp-balanced, ddp, fsdp, fsdp1, zero1, zero2, zero3"
PRECISIONS = "allowed: fp32, bf16, fp16, amp-bf16, amp-fp16"


@pytest.fixture(autouse=True)
def never_traced(monkeypatch):
    """Every case here is refused before the first trace."""
    from memcheck.trace.tracer import MemoryTracer

    def refuse(*args, **kwargs):
        raise AssertionError("bad input got as far as a trace")

    monkeypatch.setattr(MemoryTracer, "__enter__", refuse)


@pytest.fixture
def tiny(tmp_path):
    path = tmp_path / "tiny.py"
    path.write_text(TINY)
    return str(path)


def hf_dir(tmp_path, name: str) -> str:
    """``hf:DIR`` of a one-layer config saved as transformers saves it (config.json)."""
    import transformers

    configs = {
        # GPT2Config's n_positions default: 1024 positions
        "gpt2": transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64,
                                        architectures=["GPT2LMHeadModel"]),
        "t5": transformers.T5Config(num_layers=1, num_decoder_layers=1, d_model=16, d_kv=8, d_ff=32, num_heads=2,
                                    vocab_size=64, architectures=["T5ForConditionalGeneration"]),
        "bart": transformers.BartConfig(encoder_layers=1, decoder_layers=1, d_model=16, encoder_attention_heads=2,
                                        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
                                        vocab_size=64, max_position_embeddings=128,
                                        architectures=["BartForConditionalGeneration"]),
        "pegasus": transformers.PegasusConfig(encoder_layers=1, decoder_layers=1, d_model=16,
                                              encoder_attention_heads=2, decoder_attention_heads=2,
                                              encoder_ffn_dim=32, decoder_ffn_dim=32, vocab_size=64,
                                              max_position_embeddings=128,
                                              architectures=["PegasusForConditionalGeneration"]),
    }
    directory = tmp_path / name
    configs[name].save_pretrained(directory)
    return f"hf:{directory}"


def one_line_error(args) -> str:
    """Run the CLI; assert exit code 2, nothing on stdout and one line on stderr; return that line."""
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("memcheck: error: ") and "Traceback" not in result.stderr
    return lines[0]


def assert_words(line: str, words) -> None:
    for word in words:
        assert word in line, (word, line)


# --- the CLI: estimate ---------------------------------------------------------------

ESTIMATE_CASES = [
    # zero and negative sizes
    (["-b", "0"], ["--batch-size", "positive integer", "got 0"]),
    (["-b", "-1"], ["--batch-size", "positive integer", "got -1"]),
    (["--max-len", "0"], ["--max-len", "positive integer", "got 0"]),
    (["--max-len", "-5"], ["--max-len", "positive integer", "got -5"]),
    (["--target-len", "0"], ["--target-len", "positive integer", "got 0"]),
    (["--accumulate", "0"], ["accumulate", "positive integer", "got 0"]),
    (["--accumulate", "-2"], ["accumulate", "positive integer", "got -2"]),
    (["--steps", "1"], ["steps", "at least 2", "got 1"]),
    (["--eval-batch-size", "0"], ["--eval-batch-size", "positive integer", "got 0"]),
    (["--eval-accumulate-predictions", "-1"], ["--eval-accumulate-predictions", "got -1"]),
    (["--eval-accumulate-predictions", "2"], ["eval_accumulate_predictions", "--eval-batch-size"]),
    (["--top", "-1"], ["--top", "0 or more", "got -1"]),
    (["--gpu-memory", "0"], ["--gpu-memory '0'", "greater than zero"]),
    (["--gpu-memory", "-1GiB"], ["--gpu-memory '-1GiB'", "greater than zero"]),
    (["--gpu-memory", "lots"], ["--gpu-memory 'lots'", "not a size", "24GiB"]),
    (["--gpu-memory", "24XB"], ["--gpu-memory '24XB'", "not a size", "24GiB, 80GB or 512MiB"]),
    (["--gpu", "0"], ["GPU memory '0'", "needs a unit", "24GiB"]),
    (["--gpu", "24"], ["GPU memory '24'", "needs a unit"]),
    (["--gpu", "0GiB"], ["GPU memory '0GiB'", "greater than zero"]),
    (["--gpu", "lots"], ["unknown GPU 'lots'", "memcheck gpus", "24GiB"]),
    (["--gpu", "H100-80GX"], ["unknown GPU 'H100-80GX'", "did you mean 'H100-80GB'?"]),
    (["--gpu", "T4", "--device", "cpu"], ["gpu='T4'", "cuda target only", "--gpu-memory"]),
    (["--strategy", "ddp", "--gpus", "0"], ["gpus", "positive integer", "got 0"]),
    (["--strategy", "ddp", "--gpus", "-1"], ["gpus", "positive integer", "got -1"]),
    (["--strategy", "ddp", "--gpus", "1"], ["strategy 'ddp'", "at least 2 GPUs", "gpus=1"]),
    (["--gpus", "4"], ["strategy 'single'", "gpus=4", "dp, dp-balanced, ddp, fsdp, fsdp1 or zero1-3"]),
    (["--compare", "--gpus", "0"], ["gpus", "positive integer", "got 0"]),
    (["--bucket-cap-mb", "0", "--strategy", "ddp"], ["--bucket-cap-mb", "positive number", "got 0.0"]),
    (["--bucket-cap-mb", "-1", "--strategy", "ddp"], ["--bucket-cap-mb", "positive number", "got -1.0"]),
    (["--bucket-cap-mb", "inf", "--strategy", "ddp"], ["--bucket-cap-mb", "positive number", "got inf"]),
    (["--bucket-cap-mb", "nan", "--strategy", "ddp"], ["--bucket-cap-mb", "positive number", "got nan"]),
    (["--bucket-cap-mb", "25"], ["bucket settings apply to ddp only", "'single'"]),
    # unknown names, with the closest valid one and the allowed ones
    (["--strategy", "zer3"], ["unknown strategy 'zer3'", "did you mean 'zero3'?", STRATEGIES]),
    (["--precision", "bf61"], ["unknown precision 'bf61'", "did you mean 'bf16'?", PRECISIONS]),
    (["--precision", "fp8"], ["unknown precision 'fp8'", PRECISIONS]),
    (["--optimizer", "adamx"], ["unknown optimizer 'adamx'", "did you mean 'adam'?", "allowed: adamw, "]),
    (["--task", "causal"], ["unknown task 'causal'", "did you mean 'causal-lm'?",
                            "allowed: causal-lm, masked-lm, seq2seq, classification, image-classification"]),
    (["--attn", "flash"], ["unknown attn 'flash'", "allowed: eager, sdpa"]),
    (["--device", "gpu"], ["unknown device 'gpu'", "allowed: cpu, cuda"]),
    (["--device", "cuda:1"], ["unknown device 'cuda:1'", "did you mean 'cuda'?", "allowed: cpu, cuda"]),
    (["--device", "mps"], ["unknown device 'mps'", "allowed: cpu, cuda"]),
    (["--offload", "optimzer", "--strategy", "zero2"], ["unknown offload 'optimzer'", "did you mean 'optimizer'?",
                                                         "allowed: none, optimizer, params"]),
    (["--offload", "params"], ["offload='params'", "fsdp, fsdp1 and zero1-3", "'single'"]),
    (["--offload", "params", "--strategy", "zero1"], ["offload='params' needs zero3", "offload='optimizer'"]),
    (["--checkpointing", "ful"], ["checkpointing", "'ful'", "did you mean 'full'?", "blocks.0"]),
    (["--checkpointing", "blocks.9"], ["checkpointing", "'blocks.9'", "did you mean 'blocks.1'?"]),
    (["--checkpointing", ","], ["checkpointing names no modules", "','"]),
    # packing: a packed batch is a dict with position_ids (the model file's make_batch returns a tensor)
    (["--packing"], ["--packing needs a dict batch holding input_ids and position_ids", "got Tensor"]),
    (["--packing", "--padding", "longest"], ["--packing flattens every batch into one row", "padding longest"]),
    (["--packing", "--strategy", "dp", "--gpus", "2"], ["--packing makes one row of every batch", "strategy dp",
                                                        "use ddp"]),
    (["--packing", "--task", "masked-lm"], ["--packing packs the token sequences of causal-lm models only",
                                            "got task masked-lm"]),
    # click's own parsing: one line too
    (["-b", "abc"], ["'-b' / '--batch-size'", "'abc' is not a valid integer"]),
    (["--bucket-cap-mb", "lots"], ["'--bucket-cap-mb'", "'lots' is not a valid float"]),
    (["--no-such-flag"], ["No such option", "--no-such-flag"]),
]


@pytest.mark.parametrize("args, words", ESTIMATE_CASES, ids=[" ".join(a) for a, _ in ESTIMATE_CASES])
def test_a_bad_estimate_flag_is_one_line_naming_it_and_what_is_allowed(tiny, args, words):
    # everything but the flag under test is valid: a 2 x 4 batch of the two-block MLP
    valid = [x for flag, value in (("-b", "2"), ("--max-len", "4")) if flag not in args for x in (flag, value)]
    assert_words(one_line_error(["estimate", tiny, *valid, *args]), words)


@pytest.mark.parametrize("spec, words", [
    ("{tmp}/nope.py", ["nope.py", "no such model file"]),
    ("{tmp}", ["is neither a Python file (*.py) nor hf:NAME_OR_DIR"]),
    ("{tmp}/model.txt", ["'", "model.txt", "neither a Python file (*.py) nor hf:NAME_OR_DIR"]),
    ("hf:", ["hf: needs a model name or a directory holding config.json"]),
    ("hf:{tmp}/nope", ["hf:", "/nope is no such directory", "config.json", "hub name"]),
    ("hf:{tmp}/tiny.py", ["tiny.py is a file, not a directory", "config.json"]),
    ("hf:{tmp}", ["has no config.json"]),
    ("hf:surely-not-a-cached-model-xyz", ["hf:surely-not-a-cached-model-xyz: cannot load its config",
                                          "--allow-download"]),
])
def test_a_model_that_cannot_be_found_is_one_line_naming_it(tmp_path, tiny, spec, words):
    (tmp_path / "model.txt").write_text("")
    assert_words(one_line_error(["estimate", spec.format(tmp=tmp_path), "-b", "2"]), words)


# --- transformers models: position limits and seq2seq target lengths ----------------

def test_max_len_above_the_position_embeddings_names_the_limit_and_the_config_key(tmp_path):
    # GPT2Config's default n_positions: 1024 (config.max_position_embeddings is its alias)
    spec = hf_dir(tmp_path, "gpt2")
    line = one_line_error(["estimate", spec, "--max-len", "4096", "--device", "cpu"])
    assert_words(line, ["--max-len 4096", "position limit of 1024", "config.max_position_embeddings"])
    line = one_line_error(["plan", spec, "--max-len", "4096", "--gpu", "24GiB"])
    assert_words(line, ["--max-len 4096", "position limit of 1024"])


@pytest.mark.parametrize("name, allowed", [("t5", "a positive integer"), ("bart", "1 to 128"),
                                           ("pegasus", "1 to 128")])
def test_seq2seq_without_a_target_length_asks_for_one(tmp_path, name, allowed):
    # No default: decoder activations and the logits (batch x target x vocab) grow with the
    # label length, which is the job's own (a summary's 64 tokens, a translation's ~source
    # length); any default would be silently wrong one way or the other.
    spec = hf_dir(tmp_path, name)
    line = one_line_error(["estimate", spec, "--max-len", "16", "--device", "cpu"])
    assert_words(line, ["is a seq2seq model", "give --target-len", f"the label length, {allowed}"])
    assert_words(one_line_error(["plan", spec, "--max-len", "16", "--gpu", "24GiB"]), ["give --target-len"])


def test_seq2seq_with_a_target_length_builds_labels_of_that_length(tmp_path):
    work = load_workload(hf_dir(tmp_path, "bart"), batch_size=2, max_len=16, target_len=8)
    assert tuple(work.batch["input_ids"].shape) == (2, 16)
    assert tuple(work.batch["labels"].shape) == (2, 8)


def test_a_target_length_above_the_position_embeddings_is_refused(tmp_path):
    line = one_line_error(["estimate", hf_dir(tmp_path, "bart"), "--max-len", "16", "--target-len", "4096"])
    assert_words(line, ["--target-len 4096", "position limit of 128"])


def test_a_target_length_for_a_model_that_has_none_is_refused_not_ignored(tmp_path, tiny):
    # it would be printed in the report as if the batch had been built with it
    line = one_line_error(["estimate", hf_dir(tmp_path, "gpt2"), "--max-len", "16", "--target-len", "8"])
    assert_words(line, ["--target-len applies to seq2seq and ctc models only", "causal-lm", "drop --target-len"])
    line = one_line_error(["estimate", tiny, "--max-len", "4", "--target-len", "8"])
    assert_words(line, ["--target-len applies to transformers seq2seq models", "make_batch(batch_size, max_len)"])


def test_a_task_the_config_cannot_build_is_one_line(tmp_path):
    line = one_line_error(["estimate", hf_dir(tmp_path, "gpt2"), "--max-len", "16", "--task", "seq2seq"])
    assert_words(line, ["cannot build GPT2Config for task seq2seq"])


# --- the CLI: plan ----------------------------------------------------------------------

PLAN_CASES = [
    # 10 samples over 4 GPUs: 2.5 each; the multiples of 4 on either side are 8 and 12
    (["--global-batch", "10", "--gpus", "4", "--strategy", "ddp"],
     ["global batch 10", "not divisible by 4 GPUs", "multiple of 4", "8 or 12"]),
    (["--global-batch", "3", "--gpus", "4", "--strategy", "ddp"],
     ["global batch 3", "not divisible by 4 GPUs", "use 4 or another multiple of 4"]),
    (["--global-batch", "0"], ["--global-batch", "positive integer", "got 0"]),
    (["--global-batch", "-8"], ["--global-batch", "positive integer", "got -8"]),
    (["--margin", "1"], ["margin", "fraction in [0, 1)", "got 1.0"]),
    (["--margin", "-0.1"], ["margin", "fraction in [0, 1)", "got -0.1"]),
    (["--margin", "nan"], ["margin", "fraction in [0, 1)", "got nan"]),
    (["--precision-options", "fp32,bf61"], ["unknown precision 'bf61'", "did you mean 'bf16'?", PRECISIONS]),
    (["--precision", "fp8"], ["unknown precision 'fp8'", PRECISIONS]),
    (["--precision-options", ","], ["at least one precision"]),
    (["--checkpointing-options", "none,hlaf"], ["checkpointing option 'hlaf'", "none, half, full",
                                                 "did you mean 'half'?"]),
    (["--checkpointing-options", "ful"], ["checkpointing option 'ful'", "did you mean 'full'?"]),
    (["--strategy", "zer3"], ["unknown strategy 'zer3'", "did you mean 'zero3'?", STRATEGIES]),
    (["--strategy", "ddp", "--gpus", "0"], ["gpus", "positive integer", "got 0"]),
    (["--measure-steps", "0"], ["--measure-steps", "at least 2", "got 0"]),
    (["--measure", "--measure-steps", "1", "--device", "cpu"], ["--measure-steps", "at least 2", "got 1"]),
    (["--steps", "1"], ["steps", "at least 2", "got 1"]),
    (["--max-len", "0"], ["--max-len", "positive integer", "got 0"]),
    (["--optimizer", "sdg"], ["unknown optimizer 'sdg'", "did you mean 'sgd'?", "allowed: adamw, "]),
    (["--device", "mps"], ["unknown device 'mps'", "allowed: cpu, cuda"]),
    (["--gpu-memory", "-1GiB", "--device", "cpu"], ["--gpu-memory '-1GiB'", "greater than zero"]),
]


@pytest.mark.parametrize("args, words", PLAN_CASES, ids=[" ".join(a) for a, _ in PLAN_CASES])
def test_a_bad_plan_flag_is_one_line_naming_it_and_what_is_allowed(tiny, args, words):
    # everything but the flag under test is valid: a capacity (a GPU, or a budget on the CPU target)
    capacity = ["--gpu", "24GiB"] if "--device" not in args else [] if "--gpu-memory" in args else [
        "--gpu-memory", "1GiB"]
    max_len = [] if "--max-len" in args else ["--max-len", "4"]
    assert_words(one_line_error(["plan", tiny, *max_len, *capacity, *args]), words)


def test_plan_without_a_capacity_asks_for_one(tiny):
    line = one_line_error(["plan", tiny, "--max-len", "4", "--device", "cpu"])
    assert_words(line, ["needs a capacity", "--gpu", "--gpu-memory"])


# --- memcheck check: config files ---------------------------------------------------------

BASE = 'model = "tiny.py"\nmax_len = 4\ndevice = "cpu"\ngpu_memory = "1GiB"\n'


def _config(base: str, extra: str) -> str:
    """``base`` with the keys ``extra`` sets replaced (TOML allows each key once)."""
    keys = {line.split("=")[0].strip() for line in extra.splitlines() if "=" in line}
    kept = [line for line in base.splitlines() if line.split("=")[0].strip() not in keys]
    return "\n".join(kept) + "\n" + extra


@pytest.fixture
def repo(tmp_path, tiny):
    """A repository (a directory with .git) holding tiny.py; configs go in it."""
    root = tmp_path / "repo"
    (root / ".git").mkdir(parents=True)
    (root / "tiny.py").write_text(TINY)
    return root


CONFIG_CASES = [
    ("micro_bach = 2\n", ["unknown key 'micro_bach'", "did you mean 'micro_batch'?", "allowed: model, "]),
    ("strategy = \"zer3\"\n", ["unknown strategy 'zer3'", "did you mean 'zero3'?", STRATEGIES]),
    ("strategy = 3\n", ["strategy must be a string", "single, dp"]),
    ("precision = \"bf61\"\n", ["unknown precision 'bf61'", "did you mean 'bf16'?", PRECISIONS]),
    ("optimizer = \"adamx\"\n", ["unknown optimizer 'adamx'", "did you mean 'adam'?"]),
    ("device = \"gpu\"\n", ["unknown device 'gpu'", "allowed: cpu, cuda"]),
    ("task = \"seq2sq\"\n", ["unknown task 'seq2sq'", "did you mean 'seq2seq'?"]),
    ("attn = \"flash\"\n", ["unknown attn 'flash'", "allowed: eager, sdpa"]),
    ("offload = \"param\"\n", ["unknown offload 'param'", "did you mean 'params'?"]),
    ("checkpointing = \"ful\"\n", ["checkpointing 'ful'", "did you mean 'full'?"]),
    ("checkpointing = [\"blocks.9\"]\n", ["checkpointing", "'blocks.9'", "did you mean 'blocks.1'?"]),
    ("micro_batch = \"8\"\n", ["micro_batch must be a positive integer, got '8'"]),
    ("micro_batch = true\n", ["micro_batch must be a positive integer, got True"]),
    ("micro_batch = 2.0\n", ["micro_batch must be a positive integer, got 2.0"]),
    ("micro_batch = 0\n", ["micro_batch must be a positive integer, got 0"]),
    ("accumulation = -1\n", ["accumulation must be a positive integer, got -1"]),
    ("max_len = -4\n", ["max_len must be a positive integer, got -4"]),
    ("target_len = 0\n", ["target_len must be a positive integer, got 0"]),
    ("eval_batch = 0\n", ["eval_batch must be a positive integer, got 0"]),
    ("eval_accumulate_predictions = -1\n", ["eval_accumulate_predictions", "0 or more", "got -1"]),
    ("gpus = 4\n", ["strategy 'single' runs on one GPU", "gpus=4"]),
    ("gpus = 0\nstrategy = \"ddp\"\n", ["gpus must be a positive integer, got 0"]),
    ("gpu_memory = 0\n", ["gpu_memory must be a positive integer, got 0"]),
    ("gpu_memory = \"-1GiB\"\n", ["gpu_memory '-1GiB' must be greater than zero"]),
    ("gpu_memory = \"lots\"\n", ["gpu_memory 'lots' is not a size", "24GiB"]),
    ("gpu_memory = 1.5e9\n", ["gpu_memory must be a size such as '24GiB' or a byte count", "1500000000.0"]),
    ("device = \"cuda\"\ngpu = \"H100-80GX\"\n", ["gpu: unknown GPU 'H100-80GX'", "did you mean 'H100-80GB'?"]),
    ("margin = 1\n", ["margin must be a fraction in [0, 1)", "got 1"]),
    ("margin = \"0.1\"\n", ["margin must be a fraction in [0, 1)", "got '0.1'"]),
    ("reentrant = \"yes\"\n", ["reentrant must be true or false, got 'yes'"]),
    ("packing = \"yes\"\n", ["packing must be true or false, got 'yes'"]),
    ("padding_free = 1\n", ["padding_free must be true or false, got 1"]),  # TRL's name for packing
    ("bucket_cap_mb = 0\nstrategy = \"ddp\"\ngpus = 2\n", ["bucket_cap_mb must be a positive number, got 0"]),
    ("bucket_cap_mb = inf\nstrategy = \"ddp\"\ngpus = 2\n", ["bucket_cap_mb must be a positive number, got inf"]),
    ("model = \"nope.py\"\n", ["model 'nope.py': no such file"]),
    ("model = \"tni.py\"\n", ["model 'tni.py': no such file", "did you mean 'tiny.py'?"]),
    ("model = \"../tiny.py\"\n", ["model '../tiny.py'", "outside", "only model files inside its own repository"]),
    ("model = \".\"\n", ["model '.' is neither a model file (*.py) nor hf:NAME_OR_DIR"]),
    ("model = \"hf:nope/nope/nope\"\n", ["hf:nope/nope/nope is no such directory"]),
]


@pytest.mark.parametrize("extra, words", CONFIG_CASES, ids=[e.strip() for e, _ in CONFIG_CASES])
def test_a_bad_config_key_is_one_line_naming_the_file_the_key_and_what_is_allowed(repo, extra, words):
    path = repo / "memcheck.toml"
    path.write_text(_config(BASE, extra))
    line = one_line_error(["check", path])
    assert line.startswith(f"memcheck: error: {path}: ")
    assert_words(line, words)


@pytest.mark.parametrize("name, text, words", [
    ("job.json", json.dumps({"model": "tiny.py", "gpu": "T4", "micro_batch": 8.0}),
     ["micro_batch must be a positive integer, got 8.0"]),
    ("job.json", json.dumps({"model": "tiny.py", "gpu": "T4", "strategy": "ddp", "gpus": "4"}),
     ["gpus must be a positive integer, got '4'"]),
    ("job.json", json.dumps({"model": "tiny.py", "gpu": "T4", "max_len": True}),
     ["max_len must be a positive integer, got True"]),
    ("job.json", json.dumps({"jobs": {"big": {"model": "tiny.py", "gpu": "T4", "micro_bach": 8}}}),
     ["[jobs.big]: unknown key 'micro_bach'", "did you mean 'micro_batch'?"]),
    ("job.yaml", "model: tiny.py\ngpu: T4\nmicro_batch: yes\n", ["micro_batch must be a positive integer, got True"]),
    ("job.yaml", "model: tiny.py\ngpu: 24\n", ["gpu must be a string", "'24GiB'", "got 24"]),
    ("job.yaml", "model: tiny.py\ngpu: T4\nmargin: .nan\n", ["margin must be a fraction in [0, 1)", "nan"]),
    ("job.yaml", "model: tiny.py\ngpu: T4\ndevice: cuda:0\n", ["unknown device 'cuda:0'", "did you mean 'cuda'?"]),
])
def test_json_and_yaml_configs_are_checked_as_toml_is(repo, name, text, words):
    if name.endswith(".yaml"):
        pytest.importorskip("yaml")
    (repo / name).write_text(text)
    assert_words(one_line_error(["check", repo / name]), words)


def test_config_messages_from_loading_the_model_name_the_config_key_not_the_flag(repo):
    hf_dir(repo, "gpt2")
    hf_dir(repo, "bart")
    path = repo / "memcheck.toml"
    path.write_text('model = "hf:gpt2"\nmax_len = 4096\ngpu = "T4"\n')
    line = one_line_error(["check", path])
    assert_words(line, [f"{path}: max_len 4096 exceeds", "position limit of 1024"])
    assert "--max-len" not in line
    path.write_text('model = "hf:bart"\nmax_len = 16\ngpu = "T4"\n')
    line = one_line_error(["check", path])
    assert_words(line, ["is a seq2seq model: give target_len (the label length, 1 to 128)"])
    path.write_text('model = "hf:gpt2"\nmax_len = 16\ntarget_len = 8\ngpu = "T4"\n')
    assert_words(one_line_error(["check", path]), ["target_len applies to seq2seq and ctc models only"])


# --- the Python API: UsageError naming the argument -----------------------------------

def _model():
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))


def _batch(n=2):
    return torch.randn(n, 4)


API_CASES = [
    ("estimate", dict(steps=1), ["steps", "at least 2", "got 1"]),
    ("estimate", dict(steps=2.0), ["steps", "got 2.0"]),
    ("estimate", dict(accumulate=0), ["accumulate must be a positive integer, got 0"]),
    ("estimate", dict(accumulate="2"), ["accumulate must be a positive integer, got '2'"]),
    ("estimate", dict(precision="bf61"), ["unknown precision 'bf61'", "did you mean 'bf16'?", PRECISIONS]),
    ("estimate", dict(device="gpu"), ["unknown device 'gpu'", "allowed: cpu, cuda"]),
    ("estimate", dict(strategy="zer3"), ["unknown strategy 'zer3'", "did you mean 'zero3'?", STRATEGIES]),
    ("estimate", dict(strategy="ddp", gpus=0), ["gpus must be a positive integer, got 0"]),
    ("estimate", dict(strategy="ddp", gpus=2.0), ["gpus must be a positive integer, got 2.0"]),
    ("estimate", dict(gpus=2), ["strategy 'single' runs on one GPU, got gpus=2"]),
    ("estimate", dict(budget_bytes=0), ["budget_bytes must be a positive integer, got 0"]),
    ("estimate", dict(budget_bytes=True), ["budget_bytes must be a size such as '24GiB' or a byte count", "got True"]),
    ("estimate", dict(budget_bytes="24 parsecs"), ["'24 parsecs' is not a size", "24GiB"]),
    ("estimate", dict(optimizer="adamx"), ["unknown optimizer 'adamx'", "did you mean 'adam'?"]),
    ("estimate", dict(optimizer=3), ["optimizer must be a name", "not int"]),
    ("estimate", dict(checkpointing="ful"), ["checkpointing", "'ful'", "did you mean 'full'?"]),
    ("estimate", dict(checkpointing=3), ["checkpointing must be 'none', 'full', 'half', 'every:N', 'selective-op' or a list", "got 3"]),
    ("estimate", dict(strategy="zero3", offload="param"), ["unknown offload 'param'", "did you mean 'params'?"]),
    ("estimate", dict(strategy="ddp", bucket_cap_mb=float("inf")), ["bucket_cap_mb must be a positive number"]),
    ("estimate", dict(strategy="ddp", bucket_cap_mb="25"), ["bucket_cap_mb must be a positive number, got '25'"]),
    ("estimate", dict(packing=1), ["packing must be true or false, got 1"]),
    ("estimate", dict(packing=True), ["packing needs a dict batch", "got Tensor"]),
    ("estimate", dict(packing=True, task="seq2seq"), ["packing packs the token sequences of causal-lm models only",
                                                      "got task seq2seq"]),
    ("estimate", dict(top_modules=-1), ["top_modules must be an integer of 0 or more, got -1"]),
    ("estimate", dict(batch_size=0), ["batch_size must be a positive integer, got 0"]),
    ("estimate", dict(max_len=-1), ["max_len must be a positive integer, got -1"]),
    ("estimate", dict(gpu=24), ["gpu must be a name such as 'H100-80GB'", "got 24"]),
    ("estimate", dict(gpu="H100-80GX"), ["unknown GPU 'H100-80GX'", "did you mean 'H100-80GB'?"]),
    ("plan", dict(global_batch=10, gpus=4, strategy="ddp"), ["global batch 10", "not divisible by 4 GPUs",
                                                             "multiple of 4", "8 or 12"]),
    ("plan", dict(global_batch=0), ["global_batch must be a positive integer, got 0"]),
    ("plan", dict(margin=1), ["margin must be a fraction in [0, 1)", "got 1"]),
    ("plan", dict(precision_options=["bf61"]), ["unknown precision 'bf61'", "did you mean 'bf16'?"]),
    ("plan", dict(precision_options=7), ["precision_options must be", "got 7"]),
    ("plan", dict(checkpointing_options=["hlaf"]), ["checkpointing option 'hlaf'", "did you mean 'half'?"]),
    ("plan", dict(checkpointing_options=3), ["checkpointing_options must be", "got 3"]),
    ("plan", dict(max_len=0), ["max_len must be a positive integer, got 0"]),
    ("plan", dict(micro_batch=3), ["unknown argument(s) micro_batch"]),
    ("check", dict(margin=2), ["margin must be a fraction in [0, 1)", "got 2"]),
    ("check", dict(strategy="zer3"), ["unknown strategy 'zer3'", "did you mean 'zero3'?"]),
    ("check", dict(eval_batch_size=0), ["eval_batch_size must be a positive integer, got 0"]),
    ("check", dict(accumulate=0), ["accumulate must be a positive integer, got 0"]),
    ("check", dict(gpus=4), ["strategy 'single' runs on one GPU, got gpus=4"]),
    ("check", dict(batch_size=-2), ["batch_size must be a positive integer, got -2"]),
    ("check", dict(precision="fp64"), ["unknown precision 'fp64'", PRECISIONS]),
    ("check", dict(micro_batch=2), ["unknown argument(s) micro_batch"]),
    ("preflight", dict(strategy="zer3"), ["unknown strategy 'zer3'", "did you mean 'zero3'?"]),
    ("compare", dict(gpus=0), ["gpus must be a positive integer, got 0"]),
    ("compare", dict(gpus=True), ["gpus must be a positive integer, got True"]),
    ("compare", dict(gpus=2, strategy="ddp"), ["compare() sets strategy itself"]),
    ("compare", dict(gpus=2, precision="bf61"), ["unknown precision 'bf61'"]),
]


@pytest.mark.parametrize("entry, kwargs, words", API_CASES,
                         ids=[f"{e}-{'-'.join(f'{k}={v}' for k, v in kw.items())}" for e, kw, _ in API_CASES])
def test_a_bad_argument_to_the_python_api_raises_usage_error_naming_it(entry, kwargs, words):
    if entry == "plan":
        call = lambda: memcheck.plan(_model(), _batch, **{"gpu": "24GiB", **kwargs})  # noqa: E731
    elif entry in ("check", "preflight"):
        call = lambda: getattr(memcheck, entry)(_model(), _batch(), **{"gpu": "24GiB", **kwargs})  # noqa: E731
    else:
        defaults = {"device": "cpu"} if entry == "estimate" and "gpu" not in kwargs and "strategy" not in kwargs \
            else {}
        call = lambda: getattr(memcheck, entry)(_model(), _batch(), **{**defaults, **kwargs})  # noqa: E731
    with pytest.raises(UsageError) as info:
        call()
    message = str(info.value)
    assert len(message.splitlines()) == 1, message
    assert_words(message, words)


def test_the_api_refuses_what_is_not_a_model_or_a_batch_factory():
    with pytest.raises(UsageError, match="model must be a torch.nn.Module, got str"):
        memcheck.estimate("gpt2", _batch(), device="cpu")
    with pytest.raises(UsageError, match="make_batch must be a function .* got Tensor"):
        memcheck.plan(_model(), _batch(), gpu="24GiB")
    with pytest.raises(UsageError, match="a batch factory needs batch_size="):
        memcheck.check(_model(), _batch, gpu="24GiB")


@pytest.mark.parametrize("command", [[], ["plan"]])
@pytest.mark.parametrize("flag, value, message", [
    ("--strategy", "zer3", "did you mean 'zero3'?"),
    ("--precision", "bf61", "did you mean 'bf16'?"),
    ("--optimizer", "adamx", "did you mean 'adam'?"),
    ("--device", "gpu", "unknown device 'gpu'"),
])
def test_a_bad_flag_is_reported_before_the_model_file_runs(tmp_path, command, flag, value, message):
    # The model file raises as soon as it is imported: a flag checked after loading would be
    # hidden behind the file's error.
    path = tmp_path / "broken.py"
    path.write_text("raise RuntimeError('the model file ran')\n")
    result = CliRunner().invoke(main, [*command, str(path), flag, value])
    assert result.exit_code == 2
    assert message in result.output and "the model file ran" not in result.output, result.output


@pytest.mark.parametrize("batch, words", [
    ({"input_ids": torch.zeros(1, 8, dtype=torch.long), "attention_mask": torch.ones(1, 8, dtype=torch.long),
      "position_ids": torch.zeros(1, 8, dtype=torch.long)}, ["packing needs a batch without attention_mask"]),
    ({"input_ids": torch.zeros(1, 8, dtype=torch.long)}, ["packing needs position_ids in the batch",
                                                          "its keys are input_ids"]),
])
def test_a_packed_batch_without_position_ids_or_with_a_mask_is_refused(batch, words):
    # transformers reads packed sequences from position_ids only when no attention mask is given
    with pytest.raises(UsageError) as info:
        memcheck.estimate(_model(), batch, device="cpu", packing=True)
    assert len(str(info.value).splitlines()) == 1
    assert_words(str(info.value), words)


def test_packing_an_hf_encoder_decoder_is_one_line(tmp_path):
    line = one_line_error(["estimate", hf_dir(tmp_path, "bart"), "--packing", "--max-len", "16", "--target-len", "8",
                           "--device", "cpu"])
    assert_words(line, ["--packing packs the token sequences of causal-lm models only",
                        "BartForConditionalGeneration is seq2seq", "drop --packing"])


def test_trls_padding_free_is_packing_and_names_itself_when_bad():
    # TRL's SFTConfig: padding_free=True flattens the batch as packing does; False says nothing
    assert memcheck.Job.from_settings({"padding_free": True}).packing is True
    assert memcheck.Job.from_settings({"padding_free": False, "packing": True}).packing is True
    with pytest.raises(UsageError, match="padding_free must be true or false, got 'true'"):
        memcheck.Job.from_settings({"padding_free": "true"})
