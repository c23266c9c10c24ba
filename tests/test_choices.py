"""Data-dependent choice points (memcheck.choices, issue 23): each answer a real batch can give
is traced and the larger peak reported; ``assume`` pins one.

The oracle for the CPU target is ``measure_cpu``'s allocator peak over a real two-step run,
as in tests/test_accuracy_cpu.py: a tiny Llama with grouped-query attention, run for real
with a padded batch (one padded position) and with an unpadded one (the mask all ones), each
against memcheck's estimate with that answer pinned.
"""

import pytest
import torch
from click.testing import CliRunner

import memcheck
from memcheck.choices import NO_PADDING, PADDING, Choices, parse_assume
from memcheck.cli import main
from memcheck.enums import Attention, Task
from memcheck.errors import UsageError
from memcheck.job import SPELLING, Job
from memcheck.measure.local import measure_cpu
from memcheck.rules.data_dependent import BALANCED_ROUTING_ASSUMPTION, ROUTING_ASSUMPTION
from memcheck.trace.tracer import MemoryTracer
from memcheck.training.loop import default_loss
from memcheck.workloads import hf

TOLERANCE = 0.02  # as tests/test_accuracy_cpu.py


# ---- the setting -----------------------------------------------------------------------------


def test_assume_is_one_job_field_spelled_everywhere():
    s = SPELLING["assume"]
    assert (s.flag, s.config, s.json) == ("--assume", "assume", "assume")
    job = Job(assume="routing=balanced, no-padding")
    assert job.assume == ("no-padding", "routing=balanced")  # in memcheck.choices.POINTS order
    assert job.to_dict()["assume"] == ["no-padding", "routing=balanced"]
    assert Job.from_settings({"assume": ["padding"]}, vocabulary="config").assume == ("padding",)
    assert Job().assume == ()


@pytest.mark.parametrize("value, message", [
    ("no-pading", "assume has no answer 'no-pading' (did you mean 'no-padding'?)"),
    ("padding,no-padding", "assume gives two answers for padding: padding and no-padding"),
    (3, "assume must be a string or a list of answers"),
])
def test_a_bad_assume_names_the_bad_value(value, message):
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)").replace("?", r"\?")):
        Job(assume=value)


def test_a_bad_assume_flag_is_a_usage_error():
    result = CliRunner().invoke(main, ["estimate", "x.py", "--assume", "balanced"])
    assert result.exit_code == 2
    assert "--assume has no answer 'balanced'" in result.output


def test_alternatives_are_the_other_answers_of_the_consulted_unpinned_points():
    choices = Choices(pinned=("routing=balanced",))
    choices.consult("routing")
    assert choices.alternatives() == []  # pinned: never traced otherwise
    choices.consult("padding")
    assert choices.alternatives() == [(NO_PADDING,)]
    both = Choices()
    both.consult("routing")
    both.consult("padding")
    assert both.alternatives() == [("padding", "routing=balanced"), ("no-padding", "routing=worst"),
                                   ("no-padding", "routing=balanced")]
    assert parse_assume(None) == ()


# ---- when a point is consulted ---------------------------------------------------------------


def _fast_all(t):
    return bool(t.sum() == t.numel())  # transformers.masking_utils.fast_all, then bool()


def test_a_check_on_the_attention_mask_consults_padding_and_reads_it_without_padding():
    batch = {"input_ids": torch.empty(2, 8, dtype=torch.long, device="meta"),
             "attention_mask": torch.empty(2, 8, dtype=torch.long, device="meta")}
    tracer = MemoryTracer("cpu")
    with tracer:
        tracer.watch(batch=batch)
        assert _fast_all(batch["attention_mask"].bool()) is False  # the stand-in: padding
        assert _fast_all(batch["input_ids"]) is False
    assert list(tracer.choices.consulted) == [PADDING]
    unpadded = MemoryTracer("cpu", choices=Choices(forced=(NO_PADDING,)))
    with unpadded:
        unpadded.watch(batch=batch)
        assert _fast_all(batch["attention_mask"].bool()) is True  # all ones, read, not assumed
        assert (batch["attention_mask"] == 0).any().item() is False
        assert _fast_all(batch["input_ids"]) is False  # not a mask: the stand-in still
    # A check the mask does not decide (input ids) leaves the point alone.
    other = MemoryTracer("cpu")
    with other:
        other.watch(batch=batch)
        _fast_all(batch["input_ids"])
    assert not other.choices.consulted


# ---- routing ---------------------------------------------------------------------------------


