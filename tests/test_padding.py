"""``padding="longest"`` (issue 22): batches padded to their longest sample, so on the CUDA
target the caching allocator replays a run whose lengths grow to ``max_len``."""

import pytest
import torch
from click.testing import CliRunner

import memcheck
from memcheck.cli import main
from memcheck.cuda.replay import aligned, device_events, growing_lengths, lagrange
from memcheck.engine.estimate import _at_length
from memcheck.enums import Device
from memcheck.trace.tracer import MemoryTracer


def _gpt2(layers=2, attn="sdpa"):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=layers, n_embd=128, n_head=4, vocab_size=1000, n_positions=512, bos_token_id=0,
                        eos_token_id=0)
    config._attn_implementation = attn
    with torch.device("meta"):
        return GPT2LMHeadModel(config)


def _batch(length, size=2):
    ids = torch.zeros(size, length, dtype=torch.long, device="meta")
    return {"input_ids": ids, "labels": ids}


def _sizes(model, length):
    """Every CUDA allocation's size in two traced AdamW steps at ``length`` tokens."""
    from memcheck.training.loop import run_steps

    tracer = MemoryTracer(Device.CUDA)
    with tracer:
        tracer.watch(model=model, batch=_batch(length))
        opt = torch.optim.AdamW(model.parameters())
        tracer.watch(optimizer=opt)
        run_steps(model, _batch(length), lambda m, b: m(**b).loss, opt, 2, tracer.set_phase)
    events, _ = device_events(tracer.log, 0, Device.CUDA, (8, 0))
    return [e[2] for e in events]


def test_growing_lengths_rise_evenly_to_max_len():
    # max_len // 16 steps: 2048 -> 128, 256, ..., 2048; a short max_len keeps only distinct lengths
    assert growing_lengths(2048) == list(range(128, 2049, 128))
    assert growing_lengths(3) == [1, 2, 3]  # 3 * i // 16 for i = 1..16, at least 1


def test_sizes_between_traced_lengths_are_the_quadratic_through_three_traces():
    # The replay sizes an allocation at a length no trace had from its sizes at max_len, a half and
    # a quarter. Checked against a real trace at a fourth length: GPT-2 (eager attention's (T, T)
    # scores make some sizes quadratic in T), traces at 256, 128 and 64 tokens, checked at 192.
    model = _gpt2(attn="eager")
    at = {length: _sizes(model, length) for length in (256, 128, 64, 192)}
    quadratic = 2 * 4 * 192 * 192 * 4  # one layer's (B, H, T, T) fp32 scores at 192 tokens: 1,179,648 B
    assert quadratic in at[192]
    assert len({len(v) for v in at.values()}) == 1  # the same ops at every length
    for n, real in enumerate(at[192]):
        assert lagrange([(x, at[x][n]) for x in (256, 128, 64)], 192) == real


def test_a_growing_run_reserves_more_than_steps_at_max_len_and_the_report_says_so():
    model = _gpt2(layers=4)
    job = memcheck.Job(gpu="A100-80GB", max_len=512, batch_size=8)
    steady = memcheck.estimate(model, _batch(512, 8), job)
    growing = memcheck.estimate(model, _batch(512, 8), job.replace(padding="longest"))
    assert growing.peak_bytes == steady.peak_bytes  # the allocated peak is max_len's either way
    assert growing.reserved_bytes >= steady.reserved_bytes
    (note,) = [a for a in growing.assumptions if a.startswith("padding=longest")]
    assert "16 steps of lengths growing from 32 to 512 tokens" in note  # 512 // 16 = 32
    assert growing.to_dict()["job"]["padding"] == "longest"


def test_padding_longest_changes_nothing_on_the_cpu_target():
    model = _gpt2()
    job = memcheck.Job(device="cpu", max_len=128)
    plain = memcheck.estimate(model, _batch(128), job)
    longest = memcheck.estimate(model, _batch(128), job.replace(padding="longest"))
    assert longest.peak_bytes == plain.peak_bytes
    assert any("changes nothing on the cpu target" in a for a in longest.assumptions)


def test_padding_longest_needs_a_length_and_a_batch_dimension_of_it():
    model = _gpt2()
    with pytest.raises(memcheck.UsageError, match="padding longest needs max_len"):
        memcheck.estimate(model, _batch(128), memcheck.Job(gpu="A100-80GB", padding="longest"))
    with pytest.raises(memcheck.UsageError, match="max_len=100, but no tensor of the batch has one"):
        memcheck.estimate(model, _batch(128), memcheck.Job(gpu="A100-80GB", padding="longest", max_len=100))


def test_a_tensor_used_twice_in_the_batch_stays_one_tensor_when_shortened():
    ids = torch.zeros(2, 64, dtype=torch.long, device="meta")
    short, changed = _at_length({"input_ids": ids, "labels": ids, "n": torch.zeros(2, device="meta")}, 64, 16)
    assert changed and short["input_ids"] is short["labels"] and tuple(short["input_ids"].shape) == (2, 16)


def test_the_cli_takes_padding_and_names_a_bad_value(tmp_path):
    runner = CliRunner()
    bad = runner.invoke(main, ["examples/gpt2_small.py", "--max-len", "64", "--padding", "longst"])
    assert bad.exit_code == 2
    assert "unknown padding 'longst' (did you mean 'longest'?)" in bad.output


def test_a_batch_that_fails_when_shortened_names_padding_not_the_model():
    # two_branch's 40 tabular features happen to equal max_len=40: cut to 20 they no longer fit
    # its Linear(40, 256); the error names --padding, in one line, exit 2
    result = CliRunner().invoke(main, ["examples/two_branch.py", "--padding", "longest", "--max-len", "40"])
    assert result.exit_code == 2
    assert "--padding longest traces the batch with its dimensions of 40 cut to 20" in result.output
    assert "fix the model code" not in result.output and len(result.output.strip().splitlines()) == 1


def test_buffers_only_the_max_len_trace_has_are_matched_around():
    # CUDA's embedding backward sorts above 3,072 indices (memcheck.rules.cuda_sort): at 512 tokens
    # x 8 rows = 4,096 indices the trace has the sort's buffers, at 256 x 8 = 2,048 it has not
    from memcheck.enums import ALLOC, FREE, Category, Event, Phase

    def ev(kind, sid, n, module="m"):
        return Event(kind, sid, n, Category.TEMPORARY, module, Phase.BACKWARD, 0, 0)

    long = [ev(ALLOC, 1, 100), ev(ALLOC, 2, 8, "wte"), ev(FREE, 2, 8, None), ev(ALLOC, 3, 50), ev(FREE, 1, 100, None)]
    short = [ev(ALLOC, 7, 25), ev(ALLOC, 9, 12), ev(FREE, 7, 25, None)]
    assert aligned(long, short) == [0, None, None, 1, 2]
    assert aligned(short, long) is None  # a shorter trace with events the longer lacks: not replayed
