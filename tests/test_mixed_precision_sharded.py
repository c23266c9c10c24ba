"""FSDP2's ``MixedPrecisionPolicy`` under ``fsdp`` and FSDP1's ``MixedPrecision`` under ``fsdp1`` (issue 34,
item 2): the job settings ``param_dtype``, ``reduce_dtype``, ``output_dtype`` and ``cast_forward_inputs``
(torchtitan's ``mixed_precision_param`` / ``mixed_precision_reduce``), and the buffers the wrappers allocate
in those dtypes. FSDP2 (torch 2.13 ``torch/distributed/fsdp/_fully_shard/``):

- ``FSDPParam.init_dtype_attrs`` (``_fsdp_param.py:586-600``): ``reduce_dtype`` is dropped when it
  equals ``param_dtype``, ``param_dtype`` when it is the parameter's own dtype;
- ``_get_param_all_gather_inputs`` (``_fsdp_collectives.py:381-426``): one flat cast copy of the
  group's shards in ``param_dtype``, then the all-gather output (``:349-351``) in ``param_dtype``,
  whose per-parameter views are the unsharded parameters (``_fsdp_param.py:636-665``);
- ``foreach_reduce`` (``_fsdp_collectives.py:559-614``): the reduce-scatter input and output in
  ``reduce_dtype`` (else the gradients' dtype), the output cast to the parameters' own dtype
  (``:696``) before it is viewed as the sharded gradients.

FSDP1 (``torch/distributed/fsdp/``, ``use_orig_params=False``, one FlatParameter a unit):

- ``_init_param_reduce_dtypes`` (``_flat_param.py:904-939``): a ``param_dtype`` without a ``reduce_dtype``
  reduces in ``param_dtype``;
- ``_use_low_precision_shard`` (``_flat_param.py:1340-1358``): the shard cast into ``_mp_shard``, the
  all-gather's input, freed once gathered (``1522-1547``); the padded unsharded flat parameter in
  ``param_dtype`` (``1277-1292``);
- ``_post_backward_hook`` (``_runtime_utils.py:701-774``): autograd's flat gradient cast to ``reduce_dtype``
  and kept (the hook's local ``autograd_computed_grad``) until the reduction is done; the sharded gradient
  cast back to the flat parameter's dtype (``_cast_grad_to_param_dtype``, ``1030-1054``).

The model is ``Net(d=64, L=3, out=10)``: three blocks ``Sequential(Linear(64, 64), ReLU())`` (one
``fully_shard`` each) and the root with the head ``Linear(64, 10)``, fp32 weights, a batch of 4 x 64.
On W = 2 ranks (FSDP2 pads dim 0 to ceil(d0 / W) rows):

    block: weight 32 rows x 64 = 2048, bias 32 -> 2080 elements a rank; 4160 unsharded
    root:  head weight ceil(10/2) = 5 rows x 64 = 320, bias 5 -> 325 a rank; 650 unsharded
"""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

import memcheck
from memcheck.cli import main
from memcheck.enums import Device, Dtype
from memcheck.errors import UsageError
from memcheck.job import Job
from memcheck.trace.tracer import ALLOC, MemoryTracer
from memcheck.training.loop import default_loss
from memcheck.training.optimizers import resolve_optimizer
from memcheck.training.strategies import StrategyConfig, train
from memcheck.training.strategies.base import MixedPrecision
from test_frozen_sharded import max_live  # the live-bytes scan of the frozen-parameter tests
from test_sharded import Net  # the 3-block MLP of the FSDP2 and ZeRO tests

TOLERANCE = 0.02
BF16, FP32 = Dtype.BF16, Dtype.FP32


# The spawned ranks unpickle these by reference.

def build():
    torch.manual_seed(0)
    return Net(d=64, out=10), torch.randn(4, 64)


def blocks(model):
    return list(model.blocks)


def adamw(params):
    return torch.optim.AdamW(params)


def _trace(policy: MixedPrecision, strategy="fsdp"):
    """The allocator events of ``strategy`` x2 under ``policy``, and the model afterwards."""
    with torch.device("meta"):
        model, batch = build()
    tracer = MemoryTracer(Device.CPU)
    _, make_optimizer = resolve_optimizer("adamw", Device.CPU)
    with tracer:
        train(StrategyConfig.parse(strategy, 2, mixed_precision=policy), tracer, model, batch, default_loss,
              make_optimizer, 2)
    return tracer.log.events, model