def _route(tokens, experts, k):
    """transformers' eager experts loop (MixtralExperts.forward), as tests/test_moe.py."""
    logits = torch.randn(tokens, experts)
    _, index = torch.topk(logits.softmax(-1), k, dim=-1)
    mask = torch.nn.functional.one_hot(index, num_classes=experts).permute(2, 1, 0)
    hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
    return [(int(e[0]), torch.where(mask[e[0]])[1].shape[0]) for e in hit]


def test_balanced_routing_gives_each_expert_tokens_times_top_k_over_experts():
    # 100 tokens, top-2 of 8 experts: 200 rows; balanced 200 / 8 = 25 each; worst: 100, 100, 0, ...
    # 102 tokens, top-2 of 8: 204 = 8 x 25 + 4, so the first 4 experts looped over take 26.
    worst, balanced = MemoryTracer("cpu"), MemoryTracer("cpu", choices=Choices(("routing=balanced",)))
    with worst, torch.device("meta"):
        assert _route(100, 8, 2) == [(0, 100), (1, 100)] + [(e, 0) for e in range(2, 8)]
    with balanced, torch.device("meta"):
        assert _route(100, 8, 2) == [(e, 25) for e in range(8)]
        assert [n for _, n in _route(102, 8, 2)] == [26] * 4 + [25] * 4
    assert list(worst.choices.consulted) == ["routing"] and ROUTING_ASSUMPTION in worst.log.assumptions
    assert BALANCED_ROUTING_ASSUMPTION in balanced.log.assumptions


