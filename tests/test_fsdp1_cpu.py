"""fsdp1 (memcheck.training.strategies.fsdp1): FSDP1's FullyShardedDataParallel, against hand
arithmetic of its flat parameters and against real FSDP1 runs on CPU ranks (gloo).

The hand-arithmetic model is ``Net(d=10, L=3, out=3)`` on meta (``device="cpu"``, so nothing is
rounded by an allocator simulation): three units ``Sequential(Linear(10, 10), ReLU())`` of
``N = 100 + 10 = 110`` elements each and the root (the head) of ``N = 30 + 3 = 33``. A unit's
FlatParameter keeps ``S = ceil(N / W)`` elements per rank; its padded unsharded flat parameter
is ``W * S``:

    W = 2: blocks S = 55, padded 110;  root S = 17, padded 34;  shards 3 * 55 + 17 = 182
    W = 4: blocks S = 28, padded 112;  root S = 9,  padded 36;  shards 3 * 28 + 9  = 93

AdamW steps one flat parameter per unit: exp_avg and exp_avg_sq of ``S`` elements each (padding
included) and one 4-byte step counter per unit (4 units: 16 B).
"""

from __future__ import annotations

import pytest
import torch

import memcheck
from memcheck.enums import Phase
from memcheck.errors import UsageError
from memcheck.job import Job
from memcheck.training.strategies.fsdp1 import shard_numel
from test_sharded import Net  # the 3-block MLP of the FSDP2 and ZeRO tests

TOLERANCE = 0.02
STEPS = 4 * 4  # AdamW's step counters: 4 flat parameters x 4 B


def _estimate(gpus=2, sharding=None, **kwargs):
    with torch.device("meta"):
        model = Net()
    x = torch.empty(2, 10, device="meta")
    return memcheck.estimate(model, x, device="cpu", strategy="fsdp1", gpus=gpus, fsdp_sharding=sharding, **kwargs)


# ---- flat parameter padding, by hand --------------------------------------------------------

@pytest.mark.parametrize("numel, world, shard", [
    (110, 2, 55),  # 110 = 2 * 55: no padding
    (110, 4, 28),  # chunk(4) of 110: 28, 28, 28, 26 -> every rank 28, the last padded by 2
    (33, 2, 17),   # 17 + 16, the last padded by 1
    (33, 4, 9),    # 9, 9, 9, 6 -> padded unsharded 36
    (4160, 2, 2080),
])
def test_a_flat_parameter_shard_is_the_first_chunk_of_torch_chunk(numel, world, shard):
    assert shard_numel(numel, world) == shard
    assert torch.empty(numel).chunk(world)[0].numel() == shard  # what FSDP1's _get_unpadded_shard takes


# ---- each sharding strategy, by hand (W = 2 unless said) ------------------------------------

def test_full_shard_peaks_in_block_1s_backward_with_two_blocks_and_the_root_unsharded():
    est = _estimate(sharding="full_shard")
    assert est.peak_phase is Phase.BACKWARD
    bd = est.breakdown_at_peak
    # Block 1's split backward has just made its flat gradient. Unsharded: block 1, block 0
    # (BACKWARD_PRE prefetch) and the root (kept from forward; its split runs last in backward):
    # (182 + 110 + 110 + 34) * 4 = 1744 B
    assert bd.params == (182 + 110 + 110 + 34) * 4
    # the root's per-parameter gradients (33, held to the end of backward) + block 2's sharded
    # gradient (55) + block 1's per-parameter gradients (110) and their flat copy (110): 308 * 4 = 1232 B
    assert bd.grads == (33 + 55 + 110 + 110) * 4
    assert bd.optimizer == 2 * 182 * 4 + STEPS  # 1472 B


def test_full_shard_over_4_ranks_pads_each_flat_parameter():
    bd = _estimate(4, "full_shard").breakdown_at_peak
    assert bd.params == (93 + 112 + 112 + 36) * 4  # 1412 B: padded unsharded blocks of 4 * 28
    assert bd.grads == (33 + 28 + 110 + 110) * 4  # 1124 B
    assert bd.optimizer == 2 * 93 * 4 + STEPS  # 760 B: Adam on the padded shards


