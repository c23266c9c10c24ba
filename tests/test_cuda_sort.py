"""Sort-based CUDA kernels on the CUDA target (memcheck.rules.cuda_sort), with the bytes worked out
by hand from aten/src/ATen/native/cuda/Embedding.cu, EmbeddingBackwardKernel.cu, Indexing.cu,
Sort.cpp and SortStable.cu, and cub's radix sort (the lower bound the module docstring gives);
the CPU target keeps the meta kernels' outputs only."""

import pytest
import torch

from memcheck.enums import ALLOC, FREE, Device
from memcheck.rules import cuda_sort
from memcheck.trace.tracer import MemoryTracer

aten = torch.ops.aten


def _events(device, fn):
    """``(kind, nbytes)`` of every event of ``fn()`` traced for ``device``."""
    tracer = MemoryTracer(device)
    with tracer:
        fn()
    return [(e[0], e[2]) for e in tracer.log.events]


def _allocs(device, fn):
    return [n for kind, n in _events(device, fn) if kind == ALLOC]


def _meta(*shape, dtype=torch.float32):
    return torch.empty(*shape, dtype=dtype, device="meta")


# --- cub's temp storage -----------------------------------------------------------------------


def test_cub_single_tile_is_2304_pairs_when_a_key_or_value_is_8_bytes():
    # SingleTilePolicy<256, 19>: 19 * 4 // 8 = 9 items per thread, 256 threads -> 2,304 pairs
    assert cuda_sort.single_tile_items(8, 8) == 2_304
    assert cuda_sort.single_tile_items(4, 8) == 2_304
    # 4-byte keys and values: 19 items x 256 threads = 4,864
    assert cuda_sort.single_tile_items(4, 4) == 4_864


def test_cub_radix_sort_temp_is_the_third_key_and_value_buffers_above_one_tile():
    assert cuda_sort.radix_sort_pairs_temp(2_304, 8, 8) == 0  # one tile: cub asks for 1 byte
    assert cuda_sort.radix_sort_pairs_temp(2_305, 8, 8) == 2_305 * 16  # 2,305 x (8 + 8) B = 36,880 B
    # 8 key bits are one onesweep pass: the sort ping-pongs in the caller's buffers only
    assert cuda_sort.radix_sort_pairs_temp(10_000, 8, 8, bits=8) == 0
    assert cuda_sort.radix_sort_pairs_temp(10_000, 8, 8, bits=9) == 160_000  # 10,000 x 16 B


# --- embedding_dense_backward (audit row 17) ---------------------------------------------------

W, D = 1000, 64  # nn.Embedding(1000, 64), fp32: grad_weight 1,000 x 64 x 4 B = 256,000 B
GRAD_WEIGHT = 256_000


def _embedding_backward(n_rows, n_cols, num_weights=W, dtype=torch.float32, scale=False):
    grad = _meta(n_rows, n_cols, D, dtype=dtype)
    idx = _meta(n_rows, n_cols, dtype=torch.long)
    return lambda: aten.embedding_dense_backward(grad, idx, num_weights, -1, scale)


def test_embedding_backward_with_few_indices_takes_the_direct_kernel():
    # 4 x 128 = 512 indices <= 3,072 (Embedding.cu:256): only grad_weight
    assert _allocs(Device.CUDA, _embedding_backward(4, 128)) == [GRAD_WEIGHT]


def test_embedding_backward_with_many_indices_sorts_them_on_cuda():
    # N = 8 x 512 = 4,096 indices > 3,072: the sort path. N x 8 B = 32,768 B per int64 array.
    # M = min(4,096, 1,000) = 1,000 segments at most; P = 4,096 // 10 + 1,000 = 1,409 partial segments.
    # sum_and_scatter's grid: 1,000 x 64 / 64 = 1,000 blocks >= 108 SMs (A100) x 4 = 432: two-pass path.
    assert _allocs(Device.CUDA, _embedding_backward(8, 512)) == [
        32_768, 32_768,  # sorted_indices, orig_indices (Embedding.cu:289-290)
        32_768,  # range = arange(N) (293)
        65_536,  # cub SortPairs temp, lower bound: 4,096 > 2,304 pairs, 4,096 x (8 + 8) B
        GRAD_WEIGHT,  # the output (EmbeddingBackwardKernel.cu:297)
        32_768, 8,  # segment_offsets (N), num_of_segments (one int64) (304-305)
        32_768,  # unique_by_key's key output, N x 8 B (cub.cuh unique_by_key)
        8_000, 8_000,  # partials_per_segment and its offsets: M x 8 B = 1,000 x 8 (320, 334)
        8,  # num_of_partial_segments (341)
        11_272,  # partial_segment_offset: P x 8 B = 1,409 x 8 (353)
        360_704,  # grad_weight_per_segment: P x D x 4 B (fp32 opmath) = 1,409 x 64 x 4 (447-449)
    ]