def _sizes(events) -> dict[str, set[int]]:
    """The byte sizes allocated under each FSDP label."""
    out: dict[str, set[int]] = {}
    for kind, _, nbytes, _, module, *_ in events:
        if kind == ALLOC and module and module.startswith("(FSDP"):  # FSDP2's and FSDP1's
            out.setdefault(module, set()).add(nbytes)
    return out


# ---- by hand: the buffers in each dtype --------------------------------------------------------

def test_torchtitans_policy_gathers_in_bf16_and_reduces_in_fp32():
    events, model = _trace(MixedPrecision(BF16, FP32))
    sizes = _sizes(events)
    # the shards stay fp32: block weight 2048 * 4 = 8192 B, bias 32 * 4 = 128 B; head 320 * 4, 5 * 4
    assert sizes["(FSDP shards)"] == {8192, 128, 1280, 20}
    # one flat bf16 copy of a group's shards: block 2080 * 2 = 4160 B, root 325 * 2 = 650 B
    assert sizes["(FSDP cast input)"] == {4160, 650}
    # the all-gather output in bf16: block 4160 * 2 = 8320 B, root 650 * 2 = 1300 B (fp32: 16,640 and 2600)
    assert sizes["(FSDP all-gather)"] == {8320, 1300}
    # unsharded parameters in bf16: block weight 4096 * 2, bias 64 * 2; head 640 * 2, 10 * 2
    assert sizes["(FSDP unsharded params)"] == {8192, 128, 1280, 20}
    # the reduce-scatter input in fp32 (the bf16 gradients copied in): block 4160 * 4, root 650 * 4
    assert sizes["(FSDP reduce-scatter)"] == {16640, 2600}
    # reduce_dtype is the shards' dtype: the output is the sharded gradients, no cast: 2080 * 4, 325 * 4
    assert sizes["(FSDP sharded grads)"] == {8320, 1300}
    assert "(FSDP reduce-scatter output)" not in sizes
    # in backward: the root (kept to the end of backward) and one block unsharded: (650 + 4160) * 2 = 9620 B
    # (fp32: 19,240 B)
    assert max_live(events, "(FSDP unsharded params)") == 9620
    # the user's model is handed back in its own dtype
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_param_dtype_alone_reduces_in_bf16_and_casts_the_sharded_gradients_back():
    sizes = _sizes(_trace(MixedPrecision(BF16))[0])
    # reduce_dtype None: the gradients' own, bf16: input block 4160 * 2 = 8320 B, root 650 * 2 = 1300 B
    assert sizes["(FSDP reduce-scatter)"] == {8320, 1300}
    # the bf16 output (2080 * 2 = 4160 B, 325 * 2 = 650 B), cast to fp32 sharded gradients (2080 * 4, 325 * 4)
    assert sizes["(FSDP reduce-scatter output)"] == {4160, 650}
    assert sizes["(FSDP sharded grads)"] == {8320, 1300}


def test_reduce_dtype_alone_gathers_fp32_and_reduces_bf16():
    sizes = _sizes(_trace(MixedPrecision(reduce_dtype=BF16))[0])
    # no param_dtype: the shards are the all-gather inputs themselves, the output fp32: 4160 * 4, 650 * 4
    assert "(FSDP cast input)" not in sizes
    assert sizes["(FSDP all-gather)"] == {16640, 2600}
    # the fp32 gradients copied into a bf16 reduce-scatter input: 4160 * 2, 650 * 2
    assert sizes["(FSDP reduce-scatter)"] == {8320, 1300}
    assert sizes["(FSDP reduce-scatter output)"] == {4160, 650}


def test_a_param_dtype_equal_to_the_weights_dtype_casts_nothing():
    # param_dtype fp32 over fp32 weights is dropped (init_dtype_attrs), and reduce_dtype fp32 with it:
    # the same buffers as no policy
    assert _sizes(_trace(MixedPrecision(FP32, FP32))[0]) == _sizes(_trace(MixedPrecision())[0])


def test_the_forward_computes_in_param_dtype_and_output_dtype_casts_the_output():
    def dtypes(**policy):
        seen = set()

        def loss(model, x):
            out = model(x)
            seen.add(out.dtype)
            return out.float().pow(2).mean()

        model, batch = build()
        memcheck.estimate(model, batch, device="cpu", strategy="fsdp", gpus=2, loss_fn=loss, **policy)
        return seen

    # the head computes in bf16 (its input cast by the root, its weight gathered in bf16); output_dtype
    # casts the root's output to fp32
    assert dtypes(param_dtype="bf16") == {torch.bfloat16}
    assert dtypes(param_dtype="bf16", output_dtype="fp32") == {torch.float32}