def test_shard_grad_op_keeps_every_unit_unsharded_from_forward_to_its_post_backward():
    est = _estimate(sharding="shard_grad_op")
    bd = est.breakdown_at_peak
    # peak at block 2's split backward: all three blocks and the root unsharded: (182 + 330 + 34) * 4 = 2184 B
    assert bd.params == (182 + 3 * 110 + 34) * 4
    assert bd.grads == (33 + 110 + 110) * 4  # root's + block 2's per-parameter gradients and flat copy: 1012 B


def test_no_shard_keeps_the_whole_model_and_its_flat_gradients_like_ddp():
    bd = _estimate(4, "no_shard").breakdown_at_peak
    assert bd.params == 363 * 4  # 1452 B on every rank, whatever W
    assert bd.grads == 363 * 4  # each unit's flat gradient, all-reduced in place and kept
    assert bd.optimizer == 2 * 363 * 4 + STEPS  # 2920 B


def test_hybrid_shard_is_full_shard_over_one_node():
    # 8 GPUs, 4 per node: shards over 4 ranks, replicated across the 2 nodes
    hybrid = _estimate(8, "hybrid_shard", gpus_per_node=4)
    assert hybrid.breakdown_at_peak == _estimate(4, "full_shard").breakdown_at_peak
    assert hybrid.gpus == 8 and len(hybrid.per_device) == 8
    # without gpus_per_node every GPU is on one node: full_shard over all of them
    assert _estimate(4, "hybrid_shard").breakdown_at_peak == _estimate(4, "full_shard").breakdown_at_peak


def test_offload_params_leaves_the_unsharded_units_and_the_sharded_gradients_until_the_end_of_backward():
    bd = _estimate(sharding="full_shard", offload="params").breakdown_at_peak
    assert bd.params == (110 + 110 + 34) * 4  # 1016 B: no shards on the device
    assert bd.optimizer == 0
    # block 2's device sharded gradient (_saved_grad_shard) stays to the end of backward: 1232 B
    assert bd.grads == (33 + 55 + 110 + 110) * 4


def test_offload_keeps_every_units_device_sharded_gradient_through_the_roots_post_backward():
    # Net(d=10, L=3, out=40) over 2 ranks with offload="params": blocks N = 110 (S = 55), the root (the
    # head) N = 400 + 40 = 440 (S = 220). FSDP1 deletes a unit's device _saved_grad_shard only in the final
    # callback, after the root's post-backward (_runtime_utils.py:1084-1127): the peak is the root's split
    # backward, its per-parameter gradients (440) and its flat gradient (440) beside the three blocks'
    # device shards (3 * 55), with the root unsharded (440): (440 + 440 + 165) * 4 = 4,180 B of gradients
    # and 440 * 4 = 1,760 B of parameters, beside the input x (2 * 10 * 4 = 80 B).
    # Were the blocks' shards freed before the root's post-backward (memcheck before issue 34), the peak
    # would be 5,748 B, 280 B (4.6%) lower.
    with torch.device("meta"):
        model = Net(d=10, layers=3, out=40)
    est = memcheck.estimate(model, torch.empty(2, 10, device="meta"), device="cpu", strategy="fsdp1", gpus=2,
                            offload="params")
    bd = est.breakdown_at_peak
    assert (bd.params, bd.grads, bd.inputs) == (440 * 4, (440 + 440 + 3 * 55) * 4, 80)


