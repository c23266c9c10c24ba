"""``memcheck.report.text``: the tables fit 80 columns (issue 19).

Unit tests of the layout helpers (ranges, wrapping, continued lines), and a golden-output
test of the estimate and plan tables of one small job. The golden files check LAYOUT ONLY:
their numbers come from the code under test and are compared with every digit masked, so
no figure is checked here (the figures are checked against measured memory elsewhere,
tests/test_accuracy_cpu.py and tests/test_plan.py). Rewrite them after a deliberate layout
change with ``MEMCHECK_REGEN_GOLDEN=1 python -m pytest tests/test_text.py``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

import memcheck
from memcheck.report.text import WIDTH, continued, ranges, wrap

GOLDEN = Path(__file__).parent / "golden"


# ---- the helpers --------------------------------------------------------------------------------------


def test_ranges_name_a_stride_a_run_and_a_list():
    half = [f"model.layers.{i}" for i in range(0, 31, 2)]  # 0, 2, ..., 30: 16 blocks
    assert ranges(half) == ["model.layers.{0..30 step 2}"]
    assert ranges([f"transformer.h.{i}.mlp" for i in range(12)]) == ["transformer.h.{0..11}.mlp"]
    assert ranges(["h.1", "h.4", "h.9"]) == ["h.{1,4,9}"]
    assert ranges(["h.3", "lm_head", "encoder.layer.0", "encoder.layer.1"]) == [
        "h.3", "lm_head", "encoder.layer.{0,1}"]


def test_wrap_breaks_at_spaces_keeps_shapes_whole_and_indents_the_rest():
    line = "worst-case batch: " + ", ".join(f"input_{i} (8, 1024)" for i in range(6))
    lines = wrap(line)
    assert len(lines) > 1 and all(len(x) <= WIDTH for x in lines)
    assert all(x.startswith("  ") for x in lines[1:])
    assert " ".join(x.strip() for x in lines) == line  # nothing lost, nothing cut
    assert all("(8," not in x or "(8, 1024)" in x for x in lines)
    item = wrap("  - " + "word " * 30)
    assert item[0].startswith("  - ") and all(x.startswith("      ") for x in item[1:])
    long = "x" * 100
    assert wrap(f"a {long} b") == ["a", f"  {long}", "  b"]  # a word over the width stays whole


def test_a_long_module_name_breaks_after_a_dot_never_inside_a_range():
    from memcheck.report.text import _split_name

    name = "base_model.model.model.layers.{0..31}.mlp.gate_proj"
    assert _split_name(name, 35) == ["base_model.model.model.layers.", "  {0..31}.mlp.gate_proj"]
    assert _split_name("transformer.h.{0..11}.attn", 35) == ["transformer.h.{0..11}.attn"]


def test_continued_lines_are_a_shell_command_or_python_arguments():
    flags = [f"--flag-{i} value{i}" for i in range(12)]
    lines = continued("  memcheck flags:", flags, shell=True)
    assert lines[0] == "  memcheck flags:" and all(len(x) <= WIDTH for x in lines)
    assert all(x.endswith(" \\") for x in lines[1:-1]) and not lines[-1].endswith("\\")
    assert " ".join(x.strip().removesuffix("\\").strip() for x in lines[1:]) == " ".join(flags)
    args = [f"argument_{i}={i}" for i in range(12)]
    lines = continued("  TrainingArguments:", args, shell=False)
    assert all(x.endswith(",") for x in lines[1:-1])
    assert " ".join(x.strip() for x in lines[1:]) == ", ".join(args)
    assert continued("  short:", ["--a 1"], shell=True) == ["  short: --a 1"]


# ---- golden output at 80 columns (layout only) ---------------------------------------------------------


def _golden(name: str, text: str) -> None:
    assert all(len(line) <= WIDTH for line in text.splitlines()), "\n".join(
        line for line in text.splitlines() if len(line) > WIDTH)
    path = GOLDEN / name
    if os.environ.get("MEMCHECK_REGEN_GOLDEN"):
        path.write_text(text + "\n")
    masked = re.compile(r"\d")  # layout only: every digit the same
    assert masked.sub("0", text + "\n") == masked.sub("0", path.read_text())


@pytest.fixture(scope="module")
def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    from memcheck.enums import Task
    from memcheck.workloads import hf

    config = GPT2Config(n_layer=6, n_embd=64, n_head=2, vocab_size=500, n_positions=128)
    with torch.device("meta"):
        model = GPT2LMHeadModel(config)

    def make(batch_size, length):
        return hf.make_batch(model, config, Task.CAUSAL_LM, batch_size, length, None, device="meta")

    return model, make


def test_the_estimate_table_fits_80_columns(gpt2):
    # layout only: a CUDA target (the GPU table), the module table (the root's loss row, a
    # repeated block grouped), the assumptions wrapped; the padding answer pinned, so no branch
    # line carries the seconds the other branch took
    model, make = gpt2
    job = memcheck.Job(gpu="RTX-3090", precision="amp-bf16", max_len=32, batch_size=4, assume=("padding",))
    est = memcheck.estimate(model, make(4, 32), job, model_name="gpt2-6-layers", top_modules=5)
    _golden("estimate_80.txt", str(est))


def test_the_plan_table_fits_80_columns(gpt2):
    # layout only: the recommendation's flags (continued), TrainingArguments (broken after
    # commas), the checkpointed blocks as a range, the options table; one option and no length
    # profile keep it to 2 traces (about 1.5 s)
    model, make = gpt2
    plan = memcheck.plan(model, make, gpu="RTX-3090", global_batch=8, max_len=32, checkpointing_options=("half",),
                         precision_options=("amp-bf16",), length_profile=False, model_name="gpt2-6-layers",
                         assume=("padding",))
    _golden("plan_80.txt", str(plan))


def test_the_readmes_memcheck_outputs_fit_80_columns():
    """Issue 19: every memcheck output shown in the README and the docs pages (regenerated from
    real runs) is at most 80 columns wide; only the typed command line may be longer."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    pages = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    blocks = [b for page in pages for b in re.findall(r"```\n(.*?)```\n", page.read_text(), flags=re.S)
              if b.startswith("$ memcheck")]
    assert len(blocks) >= 5
    for block in blocks:
        for line in block.splitlines()[1:]:
            if not line.startswith("$ "):
                assert len(line) <= 80, (block.splitlines()[0], line)


