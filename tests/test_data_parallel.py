"""DataParallel's per-GPU figures against arithmetic worked out by hand (issue 4).

No GPU can run DataParallel here, so these check the emulation
(memcheck.training.strategies.data_parallel) against what torch/nn/parallel does, byte by
byte, on the CPU target (no allocator rounding).
"""

import pytest
import torch
from torch import nn

import memcheck

VOCAB, DIM, BATCH, TOKENS = 40000, 64, 32, 250


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids):
        return self.head(self.emb(ids))


def lm_loss(model, batch):
    ids, labels = batch
    return nn.functional.cross_entropy(model(ids).flatten(0, 1), labels.flatten())


def _lm():
    with torch.device("meta"):
        ids = torch.zeros(BATCH, TOKENS, dtype=torch.long)
        return TinyLM(), (ids, ids.clone())


LOGITS = BATCH * TOKENS * VOCAB * 4  # 1,280,000,000 B: the 1.2 GB of fp32 logits
PARAMS = (VOCAB * DIM + VOCAB * DIM + VOCAB) * 4  # emb + head weight + head bias = 20,640,000 B
HEAD = (VOCAB * DIM + VOCAB) * 4  # 10,400,000 B


def test_dp_gpu0_holds_the_gathered_logits_and_their_gradients():
    model, batch = _lm()
    est = memcheck.estimate(model, batch, device="cpu", loss_fn=lm_loss, optimizer="sgd", strategy="dp", gpus=2)
    gpu0, gpu1 = est.per_device
    # GPU 0's peak is in backward of the loss, computed on all 32 gathered rows:
    #   log_softmax's output, saved for backward              LOGITS
    #   its gradient (from nll_loss's backward)               LOGITS
    #   the gradient of the gathered logits                   LOGITS
    #   the master parameters                                 PARAMS
    #   the batch (ids and labels, 32 x 250 x 8 B each)       128,000
    #   replica 0's head input, saved: 16 x 250 x 64 x 4 B    1,024,000
    #   the loss's gradient seed                              8
    assert gpu0.peak_bytes == 3 * LOGITS + PARAMS + 128_000 + 1_024_000 + 8
    assert gpu0.breakdown_at_peak.params == PARAMS
    # GPU 1 sees only its half: its slice of the logits' gradient (16 x 250 x 40000 x 4 B),
    # the replica's head (a view of a broadcast 10 MiB chunk; the embedding's chunk is freed,
    # nothing saved it), that head's gradient, its share of the head input gradient, and what
    # its forward saved (the embedding output and its copy of the ids).
    half_logits = LOGITS // 2
    assert gpu1.peak_bytes == half_logits + HEAD + HEAD + 1_024_000 + 1_024_000 + 16 * TOKENS * 8
    assert gpu0.peak_bytes > 5 * gpu1.peak_bytes  # GPU 0 runs out while GPU 1 is mostly empty
    assert est.busiest_gpu == 0 and est.peak_bytes == gpu0.peak_bytes


def test_dp_balanced_keeps_each_half_on_its_own_gpu():
    model, batch = _lm()
    est = memcheck.estimate(model, batch, device="cpu", loss_fn=lm_loss, optimizer="sgd",
                            strategy="dp-balanced", gpus=2)
    gpu0, gpu1 = est.per_device
    # Each GPU computes the loss of its 16 rows: three half-size logit tensors at its peak
    # instead of three full ones on GPU 0.
    half_logits = LOGITS // 2
    assert gpu0.peak_bytes < 3 * LOGITS // 2 + PARAMS + 4 * 1_024_000 + 128_000 + 64
    assert gpu1.peak_bytes >= 3 * half_logits
    assert gpu0.peak_bytes - gpu1.peak_bytes < 0.02 * gpu0.peak_bytes


def test_dp_on_the_cuda_target_gives_every_gpu_its_own_allocator_and_workspaces():
    model, batch = _lm()
    est = memcheck.estimate(model, batch, loss_fn=lm_loss, optimizer="sgd", strategy="dp", gpus=3,
                            gpu="A100-80GB")
    assert [d.index for d in est.per_device] == [0, 1, 2]
    for d in est.per_device:
        assert d.reserved_bytes >= d.peak_bytes
        assert d.device_total_bytes == d.reserved_bytes + d.context_bytes
        assert d.breakdown_at_peak.workspaces > 0  # cuBLAS's per-GPU handles
    assert est.per_device[0].peak_bytes > est.per_device[1].peak_bytes
    d = est.to_dict()["per_device"][1]
    assert set(d) >= {"index", "peak_bytes", "reserved_bytes", "device_total_bytes", "breakdown_at_peak"}


def test_dp_with_a_batch_smaller_than_the_gpus_is_a_clear_error():
    model, _ = _lm()
    with torch.device("meta"):
        ids = torch.zeros(1, TOKENS, dtype=torch.long)
    with pytest.raises(memcheck.UsageError, match="cannot be split over 2 GPUs"):
        memcheck.estimate(model, (ids, ids), device="cpu", loss_fn=lm_loss, strategy="dp", gpus=2)


@pytest.mark.parametrize("kwargs, message", [
    (dict(strategy="dpp"), "unknown strategy 'dpp'"),
    (dict(strategy="single", gpus=4), "strategy 'single' runs on one GPU"),
    (dict(strategy="ddp", gpus=1), "needs at least 2 GPUs"),
    (dict(strategy="zero2", gpus=1), "zero1-3 run on one GPU with an offload"),
    (dict(strategy="dp", offload="optimizer"), "offload='optimizer' applies to fsdp, fsdp1 and zero1-3"),
    (dict(strategy="dp", bucket_view=True), "bucket settings apply to ddp only"),
    (dict(accumulate=0), "accumulate must be a positive integer"),
])
def test_bad_strategy_settings_name_the_value(kwargs, message):
    model, batch = _lm()
    with pytest.raises(memcheck.UsageError, match=message):
        memcheck.estimate(model, batch, device="cpu", loss_fn=lm_loss, **kwargs)


def test_zero_offload_runs_on_one_gpu_and_keeps_the_optimizer_state_off_it():
    """DeepSpeed's ZeRO-Offload on one GPU (issue 19: the plan searches it): zero2 x1 with the
    optimizer offloaded holds no optimizer state on the GPU; on one GPU the gradient partition
    is the whole model, so it holds the weights and gradients as zero2 keeps them."""
    from memcheck.training.strategies.base import StrategyConfig

    config = StrategyConfig.parse("zero2", 1, offload="optimizer")
    assert (config.strategy.value, config.gpus, config.offload.value) == ("zero2", 1, "optimizer")
    model, batch = _lm()
    est = memcheck.estimate(model, batch, device="cpu", loss_fn=lm_loss, strategy="zero2", gpus=1,
                            offload="optimizer")
    assert est.breakdown_at_peak.optimizer == 0
