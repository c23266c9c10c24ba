"""fsdp and zero1/2/3 (memcheck.training.strategies.fsdp and .zero), checked against hand arithmetic and,
for fsdp, against a real FSDP2 run on CPU ranks.

The model is ``Net``: ``L`` identical blocks ``Sequential(Linear(d, d), ReLU())`` in a
ModuleList (the repeated blocks fsdp wraps) and a head ``Linear(d, out)``, on meta.
``device="cpu"`` so nothing is rounded by an allocator simulation. The sizes below
are for ``Net(d=10, L=3, out=3)``:

    block:  weight (10, 10) = 100, bias (10,) = 10   -> 110 elements
    head:   weight (3, 10)  = 30,  bias (3,)  = 3    -> 33 elements
    model:  P = 3 * 110 + 33 = 363 elements = 1452 B in fp32

Adam's ``step`` counters are 0-dim float32 tensors: 4 B per parameter tensor, 8 tensors.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import memcheck
from memcheck.enums import Device, Phase
from memcheck.errors import UsageError
from memcheck.training.optimizers import resolve_optimizer
from memcheck.training.strategies import StrategyConfig, train
from memcheck.training.strategies.zero import REDUCE_BUCKET_SIZE
from memcheck.trace.tracer import ALLOC, FREE, MemoryTracer
from memcheck.training.loop import default_loss

TOLERANCE = 0.02
STEPS = 8 * 4  # Adam's step counters: 8 parameter tensors x 4 B


class Net(nn.Module):
    def __init__(self, d: int = 10, layers: int = 3, out: int = 3):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(d, d), nn.ReLU()) for _ in range(layers)])
        self.head = nn.Linear(d, out)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _estimate(strategy="single", gpus=None, d=10, batch=2, **kwargs):
    with torch.device("meta"):
        model = Net(d)
    x = torch.empty(batch, d, device="meta")
    return memcheck.estimate(model, x, device="cpu", strategy=strategy, gpus=gpus, **kwargs)


# ---- fsdp ------------------------------------------------------------------------------------

# FSDP2 pads each parameter's dim 0 to ceil(d0 / W) rows per rank; rank 0's rows are never padding.
#
# W = 2: block weight 5 rows x 10 = 50, bias 5 -> shard 55; U_block = 2 * 55 = 110
#        head weight ceil(3/2) = 2 rows x 10 = 20, bias 2 -> shard 22; U_root = 2 * 22 = 44
#        shards = 3 * 55 + 22 = 187 elements
# W = 4: block weight 3 rows x 10 = 30, bias 3 -> shard 33; U_block = 4 * 33 = 132 (100 + 10 real)
#        head weight 1 row x 10 = 10, bias 1 -> shard 11; U_root = 4 * 11 = 44
#        shards = 3 * 33 + 11 = 110 elements
FSDP = {  # W: (shards, U_block, U_root) in elements
    2: (187, 110, 44),
    4: (110, 132, 44),
}


@pytest.mark.parametrize("world", [2, 4])
def test_fsdp_rank_holds_its_shards_one_unsharded_block_the_root_and_sharded_adam_state(world):
    shards, u_block, u_root = FSDP[world]
    est = _estimate("fsdp", world)
    # The peak is in the middle block's backward: there a rank holds the most FSDP buffers at once
    # (spec A.7 step 5b): its unsharded parameters, the next block's prefetched all-gather output,
    # the last block's retained reduce-scatter input, and the root, unsharded until the end of backward.
    assert (est.peak_phase, est.peak_module) == (Phase.BACKWARD, "blocks.1.0")
    bd = est.breakdown_at_peak
    # shards + block 1 unsharded + root unsharded, fp32
    # W=2: (187 + 110 + 44) * 4 = 1364 B;  W=4: (110 + 132 + 44) * 4 = 1144 B
    assert bd.params == (shards + u_block + u_root) * 4
    # Adam's exp_avg and exp_avg_sq on the unpadded local shards (= the shards on rank 0):
    # W=2: 2 * 4 * 187 + 32 = 1528 B;  W=4: 2 * 4 * 110 + 32 = 912 B
    assert bd.optimizer == 2 * 4 * shards + STEPS
    # block 0's prefetched all-gather output + block 2's reduce-scatter input, U_block each:
    # W=2: 2 * 110 * 4 = 880 B;  W=4: 2 * 132 * 4 = 1056 B
    assert bd.communication == 2 * u_block * 4
    # block 2's sharded gradients (one shard) + the root's full gradients, kept to the end of backward:
    # W=2: (55 + 33) * 4 = 352 B;  W=4: (33 + 33) * 4 = 264 B
    assert bd.grads == (u_block // world + 33) * 4


def test_single_gpu_holds_the_whole_model_state_for_comparison():
    bd = _estimate().breakdown_at_peak
    assert bd.params == 363 * 4  # 1452 B
    assert bd.optimizer == 2 * 4 * 363 + STEPS  # 2936 B


def test_fsdp_peak_is_below_a_single_gpu_for_a_model_dominated_by_state():
    # d=256, batch 1: 3 * (65536 + 256) + 257 = 197633 elements; a single GPU holds
    # params + grads + Adam = 4 * 197633 * 4 B = 3.16 MB, activations are 1 KiB per layer.
    # Under fsdp x4 a rank holds a quarter of the params and Adam state, and at most two
    # blocks' and the root's unsharded buffers.
    single = _estimate(d=256, batch=1).peak_bytes
    fsdp = _estimate("fsdp", 4, d=256, batch=1).peak_bytes
    assert fsdp < 0.6 * single


def test_fsdp_offload_leaves_only_gathered_parameters_on_the_device():
    # CPUOffloadPolicy: shards, sharded gradients and Adam state are host memory.
    est = _estimate("fsdp", 2, offload="params")
    assert est.peak_module == "blocks.1.0"
    bd = est.breakdown_at_peak
    assert bd.params == (110 + 44) * 4  # block 1 and the root unsharded: 616 B, no shards
    assert bd.optimizer == 0
    assert bd.grads == 33 * 4  # only the root's unsharded (autograd) gradients: 132 B


def test_fsdp_has_no_optimizer_only_offload():
    with pytest.raises(UsageError, match="no optimizer-only offload"):
        _estimate("fsdp", 2, offload="optimizer")


@pytest.mark.parametrize("strategy", ["zero1", "zero2"])
def test_parameter_offload_needs_zero3(strategy):
    with pytest.raises(UsageError, match="needs zero3"):
        _estimate(strategy, 2, offload="params")


@pytest.mark.parametrize("strategy", ["fsdp", "zero1", "zero2", "zero3"])
def test_per_device_lists_every_gpu_and_they_are_alike(strategy):
    est = _estimate(strategy, 4)
    assert [d.index for d in est.per_device] == [0, 1, 2, 3]
    assert {d.peak_bytes for d in est.per_device} == {est.peak_bytes}
    assert est.gpus == 4


# ---- zero1 / zero2 ---------------------------------------------------------------------------

# W = 2: the flat buffer is padded to a multiple of 2W = 4: P_al = 364, partition = 182 elements.
BUCKET = REDUCE_BUCKET_SIZE  # 5e8 elements


@pytest.mark.parametrize("strategy", ["zero1", "zero2"])
@pytest.mark.parametrize("precision, b", [("fp32", 4), ("bf16", 2)])
def test_zero12_holds_the_flat_params_an_fp32_master_partition_adam_on_it_and_a_bucket(strategy, precision, b):
    bd = _estimate(strategy, 2, precision=precision).breakdown_at_peak
    assert bd.params == 364 * b  # the full flat buffer: 1456 B fp32, 728 B bf16
    # fp32 master clone 182 * 4 = 728 B (a clone even in fp32) + exp_avg, exp_avg_sq 2 * 728 B
    # + one step counter (one optimizer tensor): 728 + 1456 + 4 = 2188 B
    assert bd.optimizer == 182 * 4 * 3 + 4
    assert bd.communication >= BUCKET * b  # the IPG bucket: 2e9 B fp32, 1e9 B bf16


def test_zero2_all_reduces_its_bucket_through_a_flat_copy():
    est = _estimate("zero2", 2)
    assert est.peak_module == "(ZeRO all-reduce)"
    # bucket 5e8 * 4 B + allreduce_bucket's flattened copy of the 363 gradients in it
    assert est.breakdown_at_peak.communication == BUCKET * 4 + 363 * 4  # 2_000_001_452 B
    assert est.breakdown_at_peak.grads == 0  # every gradient is a view of the bucket


def test_zero1_keeps_full_gradients_to_the_end_of_backward():
    est = _estimate("zero1", 2)
    assert est.peak_module == "blocks.0.0"
    # In block 0's backward, autograd's full gradients of blocks 2 and 1 and the head are live:
    # (2 * 110 + 33) * 4 = 1012 B (block 0's own are still being computed: temporaries)
    assert est.breakdown_at_peak.grads == (2 * 110 + 33) * 4


def test_zero2_offload_optimizer_keeps_the_flat_params_bucket_and_a_gradient_buffer():
    bd = _estimate("zero2", 2, offload="optimizer").breakdown_at_peak
    assert bd.params == 364 * 4  # the flat buffer stays: 1456 B
    assert bd.optimizer == 0  # master and Adam state in host memory
    # bucket + flattened copy (363 * 4) + temp_grad_buffer_for_gpu_offload of the largest
    # parameter (block weight, 100 * 4 = 400 B)
    assert bd.communication == BUCKET * 4 + 363 * 4 + 400


# ---- zero3 -----------------------------------------------------------------------------------

# W = 2: partitions ceil(numel / 2): block 50 + 5, head 15 + 2 -> Q = 3 * 55 + 17 = 182 elements.
# Every parameter has at most 1e5 elements, so all are persistent: once gathered, never released.


def test_zero3_fp32_master_is_a_copy_of_the_partition_and_persistent_params_stay_gathered():
    est = _estimate("zero3", 2)
    assert est.peak_module == "(ZeRO-3 reduce-scatter)"
    bd = est.breakdown_at_peak
    # partitions 728 B + every parameter gathered: step 1's step re-gathered the persistent ones into
    # one buffer each of W * ceil(numel / W) elements (_allgather_params_coalesced): 2 * 182 * 4 = 1456 B
    assert bd.params == 182 * 4 + 2 * 182 * 4
    # the fp32 master, a clone of the partition even in fp32 (DeepSpeed 0.19.8 stage3.py:1162 compares a
    # torch.device with the device's name, a str, so its no-copy branch never runs; the clone is seen on real
    # CPU ranks, tests/test_frozen_sharded.py), and Adam's two states on it: 3 * 728 + 4 = 2188 B
    assert bd.optimizer == 3 * 182 * 4 + 4
    assert bd.grads == 182 * 4  # the gradient partition buffer: 728 B
    # IPG bucket + reduce_scatter_coalesced's concatenation of W * Q elements: 2e9 + 1456 B
    assert bd.communication == BUCKET * 4 + 2 * 182 * 4


def test_zero3_bf16_copies_an_fp32_master_and_the_step_releases_every_gathered_parameter():
    est = _estimate("zero3", 2, precision="bf16")
    assert est.peak_phase == Phase.OPTIMIZER
    bd = est.breakdown_at_peak
    assert bd.params == 182 * 2  # only the bf16 partitions: 364 B (_partition_all_parameters)
    assert bd.optimizer == 182 * 4 * 3 + 4  # fp32 master 728 + Adam 1456 + step 4 = 2188 B
    # gradient partitions in bf16 (364 B) + the flattened gradient cast to fp32 (728 B)
    assert bd.grads == 182 * 2 + 182 * 4
    assert bd.communication == BUCKET * 2  # the persistent IPG bucket: 1e9 B


@pytest.mark.parametrize("offload", ["optimizer", "params"])
def test_zero3_offload_moves_master_adam_and_gradient_partitions_off_the_device(offload):
    bd = _estimate("zero3", 2, offload=offload).breakdown_at_peak
    assert (bd.optimizer, bd.grads) == (0, 0)


def test_zero3_offload_params_moves_the_non_persistent_partitions_to_the_host():
    # d=320: each block weight has 102400 > 1e5 elements (not persistent), partition 51200;
    # biases (320) and the head (960 + 3) stay persistent and keep their partitions on the device.
    kept = _estimate("zero3", 2, d=320, offload="optimizer").breakdown_at_peak.params
    moved = _estimate("zero3", 2, d=320, offload="params").breakdown_at_peak.params
    assert kept - moved == 3 * 51200 * 4  # 614400 B


def _trace(model, batch, strategy, gpus, steps=2):
    tracer = MemoryTracer(Device.CPU)
    _, make_optimizer = resolve_optimizer("adamw", Device.CPU)
    with tracer:
        train(StrategyConfig.parse(strategy, gpus), tracer, model, batch, default_loss, make_optimizer, steps)
    return tracer.log


def _live_by_label(log, label, step, phase):
    """Bytes allocated under ``label`` live when ``phase`` of ``step`` begins."""
    live: dict = {}
    for ev in log.events:
        kind, sid, nbytes, module, ev_phase, ev_step = ev.kind, ev.sid, ev.nbytes, ev.module, ev.phase, ev.step
        if (ev_step, ev_phase) == (step, phase):
            break
        if kind == ALLOC and module == label:
            live[sid] = nbytes
        elif kind == FREE:
            live.pop(sid, None)
    return sum(live.values())


def test_zero3_keeps_parameters_gathered_once_step_1_has_recorded_the_trace():
    # d=320: block weights 102400 elements (> 1e5, not persistent). Step 1 records the module
    # trace and releases every parameter after its module; from step 2, a parameter used again
    # within max_reuse_distance = 1e9 elements (here: in backward) is not released after forward.
    with torch.device("meta"):
        model = Net(320)
    log = _trace(model, torch.empty(2, 320, device="meta"), "zero3", 2)
    at_backward_1 = _live_by_label(log, "(ZeRO-3 gathered params)", 0, Phase.BACKWARD)
    at_backward_2 = _live_by_label(log, "(ZeRO-3 gathered params)", 1, Phase.BACKWARD)
    # step 1 (recording): every module's parameters, persistent ones included, went after its forward
    assert at_backward_1 == 0
    # step 2: the whole model; the weights full size, the persistent parameters in the padded
    # buffers step 1's step re-gathered them into (head bias: 2 * ceil(3 / 2) = 4 elements):
    # (3 * (102400 + 320) + 960 + 4) * 4 = 1_236_496 B
    assert at_backward_2 == (3 * (102400 + 320) + 960 + 4) * 4


# ---- a transformers model on the CUDA target --------------------------------------------------

def _gpt2():
    transformers = pytest.importorskip("transformers")  # GPT-2 with 2 layers: 28 parameter tensors
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2))
    ids = torch.zeros(2, 128, dtype=torch.long, device="meta")
    return model, {"input_ids": ids, "labels": ids}


def _local_shard_numel(p, world):
    return -(-p.shape[0] // world) * (p.numel() // p.shape[0])  # ceil(d0 / W) rows of rank 0


def test_fsdp_on_gpt2_holds_adam_state_for_the_local_shards():
    model, batch = _gpt2()
    est = memcheck.estimate(model, batch, strategy="fsdp", gpus=4, device="cpu")
    # AdamW's exp_avg and exp_avg_sq of each rank-0 shard, fp32, + 28 step counters of 4 B
    shards = sum(_local_shard_numel(p, 4) for p in model.parameters())
    assert est.breakdown_at_peak.optimizer == 2 * shards * 4 + 28 * 4


@pytest.mark.parametrize("strategy", ["fsdp", "zero3"])
@pytest.mark.parametrize("precision", ["fp32", "amp-bf16"])
def test_gpt2_estimates_for_an_a100(strategy, precision):
    model, batch = _gpt2()
    est = memcheck.estimate(model, batch, strategy=strategy, gpus=4, device="cuda", gpu="A100-80GB",
                            precision=precision)
    assert len(est.per_device) == 4 and est.gpu.name == "A100-80GB"
    # fp32 weights in both precisions. Adam's two states per shard (fsdp) or on the flat fp32 master
    # of Q = sum ceil(numel / 4) elements (zero3; the master, a copy of the partition, counts as
    # optimizer state too); the step counters stay on the host. The caching allocator may grant a
    # block up to 1 MiB larger than asked when it does not split a large one.
    if strategy == "fsdp":
        copies, states, numel = 2, 2 * 28, sum(_local_shard_numel(p, 4) for p in model.parameters())
    else:
        copies, states, numel = 3, 3, sum(-(-p.numel() // 4) for p in model.parameters())
    assert copies * numel * 4 <= est.breakdown_at_peak.optimizer <= copies * numel * 4 + states * 2**20
    if strategy == "zero3":
        assert est.breakdown_at_peak.communication >= BUCKET * 4  # the persistent IPG bucket


# ---- against a real FSDP2 run (CPU, gloo) -----------------------------------------------------

# The spawned ranks unpickle these by reference, so they live at module level.

def build_fsdp_mlp():
    torch.manual_seed(0)
    return Net(d=512, layers=4, out=10), torch.randn(64, 512)


def build_fsdp_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=3, n_embd=128, n_head=4, vocab_size=2000, n_positions=128, bos_token_id=0,
                        eos_token_id=0)
    ids = torch.randint(0, 2000, (2, 64))
    return GPT2LMHeadModel(config), {"input_ids": ids, "labels": ids}  # wte tied to lm_head


def fsdp_blocks(model):
    return list(model.blocks) if isinstance(model, Net) else list(model.transformer.h)


def adamw(params):
    return torch.optim.AdamW(params)


BUILDS = {"mlp": build_fsdp_mlp, "gpt2": build_fsdp_gpt2}


@pytest.fixture(scope="module", params=sorted(BUILDS))
def fsdp_measured(request):
    """The estimate, and each rank's steady-state peak in two real runs of FSDP2 over 2 CPU ranks."""
    from memcheck.measure.distributed import measure_fsdp_cpu

    if request.param == "gpt2":
        pytest.importorskip("transformers")
    build = BUILDS[request.param]
    runs = [[r.steady_peak_bytes for r in measure_fsdp_cpu(build, adamw, world_size=2, steps=2, wrap=fsdp_blocks)]
            for _ in range(2)]
    model, batch = build()
    return memcheck.estimate(model, batch, device="cpu", strategy="fsdp", gpus=2).peak_bytes, runs