def test_lightnings_fsdp2_suggestion_is_model_parallel_strategy_and_reads_back_as_fsdp():
    # Lightning's strategy="fsdp" is FSDPStrategy, FSDP1's FullyShardedDataParallel; FSDP2 is
    # ModelParallelStrategy with fully_shard in configure_model, both sizes given ("auto" would make
    # tensor_parallel_size the GPUs of a node)
    from types import SimpleNamespace

    from memcheck.integrations.lightning import _strategy
    from memcheck.report.results import PlanOption
    from memcheck.report.text import _lightning_parts

    option = PlanOption(micro_batch_size=2, accumulation_steps=1, checkpointing="full", precision="amp-bf16",
                        predicted_device_total_bytes=1, fits=True, relative_cost=1.0, traces=1,
                        largest_fitting_micro_batch=2, boundary_confirmed=True, optimizer="adamw-fused")
    parts = _lightning_parts(SimpleNamespace(strategy="fsdp", gpus=8, job=None), option)
    assert "strategy=ModelParallelStrategy(data_parallel_size=8, tensor_parallel_size=1)" in parts
    assert not any('strategy="fsdp"' in p for p in parts)
    assert any("fully_shard" in p and "configure_model" in p for p in parts)
    # the Trainer built from it is read back by the callback as memcheck's fsdp (FSDP2) over 8 GPUs
    strategy = type("ModelParallelStrategy", (), {"_data_parallel_size": 8, "_tensor_parallel_size": 1})()
    assert _strategy(SimpleNamespace(world_size=8, strategy=strategy)) == ("fsdp", 8, {})
    # fsdp1 stays Lightning's FSDPStrategy
    assert 'strategy="fsdp"' in _lightning_parts(SimpleNamespace(strategy="fsdp1", gpus=8, job=None), option)


@pytest.mark.parametrize("precision, trainer_words, read_back", [
    # DeepSpeed's bf16 mode (bf16 weights, an fp32 master): the Trainer's bf16=True fills bf16.enabled
    ("bf16", "bf16=True (DeepSpeed's bf16 mode", {"bf16": True}),
    # autocast over fp32 weights under DeepSpeed is its torch_autocast section; bf16=True would be the mode
    ("amp-bf16", '"torch_autocast": {"enabled": true, "dtype": "bfloat16"}',
     {"torch_autocast": {"enabled": True, "dtype": "bfloat16"}}),
])
def test_a_zero_plans_precision_reads_back_as_the_precision_it_traced(tmp_path, precision, trainer_words, read_back):
    import json
    from types import SimpleNamespace

    from memcheck.report.results import PlanOption
    from memcheck.report.text import _flag_parts, _lightning_parts
    from memcheck.workloads.trainer_files import trainer_settings

    option = PlanOption(micro_batch_size=2, accumulation_steps=1, checkpointing="none", precision=precision,
                        predicted_device_total_bytes=1, fits=True, relative_cost=1.0, traces=1,
                        largest_fitting_micro_batch=2, boundary_confirmed=True, optimizer="adamw-fused")
    plan = SimpleNamespace(strategy="zero2", gpus=4, job=None)
    _, args = _flag_parts(plan, option)
    assert any(trainer_words in a for a in args), args
    assert ("bf16=True" in args) is False  # never the bare flag, which means DeepSpeed's mode under ZeRO
    lightning = _lightning_parts(plan, option)
    assert ('precision="32-true"' in lightning) == (precision == "amp-bf16"), lightning
    # the TrainingArguments with that DeepSpeed config, read back as memcheck check reads them
    (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": 2},
                                                  **{k: v for k, v in read_back.items() if k != "bf16"}}))
    args_file = tmp_path / "args.json"
    args_file.write_text(json.dumps({"output_dir": "o", "deepspeed": "ds.json",
                                     **({"bf16": True} if "bf16" in read_back else {})}))
    assert trainer_settings(args_file)[1]["precision"] == precision
