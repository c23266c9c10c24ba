"""The optimizer choices: real CPU runs as the oracle where one can run, hand arithmetic elsewhere.

The CPU oracle is ``memcheck.measure.local.measure_cpu`` (the allocator's own events under
``torch.profiler``), running the *real* optimizer class: ``torch.optim.AdamW(fused=True)``,
``transformers.optimization.Adafactor``. The estimates are traced on meta with the
named choice. bitsandbytes cannot run here, so ``adamw-8bit`` is checked against the
state sizes of bitsandbytes' ``Optimizer2State.init_state``, worked out by hand.
"""

import pytest
import torch
from torch import nn

import memcheck
from memcheck.enums import Device
from memcheck.errors import UsageError
from memcheck.training.optimizers import OPTIMIZERS, _AdamW8bitLayout, resolve_optimizer
from zoo import estimate_zoo, measure_zoo

TOLERANCE = 0.02


def _adafactor_as_named(params):
    from transformers.optimization import Adafactor

    return Adafactor(params, lr=None, scale_parameter=True, relative_step=True, warmup_init=False)


REAL = {
    "adamw-fused": lambda params: torch.optim.AdamW(params, fused=True),
    "adafactor": _adafactor_as_named,
}


def _measure(name, optimizer):
    return measure_zoo(name, optimizer)


def _estimate(name, optimizer, device="cpu"):
    return estimate_zoo(name, optimizer, device=device)


# --------------------------------------------------------------------------------------
# Against real CPU runs.


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["adamw-fused", "adafactor"])
@pytest.mark.parametrize("name", ["mlp", "gpt2"])
def test_cpu_estimate_matches_a_real_run_of_the_optimizer_within_2_percent(name, optimizer):
    measured = _measure(name, REAL[optimizer])
    est = _estimate(name, optimizer)
    error = (est.peak_bytes - measured.steady_peak_bytes) / measured.steady_peak_bytes
    assert abs(error) <= TOLERANCE, (
        f"{name}/{optimizer}: estimated {est.peak_bytes} B, measured {measured.steady_peak_bytes} B ({error:+.2%})"
    )


def test_fused_adamw_step_allocates_nothing_on_a_real_cpu_run_and_in_the_trace():
    # Linear(256, 256): P = (65,536 + 256) * 4 B = 263,168 B per copy.
    # A real fused step on CPU allocates only the 'step' increments' wrapped scalars
    # (_foreach_add_'s slow path: 8 B + 4 B per parameter, one at a time), so the
    # step's peak over the state is 12 B. The traced step must add no temporaries either.
    from torch.profiler import ProfilerActivity, profile

    from memcheck.rules.probe import cpu_memory_events, running_peak

    torch.manual_seed(0)
    model = nn.Linear(256, 256)
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()  # creates the state
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        opt.step()
    deltas = [n for _, n in cpu_memory_events(prof.profiler.kineto_results.events())]
    assert running_peak(deltas) <= 12

    with torch.device("meta"):
        model = nn.Linear(256, 256)
        x = torch.zeros(1, 256)
    est = memcheck.estimate(model, x, device="cpu", optimizer="adamw-fused")
    P = (256 * 256 + 256) * 4
    assert P == 263_168
    # Live in step 2's optimizer step: params P + grads P + exp_avg and exp_avg_sq 2P +
    # two float32 'step' tensors 8 B + the input 1 * 256 * 4 B = 1,024 B: 4P + 1,032 B.
    # Live at the end of backward: the same, with the loss (4 B) and its seed gradient
    # (4 B) not yet freed: 4P + 1,040 B. A fused step adds nothing, so the peak is the
    # backward's; one list-wide temporary (as foreach allocates) would make it 5P.
    assert est.peak_bytes == 4 * P + 1_040
    assert est.peak_phase.value == "backward"


# --------------------------------------------------------------------------------------
# bitsandbytes AdamW8bit, by hand.