def test_embedding_backward_frees_everything_but_grad_weight():
    call, kept = _embedding_backward(8, 512), []
    events = _events(Device.CUDA, lambda: kept.append(call()))  # grad_weight kept alive past the trace
    allocated = sum(n for kind, n in events if kind == ALLOC)
    freed = sum(n for kind, n in events if kind == FREE)
    # the 13 buffers above: 5 x 32,768 + 65,536 + 256,000 + 2 x 8 + 2 x 8,000 + 11,272 + 360,704
    # = 873,368 B allocated, of which 256,000 B (grad_weight) are still live
    assert allocated == 873_368
    assert allocated - freed == GRAD_WEIGHT


@pytest.mark.parametrize("dtype,acc", [(torch.float32, []), (torch.bfloat16, [2_560])], ids=["fp32", "bf16"])
def test_embedding_backward_with_few_rows_takes_the_fused_kernel(dtype, acc):
    # nn.Embedding(10, 64), N = 4,096: M = 10, P = 409 + 10 = 419; sum_and_scatter's grid
    # 10 x 64 / 64 = 10 < 432 and P = 419 > 4 x 10: use_fused_kernel (EmbeddingBackwardKernel.cu:375-381)
    allocs = _allocs(Device.CUDA, _embedding_backward(8, 512, num_weights=10, dtype=dtype))
    # partial_to_segment_idx P x 8 B = 3,352 (394); for bf16 also grad_weight_acc 10 x 64 x 4 B = 2,560 (408-410)
    assert allocs[-1 - len(acc):] == [3_352] + acc
    assert 107_264 not in allocs  # no grad_weight_per_segment (419 x 64 x 4 B)


def test_embedding_backward_on_cpu_allocates_only_grad_weight():
    assert _allocs(Device.CPU, _embedding_backward(8, 512)) == [GRAD_WEIGHT]


def test_nn_embedding_backward_on_cuda_copies_the_expanded_grad():
    emb = torch.nn.Embedding(W, D, device="meta")
    idx = _meta(8, 512, dtype=torch.long)
    tracer = MemoryTracer(Device.CUDA)
    with tracer:
        tracer.watch(emb)
        y = emb(idx)
        start = len(tracer.log.events)
        y.sum().backward()
    allocs = [e[2] for e in tracer.log.events[start:] if e[0] == ALLOC]
    # sum (4 B) and its ones_like grad (4 B), which SumBackward expands (stride 0) to (8, 512, 64):
    # grad_.contiguous() copies it, 4,096 x 64 x 4 B = 1,048,576 B (Embedding.cu:253); then the sort path
    assert allocs[:4] == [4, 4, 1_048_576, 32_768]
    assert 360_704 in allocs


# --- index_put_ with accumulate=True (audit row 24) ---------------------------------------------


def _index_put(rows, n, accumulate=True, values=None):
    x = _meta(rows, D)
    i = _meta(n, dtype=torch.long)
    v = _meta(n, D) if values is None else values
    return lambda: aten.index_put(x, [i], v, accumulate)


def test_index_put_accumulate_on_cuda_sorts_the_linear_index():
    # x (1,000, 64) fp32, 4,096 int64 indices into dim 0, values (4,096, 64) contiguous: no value copy.
    # sliceSize 64; largestIndex 63,999 // 64 = 999 -> 10 bits -> two 8-bit passes
    assert _allocs(Device.CUDA, _index_put(1000, 4096)) == [
        256_000,  # the output, index_put's clone: 1,000 x 64 x 4 B
        32_768,  # linearIndex, 4,096 x 8 B (Indexing.cu:590, 633)
        32_768,  # index.remainder(1,000) before * stride (558, 590)
        32_768, 32_768, 32_768,  # sorted_indices, orig_indices, range (683-684, 690)
        65_536,  # cub SortPairs temp, lower bound: 4,096 x (8 + 8) B (694-697)
    ]


def test_index_put_casts_int32_indices_to_int64_first():
    x, i, v = _meta(1000, D), _meta(4096, dtype=torch.int32), _meta(4096, D)
    allocs = _allocs(Device.CUDA, lambda: aten.index_put(x, [i], v, True))
    # as above, with i.to(kLong) (Indexing.cu:617-619), 4,096 x 8 B, held while the linear index is computed
    assert allocs == [256_000, 32_768, 32_768, 32_768, 32_768, 32_768, 32_768, 65_536]


def test_index_put_sorting_on_one_pass_of_bits_needs_no_cub_buffers():
    # x (200, 64): largestIndex 12,799 // 64 = 199 -> 8 bits, one onesweep pass: no third buffers
    assert _allocs(Device.CUDA, _index_put(200, 4096)) == [51_200, 32_768, 32_768, 32_768, 32_768, 32_768]


def test_index_put_with_one_tile_of_indices_needs_no_cub_buffers():
    # 2,000 indices <= 2,304: cub's single-tile kernel; 2,000 x 8 B = 16,000 B per array
    assert _allocs(Device.CUDA, _index_put(1000, 2000)) == [256_000, 16_000, 16_000, 16_000, 16_000, 16_000]


