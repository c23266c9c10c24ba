"""ddp estimates against real two-rank gloo runs on CPU, per rank (issue 4).

The oracle is each spawned rank's own allocator (memcheck.measure.distributed);
the estimate traces one rank on meta with DDP's buckets emulated
(memcheck.training.strategies.ddp). Target: within 2%, as for the single-process zoo.
"""

import pytest
import torch

import memcheck
from memcheck.measure.distributed import measure_ddp_cpu
from test_measure_distributed import adamw, build_mlp, classify


@pytest.mark.slow
@pytest.mark.parametrize("bucket_view", [False, True])
def test_ddp_estimate_matches_each_measured_rank(bucket_view):
    ranks = measure_ddp_cpu(build_mlp, adamw, loss_fn=classify, world_size=2, steps=2,
                            gradient_as_bucket_view=bucket_view)
    with torch.device("meta"):
        model, batch = build_mlp()
    est = memcheck.estimate(model, batch, device="cpu", loss_fn=classify, strategy="ddp", gpus=2,
                            bucket_view=bucket_view)
    assert [d.index for d in est.per_device] == [0, 1]
    for measured, device in zip(ranks, est.per_device):
        error = (device.peak_bytes - measured.steady_peak_bytes) / measured.steady_peak_bytes
        assert abs(error) <= 0.02, (
            f"rank {device.index}: estimated {device.peak_bytes} B, measured {measured.steady_peak_bytes} B "
            f"({error:+.2%})"
        )


def test_ddp_buckets_by_hand():
    # P = 5,267,466 parameters x 4 B = 21,069,864 B (see test_measure_distributed). Without
    # gradient_as_bucket_view the buckets are a second copy of the gradients: at the peak
    # (AdamW's step, gradients held) the rank holds P more than one process; with the
    # bucket view the buckets are the gradients and it holds nothing more.
    with torch.device("meta"):
        model, batch = build_mlp()
    single = memcheck.estimate(model, batch, device="cpu", loss_fn=classify)
    ddp = memcheck.estimate(model, batch, device="cpu", loss_fn=classify, strategy="ddp", gpus=4)
    view = memcheck.estimate(model, batch, device="cpu", loss_fn=classify, strategy="ddp", gpus=4,
                             bucket_view=True)
    assert ddp.peak_bytes - single.peak_bytes == 21_069_864
    assert ddp.breakdown_at_peak.communication == 21_069_864
    assert view.peak_bytes == single.peak_bytes
    assert len(ddp.per_device) == 4 and len({d.peak_bytes for d in ddp.per_device}) == 1