def test_a_unit_mixing_frozen_and_trainable_parameters_steps_the_trainable_share():
    # the blocks' weights frozen (as LoRA freezes a base): each block unit keeps its whole flat
    # parameter and gradient (use_orig_params=True), but Adam sees 10 trainable elements of 110:
    # ceil(10 / 2) = 5 per rank; the root (the head) is all trainable: its shard of 17.
    with torch.device("meta"):
        model = Net()
    for block in model.blocks:
        block[0].weight.requires_grad_(False)
    est = memcheck.estimate(model, torch.empty(2, 10, device="meta"), device="cpu", strategy="fsdp1", gpus=2)
    assert est.breakdown_at_peak.optimizer == 2 * (3 * 5 + 17) * 4 + STEPS  # 272 B
    assert any("mixing frozen and trainable" in a for a in est.assumptions)


# ---- the settings --------------------------------------------------------------------------

@pytest.mark.parametrize("settings, message", [
    (dict(strategy="fsdp1", fsdp_sharding="full-shard"), "unknown fsdp_sharding 'full-shard'"),
    (dict(strategy="fsdp", fsdp_sharding="no_shard"), "fsdp_sharding='no_shard' applies to strategy fsdp1"),
    (dict(strategy="fsdp1", gpus=4, gpus_per_node=2), "gpus_per_node=2 applies to fsdp_sharding hybrid_shard"),
    (dict(strategy="fsdp1", gpus=6, fsdp_sharding="hybrid_shard", gpus_per_node=4), "gpus_per_node=4 must divide"),
    (dict(strategy="fsdp1", gpus=4, fsdp_sharding="hybrid_shard", gpus_per_node=0), "gpus_per_node must be a"),
    (dict(strategy="fsdp1", offload="optimizer"), "fsdp1 has no optimizer-only offload"),
    (dict(strategy="fsdp1", fsdp_sharding="no_shard", offload="params"), "'no_shard' is not modelled"),
])
def test_bad_fsdp1_settings_are_named(settings, message):
    with pytest.raises(UsageError, match=message):
        Job(**settings)


def test_the_json_and_the_label_carry_the_sharding():
    job = Job(strategy="fsdp1", gpus=8, fsdp_sharding="hybrid_shard", gpus_per_node=4)
    assert (job.to_dict()["fsdp_sharding"], job.to_dict()["gpus_per_node"]) == ("hybrid_shard", 4)
    assert job.strategy_config.label == "fsdp1 x8, hybrid_shard (4 per node)"
    assert Job.from_settings({"fsdp_sharding": "shard_grad_op", "strategy": "fsdp1"},
                             vocabulary="config").strategy_config.label == "fsdp1 x2, shard_grad_op"


# ---- against real FSDP1 runs (CPU, gloo) ------------------------------------------------------

# The spawned ranks unpickle these by reference, so they live at module level.

def build_mlp():
    torch.manual_seed(0)
    return Net(d=64, layers=3, out=10), torch.randn(2, 64)


def blocks(model):
    return list(model.blocks)


def adamw(params):
    return torch.optim.AdamW(params)


SHARDINGS = ("full_shard", "shard_grad_op", "no_shard", "hybrid_shard")


@pytest.fixture(scope="module")
def fsdp1_measured():
    """Each sharding strategy's estimate and every rank's steady peak, from ONE spawn of 4 gloo ranks
    that runs the four strategies in turn (hybrid_shard: 2 nodes of 2 ranks).

    Net(64, 3, 10) on 4 ranks: blocks N = 4160 (S = 1040), root N = 650 (S = 163, padded 652:
    the reduce-scatter's F.pad copy is exercised)."""
    from memcheck.measure.distributed import measure_fsdp1_cpu

    measured = measure_fsdp1_cpu(build_mlp, adamw, world_size=4, steps=2, shardings=SHARDINGS, gpus_per_node=2,
                                 wrap=blocks)
    model, batch = build_mlp()
    out = {}
    for sharding in SHARDINGS:
        extra = {"gpus_per_node": 2} if sharding == "hybrid_shard" else {}
        estimate = memcheck.estimate(model, batch, device="cpu", strategy="fsdp1", gpus=4, fsdp_sharding=sharding,
                                     **extra)
        out[sharding] = (estimate.peak_bytes, [m.steady_peak_bytes for m in measured[sharding]])
    return out