@pytest.mark.slow
def test_fsdp_estimate_matches_what_fsdp2_itself_allocates_on_a_cpu_rank(fsdp_measured):
    # gloo emulates reduce-scatter with a clone of the whole unsharded gradient and all-gathers
    # through a flat temporary, freed on a worker thread at a racy moment (memcheck.measure.distributed);
    # NCCL makes neither. That noise only adds bytes, so the smallest rank peak of two runs is
    # FSDP2's own allocation. Seen: mlp 12,153,028 B (estimate 12,153,020 B, -0.0001%),
    # gpt2 17,443,832 B (estimate 17,444,776 B, +0.005%).
    estimated, runs = fsdp_measured
    measured = min(min(run) for run in runs)
    error = (estimated - measured) / measured
    assert abs(error) <= TOLERANCE, f"estimated {estimated} B, measured {runs} B ({error:+.2%})"


@pytest.mark.slow
@pytest.mark.xfail(strict=False, reason=(
    "gloo's racy reduce-scatter clone: for the mlp the estimate (12,153,020 B) matched clean ranks to 8 B "
    "(12,153,028 B) but a rank still holding gloo's clone measured 12,547,268 / 12,809,412 / 13,203,652 B "
    "(-3.1% / -5.1% / -8.0%), 8 of 16 rank peaks in 8 scripted runs (under pytest, runs so far were clean); "
    "with W=4 ranks measured 8,599,228 / 8,467,644 / 8,467,644 / 8,459,436 B vs 8,467,628 B estimated "
    "(-1.5% .. +0.1%)"))
