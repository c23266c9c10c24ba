"""measure_ddp_cpu on a real two-rank gloo run, checked against hand arithmetic.

The oracle is the allocator of each spawned rank; the expectation is worked out
by hand from what DDP's Reducer allocates (torch/nn/parallel/distributed.py,
torch/csrc/distributed/c10d/reducer.cpp), never from memcheck's estimator.
"""

import pytest
import torch
from torch import nn

from memcheck.errors import UsageError
from memcheck.measure.local import measure_cpu
from memcheck.measure.distributed import measure_ddp_cpu

# The spawned ranks unpickle these by reference, so they live at module level.


def build_mlp():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 10))
    return model, (torch.randn(256, 512), torch.randint(0, 10, (256,)))


def classify(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def adamw(params):
    return torch.optim.AdamW(params)


@pytest.mark.slow
def test_each_ddp_rank_peaks_one_gradient_bucket_above_a_single_process():
    # By hand: P = (512*2048 + 2048 + 2048*2048 + 2048 + 2048*10 + 10) params * 4 B
    #            = 5,267,466 * 4 B = 21,069,864 B, under bucket_cap_mb=25 (26,214,400 B),
    # so the Reducer holds one flat float32 bucket of exactly P bytes, built at
    # construction and rebuilt (old one freed first) at step 2's forward.
    # Without gradient_as_bucket_view the bucket lives beside the .grad tensors:
    # each grad is copied into its bucket view (at::mul_out by 1/world_size, no
    # temporary), gloo allreduces the bucket in place, and the result is copied
    # back into .grad. So at every moment of step 2 a rank holds what the
    # single-process run holds plus P; the peak (in AdamW's step) too.
    # gloo's ring scratch (<= 2 x 1 MiB) is malloc'd and invisible to both.
    bucket = 5_267_466 * 4
    single = measure_cpu(build_mlp, adamw, loss_fn=classify, steps=2)
    ranks = measure_ddp_cpu(build_mlp, adamw, loss_fn=classify, world_size=2, steps=2)
    assert len(ranks) == 2
    for rank, measured in enumerate(ranks):
        extra = measured.steady_peak_bytes - single.steady_peak_bytes
        # The slack is for the Reducer's 8 B wrapped 1/world_size scalars.
        assert bucket <= extra <= bucket + 64 * 1024, f"rank {rank}: {extra} B above one process, bucket {bucket} B"


def test_measure_ddp_cpu_rejects_a_lambda_it_cannot_send_to_a_rank():
    with pytest.raises(UsageError, match="module-level function"):
        measure_ddp_cpu(lambda: build_mlp(), adamw, loss_fn=classify)