@pytest.mark.slow
def test_fsdp1_estimate_matches_what_fsdp1_itself_allocates_in_each_sharding_strategy(fsdp1_measured):
    # Every rank runs the same allocations (the shards are padded to one size), and gloo's late frees
    # (next test) only add bytes, so the smallest rank peak is FSDP1's own. Seen, to the byte or
    # nearly: full_shard 116,884 B, shard_grad_op 129,876 B (estimates the same), hybrid_shard
    # 160,436 B (estimate 160,420 B: full_shard over 2), no_shard 260,540 B (estimate 260,528 B, -0.005%).
    failures = []
    for sharding, (estimated, ranks) in fsdp1_measured.items():
        measured = min(ranks)
        error = (estimated - measured) / measured
        if abs(error) > TOLERANCE:
            failures.append(f"{sharding}: estimated {estimated} B, measured {ranks} B ({error:+.2%})")
    assert not failures, "\n".join(failures)


@pytest.mark.xfail(strict=False, reason=(
    "gloo's all-gather flattens its input shard into a staging copy on a worker thread, which frees it after "
    "the rank has moved on, at a moment that depends on CPU load (memcheck.measure.distributed); a rank that "
    "still holds it peaks one block shard (4,160 B) higher, less an activation. Seen in about half the runs "
    "under load (load average 5-10 on 2 cores), one or two of the 16 rank peaks: full_shard 120,020 B vs "
    "116,884 B estimated (-2.6%), shard_grad_op 133,524 B vs 129,876 B (-2.7%). NCCL stages nothing."))
@pytest.mark.slow
def test_fsdp1_estimate_is_within_2_percent_of_every_measured_rank(fsdp1_measured):
    failures = []
    for sharding, (estimated, ranks) in fsdp1_measured.items():
        for rank, measured in enumerate(ranks):
            error = (estimated - measured) / measured
            if abs(error) > TOLERANCE:
                failures.append(f"{sharding} rank {rank}: estimated {estimated} B, measured {measured} B "
                                f"({error:+.2%})")
    assert not failures, "\n".join(failures)


# ---- the command line -------------------------------------------------------------------------

def _cli(*args):
    from pathlib import Path

    from click.testing import CliRunner

    from memcheck.cli import main

    two_branch = str(Path(__file__).parent.parent / "examples" / "two_branch.py")
    return CliRunner().invoke(main, [two_branch, "-b", "2", "--device", "cpu", *args])


def test_the_cli_takes_the_sharding_and_the_node_size():
    result = _cli("--strategy", "fsdp1", "--gpus", "4", "--fsdp-sharding", "hybrid_shard", "--gpus-per-node", "2",
                  "--json")
    assert result.exit_code == 0, result.output
    import json

    data = json.loads(result.output)
    assert (data["job"]["fsdp_sharding"], data["job"]["gpus_per_node"]) == ("hybrid_shard", 2)
    assert data["strategy_label"] == "fsdp1 x4, hybrid_shard (2 per node)"


@pytest.mark.parametrize("args, named", [
    (("--strategy", "fsdp1", "--fsdp-sharding", "zero2"), "'zero2'"),
    (("--strategy", "fsdp1", "--gpus", "4", "--fsdp-sharding", "hybrid_shard", "--gpus-per-node", "3"),
     "gpus_per_node=3"),
    (("--strategy", "ddp", "--fsdp-sharding", "no_shard"), "fsdp_sharding='no_shard'"),
])
def test_a_bad_sharding_flag_is_one_line_and_exit_2(args, named):
    result = _cli(*args)
    assert result.exit_code == 2, result.output
    assert named in result.output and "Traceback" not in result.output