def test_fsdp_estimate_is_within_2_percent_of_every_measured_fsdp2_rank(fsdp_measured):
    estimated, runs = fsdp_measured
    for rank, peak in enumerate(runs[0]):
        error = (estimated - peak) / peak
        assert abs(error) <= TOLERANCE, f"rank {rank}: estimated {estimated} B, measured {peak} B ({error:+.2%})"


class _MasksItsInput(nn.Module):
    """Writes into its input in place, as Wav2Vec2's ``_mask_hidden_states`` does."""

    def __init__(self, d: int = 10):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        x[:, 0] = 0.0
        return self.lin(x)


@pytest.mark.parametrize("strategy", ["zero3"])
def test_zero3_lets_a_module_write_into_its_input_in_place(strategy):
    # issue 38's matrix: Wav2Vec2 with QLoRA (its inputs then need gradients) under zero3 failed "Output 0 of
    # _AfterInputGradients is a view and is being modified inplace": DeepSpeed's PostBackwardFunctionModule
    # returns output.detach(), which the module may write into; the emulation returned the input itself
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(10, 10), _MasksItsInput(), _MasksItsInput())
    x = torch.empty(2, 10, device="meta")
    est = memcheck.estimate(model, x, device="cpu", strategy=strategy, gpus=2)
    assert est.peak_bytes > 0