def test_index_put_copies_a_broadcast_value():
    # a (64,) value expands to (4,096, 64): expand().contiguous() copies 4,096 x 64 x 4 B = 1,048,576 B (677)
    allocs = _allocs(Device.CUDA, _index_put(1000, 4096, values=_meta(D)))
    assert allocs == [256_000, 32_768, 32_768, 1_048_576, 32_768, 32_768, 32_768, 65_536]


def test_index_put_without_accumulate_or_on_cpu_allocates_only_the_output():
    assert _allocs(Device.CUDA, _index_put(1000, 4096, accumulate=False)) == [256_000]
    assert _allocs(Device.CPU, _index_put(1000, 4096)) == [256_000]


def test_index_put_accumulate_with_a_mask_sorts_its_nonzero_indices_on_cuda():
    x, mask, v = _meta(1000, D), _meta(1000, dtype=torch.bool), _meta(1000, D)
    allocs = _allocs(Device.CUDA, lambda: aten.index_put(x, [mask], v, True))
    # the output 256,000 B; worst case the mask is all True: nonzero's 1,000 x 8 B = 8,000 B
    # (memcheck.rules.data_dependent); then the sort kernel on those 1,000 indices: linearIndex,
    # remainder, sorted, orig, range, 8,000 B each; 1,000 <= 2,304: no cub buffers
    assert allocs == [256_000, 8_000, 8_000, 8_000, 8_000, 8_000, 8_000]
    assert _allocs(Device.CPU, lambda: aten.index_put(x, [mask], v, True)) == [256_000, 8_000]


def test_backward_of_integer_indexing_reaches_the_sort_rule():
    x = torch.empty(W, D, device="meta", requires_grad=True)
    i = _meta(4096, dtype=torch.long)
    tracer = MemoryTracer(Device.CUDA)
    with tracer:
        y = x[i]
        start = len(tracer.log.events)
        y.sum().backward()
    allocs = [e[2] for e in tracer.log.events[start:] if e[0] == ALLOC]
    # sum and ones (4 B each); new_zeros (256,000 B), filled in place by index_backward's
    # _index_put_impl_ (no clone: that is index_put's, which torch takes only under a dispatch mode,
    # see test_tracer.py); then the kernel: linearIndex, remainder, the expanded grad copied
    # (1,048,576 B), sorted, orig, range, cub temp
    assert allocs == [4, 4, 256_000, 32_768, 32_768, 1_048_576, 32_768, 32_768, 32_768, 65_536]


# --- sort (audit row 36) -----------------------------------------------------------------------


def _sort(*shape, call=torch.sort):
    x = _meta(*shape)  # made outside the trace: only the sort's own allocations are seen
    return lambda: call(x)


def test_sort_of_a_long_row_on_cuda_holds_an_index_array_and_cub_temp():
    # (10,000,) fp32: one segment -> segmented_sort_large_segments (SortStable.cu:108-134)
    assert _allocs(Device.CUDA, _sort(10_000)) == [
        40_000, 80_000,  # values 10,000 x 4 B, indices 10,000 x 8 B
        80_000,  # DeviceArray<int64_t> indices(nsort) (121)
        120_000,  # cub SortPairs<float, int64> temp, lower bound: 10,000 x (4 + 8) B
    ]


def test_sort_of_a_few_long_rows_sorts_them_all_at_once():
    # (4, 10,000) fp32: 4 segments < 128 -> segmented_sort_pairs_by_full_sort (137-185); n = 40,000
    assert _allocs(Device.CUDA, _sort(4, 10_000)) == [
        160_000, 320_000,  # values 40,000 x 4 B, indices 40,000 x 8 B
        320_000, 320_000,  # two int2 arrays, 40,000 x 8 B (150, 161-162)
        160_000,  # radix_sort_pairs' own key output, 40,000 x 4 B (cub-RadixSortPairs.cuh:28-31)
        480_000,  # cub temp, lower bound: 40,000 x (4 + 8) B
    ]


def test_argsort_of_many_rows_uses_cub_segmented_sort():
    # (200, 5,000) fp32, stable: 200 segments >= 128 -> segmented_sort_pairs (188-219); n = 1,000,000
    assert _allocs(Device.CUDA, _sort(200, 5_000, call=lambda x: torch.argsort(x, stable=True))) == [
        4_000_000, 8_000_000,  # values (freed by argsort) and indices
        8_000_000,  # reverse_indices, 1,000,000 x 8 B (198)
        12_000_000,  # cub segmented sort temp: 1,000,000 x (4 + 8) B
    ]


def test_sort_of_short_rows_holds_only_the_index_range():
    # (4, 1,000): 1,000 <= 4,096 -> in-place bitonic sort; fillSliceWithIndex's arange(1,000) x 8 B (Sort.cpp:32)
    assert _allocs(Device.CUDA, _sort(4, 1_000)) == [16_000, 32_000, 8_000]


def test_sort_on_cpu_allocates_only_the_outputs():
    assert _allocs(Device.CPU, _sort(4, 10_000)) == [160_000, 320_000]