def test_a_plan_under_fsdp1_hands_back_its_sharding_in_every_trainers_words():
    result = _cli_plan("--strategy", "fsdp1", "--gpus", "4", "--fsdp-sharding", "shard_grad_op")
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.replace("\\\n", " ").split())  # the report wraps long lines
    assert "--strategy fsdp1 --gpus 4 --fsdp-sharding shard_grad_op" in text
    assert 'fsdp="shard_grad_op", fsdp_config={"version": 1}' in text  # TrainingArguments
    assert 'strategy=FSDPStrategy(sharding_strategy="SHARD_GRAD_OP")' in text  # Lightning's FSDPStrategy is FSDP1
    assert 'strategy = "fsdp1" gpus = 4 fsdp_sharding = "shard_grad_op"' in text  # memcheck check


def _cli_plan(*args):
    from pathlib import Path

    from click.testing import CliRunner

    from memcheck.cli import main

    two_branch = str(Path(__file__).parent.parent / "examples" / "two_branch.py")
    return CliRunner().invoke(main, ["plan", two_branch, "--device", "cpu", "--gpu-memory", "1GiB", "--max-len", "8",
                                     "--optimizer", "adamw", *args])


# ---- offload against real FSDP1 ranks (CPU, gloo) ----------------------------------------------

def _stub_offload_on_cpu():
    """What CPUOffload(offload_params=True) needs of an accelerator, stubbed in the rank: pin_memory
    (_flat_param.py init_flat_param_attributes) returns the tensor itself, and the final callback's
    wait_stream/synchronize of the device stream (_runtime_utils.py:1098-1111) do nothing."""
    import torch.distributed.fsdp._runtime_utils as runtime

    torch.Tensor.pin_memory = lambda self, *args, **kwargs: self
    if getattr(runtime, "_memcheck_cpu_stub", False):
        return

    class _Stream:
        def synchronize(self):
            pass

        def wait_stream(self, other):
            pass

    final = runtime._post_backward_final_callback

    def stubbed(state, module):
        handle = state._device_handle
        current = handle.current_stream
        handle.current_stream = lambda *args, **kwargs: _Stream()
        try:
            return final(state, module)
        finally:
            handle.current_stream = current

    runtime._post_backward_final_callback = stubbed
    runtime._memcheck_cpu_stub = True


def build_offload_net():
    _stub_offload_on_cpu()
    torch.manual_seed(0)
    return Net(d=10, layers=3, out=40), torch.randn(2, 10)


@pytest.mark.slow
def test_offload_keeps_the_device_sharded_gradients_as_fsdp1_does_on_cpu_ranks():
    # The job of test_offload_keeps_every_units_device_sharded_gradient_through_the_roots_post_backward on 2 real
    # gloo ranks. On a CPU the "device" is the host, so a rank also holds what offload puts in host memory, which
    # memcheck does not count on the GPU: the flat shards (3 * 55 + 220 = 385 fp32, 1,540 B), their _cpu_grad
    # (1,540 B) and AdamW's state (2 * 1,540 B, and 4 step counters of 4 B): 6,176 B. Estimated 6,028 B on the
    # device + 6,176 B = 12,204 B; seen 12,204 B on both ranks (torch 2.13). memcheck before issue 34 read
    # 5,748 + 6,176 = 11,924 B (-2.3%). in_place=True: gloo's staging copies, which NCCL does not make, left out
    # (without it a rank was once seen 440 B higher, a block's late-freed all-gather staging copy).
    from memcheck.measure.distributed import measure_fsdp1_cpu

    measured = measure_fsdp1_cpu(build_offload_net, adamw, world_size=2, steps=2, wrap=blocks, offload_params=True,
                                 in_place=True)
    host = 385 * 4 + 385 * 4 + 2 * 385 * 4 + 4 * 4
    with torch.device("meta"):
        model = Net(d=10, layers=3, out=40)
    estimated = memcheck.estimate(model, torch.empty(2, 10, device="meta"), device="cpu", strategy="fsdp1", gpus=2,
                                  offload="params", optimizer=adamw).peak_bytes + host
    for rank, m in enumerate(measured["full_shard"]):
        error = (estimated - m.steady_peak_bytes) / m.steady_peak_bytes
        assert abs(error) <= TOLERANCE, f"rank {rank}: estimated {estimated} B, measured {m.steady_peak_bytes} B"