# ---- fsdp1, by hand: N = 4160 (S = 2080) a block, N = 650 (S = 325) the root; W * S = N, so no padding copy ----

def test_fsdp1_gathers_a_bf16_copy_of_the_shard_and_reduces_an_fp32_cast_of_the_gradient():
    events, model = _trace(MixedPrecision(BF16, FP32), "fsdp1")
    sizes = _sizes(events)
    # the flat shards stay fp32: 2080 * 4 = 8320 B, 325 * 4 = 1300 B
    assert sizes["(FSDP1 flat param shards)"] == {8320, 1300}
    # _mp_shard, the all-gather input: 2080 * 2 = 4160 B, 325 * 2 = 650 B
    assert sizes["(FSDP1 low-precision shard)"] == {4160, 650}
    # the padded unsharded flat parameter in bf16: 4160 * 2 = 8320 B, 650 * 2 = 1300 B (fp32: 16,640 and 2600)
    assert sizes["(FSDP1 unsharded flat params)"] == {8320, 1300}
    # autograd's flat gradient in bf16 (4160 * 2, 650 * 2) and its fp32 cast (4160 * 4, 650 * 4)
    assert sizes["(FSDP1 flat grads)"] == {8320, 1300, 16640, 2600}
    # the sharded gradient in reduce_dtype fp32, the flat parameter's own: 2080 * 4, 325 * 4, no cast back
    assert sizes["(FSDP1 sharded grads)"] == {8320, 1300}
    # in a block's post-backward autograd's bf16 gradient (8320 B) is still referenced beside its fp32 cast
    # (16,640 B); the root's flat gradient is made only at the end of backward, after the blocks' reductions:
    # 8320 + 16,640 = 24,960 B at most
    assert max_live(events, "(FSDP1 flat grads)") == 8320 + 16640
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_fsdp1_param_dtype_alone_reduces_in_it_and_casts_the_sharded_gradient_back():
    sizes = _sizes(_trace(MixedPrecision(BF16), "fsdp1")[0])
    # reduce_dtype inferred as bf16: no cast of the flat gradient, 4160 * 2 and 650 * 2 only
    assert sizes["(FSDP1 flat grads)"] == {8320, 1300}
    # the bf16 sharded gradient (2080 * 2, 325 * 2), then its fp32 cast (2080 * 4, 325 * 4)
    assert sizes["(FSDP1 sharded grads)"] == {4160, 650, 8320, 1300}


# ---- the settings -------------------------------------------------------------------------------

def test_torchtitans_keys_and_torch_dtype_names_spell_the_policy():
    job = Job.from_settings({"strategy": "fsdp", "gpus": 8, "mixed_precision_param": "bfloat16",
                             "mixed_precision_reduce": "float32"}, vocabulary="config")
    assert job.strategy_config.mixed_precision == MixedPrecision(BF16, FP32)
    assert Job(strategy="fsdp", param_dtype=torch.bfloat16).param_dtype is BF16
    assert job.to_dict()["param_dtype"] == "bf16" and job.strategy_config.label == "fsdp x8, param bf16, reduce fp32"


@pytest.mark.parametrize("strategy", ["ddp", "zero3", "single", "dp"])
def test_a_policy_on_another_strategy_is_refused_by_name(strategy):
    with pytest.raises(UsageError, match=f"param_dtype bf16 applies to strategies fsdp and fsdp1 .*, not {strategy}:"):
        Job(strategy=strategy, param_dtype="bf16")


def test_fsdp1_refuses_fsdp2s_output_dtype_and_a_policy_under_no_shard():
    with pytest.raises(UsageError, match="output_dtype is FSDP2's"):
        Job(strategy="fsdp1", output_dtype="fp32")
    with pytest.raises(UsageError, match="param_dtype with fsdp_sharding no_shard is not modelled"):
        Job(strategy="fsdp1", fsdp_sharding="no_shard", param_dtype="bf16")


def test_the_cli_refuses_a_policy_on_ddp_and_an_unknown_dtype_in_one_line(tmp_path):
    model = tmp_path / "model.py"
    model.write_text("import torch\nfrom torch import nn\n\ndef build_model():\n    return nn.Linear(4, 4)\n\n"
                     "def make_batch(batch_size, max_len):\n    return torch.randn(batch_size, 4)\n")
    for flags, message in ((["--strategy", "ddp", "--param-dtype", "bf16"],
                            "--param-dtype bf16 applies to strategies fsdp and fsdp1 (FSDP's mixed precision), not ddp"),
                           (["--strategy", "fsdp", "--reduce-dtype", "bf61"],
                            "unknown --reduce-dtype 'bf61' (did you mean 'bf16'?); allowed: fp32, bf16, fp16")):
        result = CliRunner().invoke(main, ["estimate", str(model), "--device", "cpu", "--gpus", "2", *flags])
        assert result.exit_code == 2, result.output
        assert len(result.stderr.strip().splitlines()) == 1 and message in result.stderr