def _mixtral_block(balanced: bool):
    """Mixtral's sparse MoE block, eager loop, 4 experts, top-2, 2 x 64 tokens (tests/test_moe.py);
    with ``balanced`` (a real run only) token i is routed to experts i % 4 and (i + 1) % 4, so
    every expert gets 128 x 2 / 4 = 64 tokens."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    config = MixtralConfig(hidden_size=64, intermediate_size=128, num_local_experts=4, num_experts_per_tok=2)
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    block = MixtralSparseMoeBlock(config)
    if balanced:
        router = block.gate.forward

        def routed(hidden):
            logits, scores, index = router(hidden)
            i = torch.arange(index.shape[0])
            return logits, scores, torch.stack([i % 4, (i + 1) % 4], dim=-1)

        block.gate.forward = routed
    return block, torch.randn(2, 64, 64)


@pytest.mark.slow
def test_balanced_routing_matches_a_real_run_routed_evenly():
    loss = lambda block, x: block(x).pow(2).sum()  # noqa: E731
    sgd = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731
    measured = measure_cpu(lambda: _mixtral_block(True), sgd, loss_fn=loss, steps=2).steady_peak_bytes
    with torch.device("meta"):
        block, x = _mixtral_block(False)
    est = memcheck.estimate(block, x, device="cpu", optimizer="sgd", loss_fn=loss, assume="routing=balanced")
    error = (est.peak_bytes - measured) / measured
    assert abs(error) <= TOLERANCE, f"estimated {est.peak_bytes} B, measured {measured} B ({error:+.2%})"
    assert est.branches is None and BALANCED_ROUTING_ASSUMPTION in est.assumptions
    # Unpinned, both splits are traced and the worst (the first experts take every token) is reported.
    both = memcheck.estimate(block, x, device="cpu", optimizer="sgd", loss_fn=loss)
    assert both.branches.taken == ("routing=worst",) and both.peak_bytes > est.peak_bytes
    assert both.branches.traces[1].answers == ("routing=balanced",)
    assert both.branches.traces[1].total_bytes == est.peak_bytes


# ---- padding: a Llama with grouped-query attention under SDPA --------------------------------

LLAMA_GQA = dict(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512)


def _llama(batch_size=4, length=256, padded=True):
    from transformers import LlamaConfig

    config = LlamaConfig(**LLAMA_GQA)
    device = torch.get_default_device()
    model = hf.build_model(config, Task.CAUSAL_LM, device=device, attn=Attention.SDPA)
    batch = hf.make_batch(model, config, Task.CAUSAL_LM, batch_size, length, None, device=device)
    if not padded:
        batch["attention_mask"] = torch.ones_like(batch["attention_mask"])
    return model, batch


def _meta_llama():
    with torch.device("meta"):
        return _llama()


def test_on_cuda_gqa_fp32_sdpa_without_padding_takes_the_math_kernel_and_is_the_larger_peak():
    # transformers skips an all-ones mask (masking_utils._ignore_causal_mask_sdpa), and without a
    # mask passes enable_gqa=True to SDPA (sdpa_attention.use_gqa_in_sdpa). torch's
    # select_sdp_backend (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp) then finds no
    # fused kernel: flash and cuDNN need fp16/bf16 (check_tensor_dtype), and the efficient
    # kernel takes no grouped-query heads (memcheck.rules.cuda_attention, module docstring), so
    # the math kernel runs, materialising (B, H, T, T) fp32 scores. With padding the mask is
    # kept, K and V are repeated to 8 heads (repeat_kv) and the efficient kernel runs.
    model, batch = _meta_llama()
    est = memcheck.estimate(model, batch, device="cuda", gpu="H100-80GB")
    padded = memcheck.estimate(model, batch, device="cuda", gpu="H100-80GB", assume="padding")
    unpadded = memcheck.estimate(model, batch, device="cuda", gpu="H100-80GB", assume="no-padding")
    assert est.branches.taken == (NO_PADDING,)
    assert est.total_bytes == max(padded.total_bytes, unpadded.total_bytes) == unpadded.total_bytes
    taken, other = est.branches.traces
    assert "SDPA on CUDA: math kernel (sm90)" in taken.only_here
    assert "SDPA on CUDA: efficient kernel (sm90)" in other.only_here
    assert other.answers == (PADDING,) and other.total_bytes == padded.total_bytes
    # By hand, a lower bound of the difference: the math kernel saves softmax(QK^T) for
    # backward, (B, H, T, T) fp32 = 4 x 8 x 256 x 256 x 4 B = 8 MiB per layer, 2 layers = 16 MiB,
    # where the padded branch saves a (B, 1, T, T) bool mask (256 KiB) once and the efficient
    # kernel's logsumexp (B, H, T) fp32 (32 KiB) per layer.
    assert unpadded.peak_bytes - padded.peak_bytes >= 16 * 2**20 - 2**18 - 2 * 2**15
    assert est.branches.alternatives == 1 and est.branches.seconds >= 0
    text = " ".join(str(est).split())  # the table wraps its lines at 80 columns
    assert "the larger device total is without padding (attention masks all ones)" in text
    assert "with padding (attention masks not all ones): -" in text
    pinned = str(unpadded)
    assert "data-dependent answers pinned (assume): without padding" in pinned and unpadded.branches is None
    assert est.to_dict()["branches"]["taken"] == ["no-padding"]
    assert unpadded.to_dict()["job"]["assume"] == ["no-padding"]


@pytest.mark.slow
def test_both_padding_branches_match_real_cpu_runs_with_and_without_padding():
    sgd = lambda params: torch.optim.AdamW(params)  # noqa: E731
    real = {}
    for padded, answer in ((True, PADDING), (False, NO_PADDING)):
        def build(padded=padded):
            torch.manual_seed(0)
            return _llama(padded=padded)

        measured = real[answer] = measure_cpu(build, sgd, loss_fn=default_loss, steps=2).steady_peak_bytes
        model, batch = _meta_llama()
        est = memcheck.estimate(model, batch, device="cpu", optimizer="adamw", assume=answer)
        error = (est.peak_bytes - measured) / measured
        assert abs(error) <= TOLERANCE, f"{answer}: estimated {est.peak_bytes} B, measured {measured} B ({error:+.2%})"
    # Unpinned: the larger of the two, and the other reported. On the CPU the unpadded batch's
    # first forward runs the same kernels over a subset of the padded one's allocations, so it
    # is bounded there and not traced further; the real runs agree that it needs less.
    both = memcheck.estimate(model, batch, device="cpu", optimizer="adamw")
    assert both.branches.taken == (PADDING,)
    assert both.branches.traces[1].answers == (NO_PADDING,) and both.branches.traces[1].bounded
    assert real[NO_PADDING] < real[PADDING]


def test_the_plan_decides_the_branch_once_and_pins_it():
    model, _ = _meta_llama()
    from transformers import LlamaConfig

    config = LlamaConfig(**LLAMA_GQA)

    def make(batch_size, length):
        return hf.make_batch(model, config, Task.CAUSAL_LM, batch_size, length, None, device="meta")

    plan = memcheck.plan(model, make, gpu="2GiB", max_len=256, checkpointing_options=("none",),
                         length_profile=False)
    assert plan.job.assume == (NO_PADDING,)  # the worse branch at micro-batch 1, as above
    assert "the worse, no-padding, pinned for the other traces" in plan.branches_note
    text = " ".join(str(plan).split())  # the table wraps its lines at 80 columns
    assert "micro-batch 1" in plan.branches_note and plan.branches_note in text
    assert plan.estimate.branches is None  # the recommendation was traced with the answer pinned
    assert "--assume no-padding" in text  # in the flags that reproduce it
