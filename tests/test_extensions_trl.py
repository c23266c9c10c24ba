"""memcheck.rules.extensions.trl: TRL's fused LM head traced as it runs on each target.

TRL's ``ChunkedLogProbFunction`` (trl 1.16, trl/kernels/chunked_logprob.py) is run forward
and backward on meta tensors, its allocations recorded by a dispatch mode of the test's
own (not memcheck's tracer). The sizes below are TRL's source, by hand.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("trl")

from trl.kernels.chunked_logprob import TOKEN_CHUNK_SIZE, ChunkedLogProbFunction  # noqa: E402

from memcheck.rules.autocast import meta_autocast_queries  # noqa: E402
from memcheck.rules.extensions import trl as trl_extension  # noqa: E402

N, H, V = 8, 16, 100  # tokens, hidden size, vocabulary
CHUNK = 32768  # utils.py _CHUNKED_LOGPROB_CHUNK_SIZE: the tile's width, whatever the vocabulary


class _Allocations(TorchDispatchMode):
    """(shape, dtype) of every new tensor an op returns (views and in-place ops make none)."""

    def __init__(self):
        super().__init__()
        self.made: list[tuple[tuple, torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func._schema.is_mutable and not any(a.alias_info for a in func._schema.returns):
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor):
                    self.made.append((tuple(t.shape), t.dtype))
        return out


class _Tracer:
    """What the extension and the autocast queries read of memcheck's tracer: no autocast region."""

    autocast = None

    def __init__(self):
        self.assumed: list[str] = []

    def assume(self, text: str) -> None:
        self.assumed.append(text)


def _run(device: str):
    hidden = torch.empty(N, H, device="meta", dtype=torch.bfloat16, requires_grad=True)
    weight = torch.empty(V, H, device="meta", dtype=torch.bfloat16, requires_grad=True)
    targets = torch.empty(N, device="meta", dtype=torch.long)
    tracer, seen = _Tracer(), _Allocations()
    with meta_autocast_queries(tracer, device), trl_extension.tracing(tracer, device), seen:
        logprobs, entropy, *_ = ChunkedLogProbFunction.apply(hidden, weight, None, targets, 1.0, CHUNK, None, 1.0,
                                                             ("log_probs", "entropy", "is_top1"))
        (logprobs.sum() + entropy.sum()).backward()
    return seen.made, tracer.assumed


def test_on_cuda_the_folds_and_the_fp32_accumulation_make_no_tile_sized_tensor():
    made, assumed = _run("cuda")
    # the tile buffer, one in the forward and one in the backward (lines 347, 413):
    # min(8, 4096) x 32768 bf16 = 524,288 B each; nothing else as large as a tile (8 x 100)
    assert made.count(((min(N, TOKEN_CHUNK_SIZE), CHUNK), torch.bfloat16)) == 2
    assert not [m for m in made if m[0] in ((N, V), (V, N))], made
    assert any("Triton kernels, which allocate nothing" in a for a in assumed)


def test_on_the_cpu_the_torch_fallback_runs_with_its_temporaries():
    made, assumed = _run("cpu")
    # _forward_tile's z = tile.float() ... and _addmm_fp32's tile.float(): 8 x 100 fp32 tensors
    assert sum(1 for shape, dtype in made if shape == (N, V) and dtype == torch.float32) >= 3
    assert not assumed


def test_the_module_is_left_as_it_was():
    import trl.kernels.chunked_logprob as module

    before = (module._forward_tile, module._backward_tile, module._addmm_fp32)
    _run("cuda")
    assert (module._forward_tile, module._backward_tile, module._addmm_fp32) == before