# ---- against a real run (CPU, gloo) -------------------------------------------------------------

@pytest.mark.slow
def test_torchtitans_policy_matches_fsdp2_on_cpu_ranks():
    # fully_shard(block, mp_policy=MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)) on each
    # block and the root, 2 gloo ranks, in_place=True (gloo's staging copies, which NCCL does not make, left
    # out). Seen (torch 2.13, this machine): 134,420 B measured on both ranks in 4 runs, 134,412 B estimated
    # (before _InPlaceCollectives waited for gloo's worker thread to drop its references, a rank read 134,952 or
    # 130,948 B in some runs). Before the policy was modelled memcheck said
    # 162,996 B (+21.3%), the real run without a policy 163,004 B. Also seen, not run here: param_dtype bf16
    # alone 126,100 B measured, 126,092 B estimated; reduce_dtype bf16 alone 154,684 B, 154,676 B estimated; with
    # output_dtype fp32 too, on a model whose root ends in the last block (a stem, the three blocks: an fp32
    # block output fed to the head inside the root fails in the real run, "mat1 and mat2 must have the same
    # dtype"), 162,224 B measured, 162,216 B estimated (161,712 / 161,704 B without output_dtype).
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from memcheck.measure.distributed import measure_fsdp_cpu

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    ranks = measure_fsdp_cpu(build, adamw, world_size=2, steps=2, wrap=blocks, in_place=True, mp_policy=policy)
    model, batch = build()
    estimated = memcheck.estimate(model, batch, device="cpu", strategy="fsdp", gpus=2, param_dtype="bf16",
                                  reduce_dtype="fp32").peak_bytes
    for rank, measured in enumerate(r.steady_peak_bytes for r in ranks):
        error = (estimated - measured) / measured
        assert abs(error) <= TOLERANCE, f"rank {rank}: estimated {estimated} B, measured {measured} B ({error:+.2%})"


@pytest.mark.slow
def test_fsdp1_mixed_precision_matches_fsdp1_on_cpu_ranks():
    # FullyShardedDataParallel(mixed_precision=MixedPrecision(param_dtype=bfloat16, reduce_dtype=float32)), a unit
    # per block and the root, full_shard and shard_grad_op in one spawn of 2 gloo ranks, in_place=True. Seen
    # (torch 2.13, this machine, 5 runs): full_shard 133,896 B measured, 133,884 B estimated; shard_grad_op
    # 134,408 B, 134,396 B estimated (before _InPlaceCollectives waited for gloo's worker thread to drop its
    # references, rank 1 read 149,000 or 150,536 B in one run of three: the reduce input freed late). With autograd's bf16 flat gradient freed at its cast (the hook's local keeps it):
    # 131,040 B for both (-2.1%, -2.5%); without the policy 161,956 and 171,300 B (+21%, +27%). Also seen, not
    # run here: param_dtype bf16 alone 131,052 B measured, 131,040 B estimated, both strategies.
    from torch.distributed.fsdp import MixedPrecision as TorchMixedPrecision

    from memcheck.measure.distributed import measure_fsdp1_cpu

    shardings = ("full_shard", "shard_grad_op")
    policy = TorchMixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    measured = measure_fsdp1_cpu(build, adamw, world_size=2, steps=2, shardings=shardings, wrap=blocks,
                                 in_place=True, mixed_precision=policy)
    failures = []
    for sharding in shardings:
        model, batch = build()
        estimated = memcheck.estimate(model, batch, device="cpu", strategy="fsdp1", gpus=2, fsdp_sharding=sharding,
                                      param_dtype="bf16", reduce_dtype="fp32").peak_bytes
        for rank, m in enumerate(measured[sharding]):
            error = (estimated - m.steady_peak_bytes) / m.steady_peak_bytes
            if abs(error) > TOLERANCE:
                failures.append(f"{sharding} rank {rank}: estimated {estimated} B, measured {m.steady_peak_bytes} B "
                                f"({error:+.2%})")
    assert not failures, "\n".join(failures)