# Linear(4096, 64) + Linear(64, 10), by bitsandbytes' Optimizer2State.init_state
# (min_8bit_size=4096, block_wise=True, blocksize 256 since bitsandbytes 0.44):
#   fc1.weight: 4096*64 = 262,144 elements >= 4096 -> 8-bit:
#       state1 + state2: 2 * 262,144 * 1 B (uint8)              = 524,288 B
#       absmax1 + absmax2: 2 * ceil(262,144 / 256) = 2 * 1,024 blocks * 4 B = 8,192 B
#   fc1.bias:   64 elements  < 4096 -> fp32 state1 + state2: 2 * 64 * 4 B  =     512 B
#   fc2.weight: 640 elements < 4096 -> fp32: 2 * 640 * 4 B                 =   5,120 B
#   fc2.bias:   10 elements  < 4096 -> fp32: 2 * 10 * 4 B                  =      80 B
#   qmap1 + qmap2: 256 float32 entries each, one pair per optimizer, shared
#       by every 8-bit parameter (name2qmap): 2 * 256 * 4 B                 =   2,048 B
#   total                                                                    = 540,240 B
# (torch's AdamW would hold 2 * 262,858 params * 4 B = 2,102,864 B.)
BNB_STATE_BYTES = 524_288 + 8_192 + 512 + 5_120 + 80 + 2_048
assert BNB_STATE_BYTES == 540_240


def _two_linears():
    return nn.Sequential(nn.Linear(4096, 64), nn.Linear(64, 10))


def test_adamw_8bit_layout_allocates_the_bitsandbytes_state_sizes():
    with torch.device("meta"):
        model = _two_linears()
    opt = _AdamW8bitLayout(model.parameters())
    for p in model.parameters():
        p.grad = torch.empty_like(p)
    opt.step()
    storages = {}
    for state in opt.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                st = value.untyped_storage()
                storages[st._cdata] = st.nbytes()
    assert sum(storages.values()) == BNB_STATE_BYTES
    fc1_w, fc1_b = model[0].weight, model[0].bias
    assert opt.state[fc1_w]["state1"].dtype == torch.uint8
    assert opt.state[fc1_w]["absmax1"].shape == (1_024,)
    assert opt.state[fc1_b]["state1"].dtype == torch.float32
    assert opt.state[fc1_w]["qmap1"].shape == (256,)
    assert opt.state[fc1_w]["step"] == 1


def test_adamw_8bit_estimate_counts_the_bitsandbytes_state_at_the_peak():
    with torch.device("meta"):
        model = _two_linears()
        x = torch.zeros(4, 4096)
    est = memcheck.estimate(model, x, device="cpu", optimizer="adamw-8bit")
    assert est.breakdown_at_peak.optimizer == BNB_STATE_BYTES
    assert est.optimizer == "adamw-8bit (bitsandbytes layout)"


def test_adamw_8bit_step_updates_parameters_in_place_without_temporaries():
    torch.manual_seed(0)
    model = _two_linears()
    opt = _AdamW8bitLayout(model.parameters(), lr=0.5)
    weight = model[0].weight
    before, ptr = weight.detach().clone(), weight.data_ptr()
    weight.grad = torch.ones_like(weight)
    opt.step()
    assert weight.data_ptr() == ptr
    assert torch.allclose(weight.detach(), before - 0.5)


# --------------------------------------------------------------------------------------
# foreach on the CUDA target, by hand.


def test_adamw_foreach_step_temporaries_on_the_cuda_target():
    # Linear(512, 512) + ReLU + Linear(512, 128), one input row; every tensor is a multiple
    # of 512 B, so the CUDA allocator's rounding changes none of them.
    #   P = (512*512 + 512 + 512*128 + 128) params * 4 B = 328,320 * 4 B = 1,313,280 B.
    # torch/optim/adam.py _multi_tensor_adam (AdamW: decoupled weight decay, not
    # capturable): _foreach_mul_, _foreach_lerp_, _foreach_mul_ and _foreach_addcmul_ work
    # in place; exp_avg_sq_sqrt = _foreach_sqrt(exp_avg_sqs) is a new list of P bytes,
    # then divided and added to in place and consumed by _foreach_addcdiv_(params, ...).
    # So at the step's peak: params P, grads P, exp_avg + exp_avg_sq 2P, and the sqrt
    # list P as the only temporary. The four 'step' counters (one per parameter, 4 B) are
    # host tensors in a real run (not fused, not capturable), but memcheck counts them as
    # optimizer state on the device, each rounded up to the allocator's 512 B block.
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 128))
        x = torch.zeros(1, 512)
    P = (512 * 512 + 512 + 512 * 128 + 128) * 4
    assert P == 1_313_280
    for name in ("adamw-foreach", "adamw"):  # adamw is foreach on CUDA, as torch's default
        est = memcheck.estimate(model, x, device="cuda", optimizer=name)
        b = est.breakdown_at_peak
        assert est.peak_phase.value == "optimizer_step", name
        assert b.temporaries == P, name
        assert b.params == P and b.grads == P, name
        assert 2 * P <= b.optimizer <= 2 * P + 4 * 512, name


def test_adamw_follows_torchs_default_implementation_for_the_target():
    params = [torch.zeros(2, device="meta", requires_grad=True)]
    _, on_cuda = resolve_optimizer("adamw", Device.CUDA)
    _, on_cpu = resolve_optimizer("adamw", Device.CPU)
    assert on_cuda(params).defaults["foreach"] is True
    assert on_cpu(params).defaults["foreach"] is False
    _, fused = resolve_optimizer("adamw-fused", Device.CPU)
    assert fused(params).defaults["fused"] is True and fused(params).defaults["foreach"] is None


def test_a_fused_optimizer_instance_is_traced_with_its_settings():
    # A user's AdamW(fused=True) instance is rebuilt on meta, where torch's own state
    # initialisation would refuse the device; the label is the class name and the implementation.
    template = torch.optim.AdamW([torch.zeros(2, requires_grad=True)], fused=True, lr=3e-4)
    label, factory = resolve_optimizer(template, Device.CPU)
    opt = factory([torch.zeros(2, device="meta", requires_grad=True)])
    assert label == "AdamW (fused)"
    assert isinstance(opt, torch.optim.AdamW) and opt.defaults["fused"] and opt.defaults["lr"] == 3e-4


# --------------------------------------------------------------------------------------
# Names.


def test_every_named_optimizer_traces_a_tiny_model_on_both_targets():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 2))
        x = torch.zeros(2, 8)
    for name in OPTIMIZERS:
        for device in ("cpu", "cuda"):
            est = memcheck.estimate(model, x, device=device, optimizer=name)
            assert est.peak_bytes > 0, (name, device)


def test_adafactor_traces_without_data_dependent_assumptions():
    # Adafactor's lr asks max(eps, RMS) of a tensor; memcheck answers it without .item().
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 2))
        x = torch.zeros(2, 8)
    est = memcheck.estimate(model, x, device="cpu", optimizer="adafactor")
    assert est.assumptions == ()


def test_unknown_optimizer_name_is_a_usage_error_naming_value_closest_and_allowed():
    with pytest.raises(UsageError) as info:
        resolve_optimizer("adamw8bit", Device.CPU)
    message = str(info.value)
    assert "'adamw8bit'" in message
    assert "did you mean 'adamw-8bit'?" in message
    assert ("allowed: adamw, adamw-foreach, adamw-fused, adam, adam-fused, adafactor, adamw-8bit, paged-adamw-8bit, "
            "paged-adamw-32bit, sgd, sgd-momentum") in message
    with torch.device("meta"):
        model = nn.Linear(2, 2)
    with pytest.raises(UsageError, match="unknown optimizer 'lion'"):
        memcheck.estimate(model, torch.zeros(1, 2, device="meta"), device="cpu", optimizer="lion")


def test_adafactor_without_transformers_is_a_usage_error(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "transformers.optimization", None)
    with pytest.raises(UsageError, match="needs transformers"):
        resolve_optimizer("adafactor", Device.CPU)
    resolve_optimizer("adamw", Device.CPU)  # the others never import it


@pytest.mark.parametrize("name, device, label", [
    ("adamw", Device.CUDA, "adamw (foreach)"),  # torch's default picks foreach for CUDA tensors
    ("adamw", Device.CPU, "adamw (for-loop)"),
    ("adamw-fused", Device.CUDA, "adamw-fused"),
    ("sgd", Device.CUDA, "sgd (foreach)"),
    ("adafactor", Device.CUDA, "adafactor"),  # transformers' Adafactor has no foreach/fused switch
])
def test_the_label_names_the_implementation_traced(name, device, label):
    assert resolve_optimizer(name, device)[0] == label


def test_hf_models_default_to_the_installed_trainers_optimizer():
    # transformers' TrainingArguments.default_optim is adamw_torch_fused with torch >= 2.8 (2.13 here)
    from memcheck.workloads.hf import trainer_optimizer

    assert trainer_optimizer() == "adamw-fused"
