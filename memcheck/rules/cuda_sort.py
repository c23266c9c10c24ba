"""Sort-based CUDA kernels on the CUDA target: the index arrays and cub temp storage that
``embedding_dense_backward``, ``index_put_`` with ``accumulate=True`` and ``sort`` allocate
and free inside the op, which their meta kernels never show.

Sources. ATen lines are those of a line-numbered copy of a recent ``main`` (the same copy
``docs/cuda_audit.md`` cites; 2.13's numbers may be off by a few lines); ``cub.cuh``,
``cub.h``, ``cub-RadixSortPairs.cuh``, ``Sort.h`` and ``SortingCommon.cuh`` are the headers
installed with torch 2.13.0 (``torch/include/ATen/...``), so their lines are 2.13's own. cub
is NVIDIA/cccl at ``571f2fc3`` (2026-08-22; which CCCL a given torch 2.13 CUDA wheel ships is
not pinned here).

**cub's temp storage** (row 36 of the audit, and inside rows 17 and 24). ATen's
``CUB_WRAPPER`` (cub.cuh:24-30) asks cub for ``temp_storage_bytes`` and allocates that much
from the caching allocator for the call. cub computes the size at run time, so this module
counts a documented lower bound, the part of it that the source fixes:

* ``DeviceRadixSort::SortPairs`` (ATen never passes a ``DoubleBuffer``, so
  ``is_overwrite_okay`` is false): up to one tile (``SingleTilePolicy``, 256 threads x 19
  nominal items per thread for 4-byte types, scaled by ``scale_reg_bound`` to the larger of
  key and value: 2,304 items when either is 8 bytes; tuning_radix_sort.cuh:1099-1107,
  util_arch.cuh:128-138, dispatch_radix_sort.cuh:1103-1112) it runs one block and asks for
  1 byte (line 270). Above that it holds a third key buffer and a third value buffer of
  ``n`` items each (onesweep, dispatch_radix_sort.cuh:570-576, when the sort takes more than
  one 8-bit pass; the older multi-pass path, lines 911-920, always). Counted:
  ``n * (key + value)`` bytes; the per-pass histograms and look-back counters are not.
* ``DeviceSegmentedRadixSort::SortPairs``: the same two buffers, ``n * (key + value)``, for
  any ``n`` (dispatch_segmented_radix_sort.cuh:437-443).
* scans, ``UniqueByKey``: not counted (no size in the source).

**topk** has no rule: see row 36 of the audit.
"""

from __future__ import annotations

import math

import torch

from memcheck.compat import is_non_overlapping_and_dense_or_false
from memcheck.enums import Device
from memcheck.rules.cuda_attention import sm_count
from memcheck.rules.registry import bind, register_op_rule

aten = torch.ops.aten

INDEX_BYTES = 8  # int64 (linearIndex, sorted/original indices, arange, sort's indices)
# cub: SingleTilePolicy<256, 19, DominantT> (tuning_radix_sort.cuh, every arch from sm50 to sm100),
# scaled by RegBoundScaling (util_arch.cuh:128-138) within max_smem_per_block = 48 KiB (line 116).
SINGLE_TILE_THREADS, SINGLE_TILE_ITEMS_4B, MAX_SMEM = 256, 19, 48 * 1024
ONESWEEP_RADIX_BITS = 8  # tuning_radix_sort.cuh ONESWEEP_RADIX_BITS, every policy
# Embedding.cu:256: at most this many indices (and no scale_grad_by_freq) take the direct kernel.
EMBEDDING_DIRECT_MAX = 3072
NROWS_PER_THREAD = 10  # EmbeddingBackwardKernel.cu:36
MAX_ATOMIC_ACCUM_BLOCKS_PER_SM = 4  # EmbeddingBackwardKernel.cu:40
MAX_BLOCK_SIZE = 1024  # SortingCommon.cuh:18 (CUDA; 256 on ROCm)
WARP = 32
SMALL_SORT_MAX = 4096  # Sort.h:10-11 should_use_small_sort
LARGE_SEGMENT = 1_000_000  # SortStable.cu:252-253
FULL_SORT_MAX_SEGMENTS = 128  # SortStable.cu:263


def _on_cuda_meta(ctx, t) -> bool:
    return ctx.device is Device.CUDA and isinstance(t, torch.Tensor) and t.device.type == "meta"


def single_tile_items(key_size: int, value_size: int) -> int:
    """cub's single-tile size: the most items ``SortPairs`` sorts in one block, asking for no temp."""
    dominant = max(key_size, value_size)
    items = max(1, SINGLE_TILE_ITEMS_4B * 4 // max(4, dominant))
    threads = min(SINGLE_TILE_THREADS, math.ceil(MAX_SMEM // (dominant * items) / WARP) * WARP)
    return threads * items


def num_bits(max_key: int) -> int:
    """``cuda::cub::get_num_bits`` (cub.h:14-21): the bits that hold keys up to ``max_key``."""
    return max(1, int(max_key).bit_length())


def radix_sort_pairs_temp(n: int, key_size: int, value_size: int, bits: int | None = None) -> int:
    """Lower bound of the temp storage ``cub::DeviceRadixSort::SortPairs`` asks for to sort ``n``
    pairs on ``bits`` key bits (all of them by default): the third key and value buffers, above one
    tile and when more than one 8-bit pass runs; 0 otherwise (see the module docstring)."""
    if n <= single_tile_items(key_size, value_size):
        return 0
    passes = math.ceil((key_size * 8 if bits is None else bits) / ONESWEEP_RADIX_BITS)
    return n * (key_size + value_size) if passes > 1 else 0


def segmented_sort_pairs_temp(n: int, key_size: int, value_size: int) -> int:
    """Lower bound of ``cub::DeviceSegmentedRadixSort::SortPairs``'s temp storage: the third key
    and value buffers (dispatch_segmented_radix_sort.cuh:437-443)."""
    return n * (key_size + value_size) if n > 0 else 0


def _hold(ctx, *nbytes: int) -> list[torch.Tensor]:
    """Meta buffers of these sizes, counted now and freed when the list is dropped: what a
    kernel keeps across several steps, where ``ctx.scratch`` (alloc, then free at once) would
    free it too early."""
    held = [torch.empty(int(n), dtype=torch.uint8, device="meta") for n in nbytes if n > 0]
    ctx.track(held)
    return held


# --- embedding_dense_backward (audit row 17) ---------------------------------------------------


def _embedding_uses_fused_kernel(ctx, m: int, d: int, max_partial: int) -> bool:
    """EmbeddingBackwardKernel.cu:364-381 ``use_fused_kernel`` (no bags here)."""
    stride_warped = math.ceil(d / WARP) * WARP
    block = min(stride_warped, MAX_BLOCK_SIZE)
    sum_scatter_grid = math.ceil(m * stride_warped / block)
    return (sum_scatter_grid < sm_count(ctx) * MAX_ATOMIC_ACCUM_BLOCKS_PER_SM
            and max_partial > sum_scatter_grid * 4
            and not torch.are_deterministic_algorithms_enabled())


@register_op_rule(aten.embedding_dense_backward.default)
def embedding_dense_backward(ctx, func, args, kwargs):
    """``embedding_dense_backward`` on the CUDA target: ``embedding_dense_backward_cuda``
    (Embedding.cu:242-333) and ``embedding_backward_cuda_kernel`` (EmbeddingBackwardKernel.cu,
    from line 282). With N indices of I bytes, D features, W rows, M = min(N, W) and
    P = N // 10 + M partial segments:

    * ``indices_.contiguous()``, ``grad_.contiguous()`` (Embedding.cu:250, 253): copies if needed;
    * N <= 3072 and no ``scale_grad_by_freq`` (line 256): the direct kernel, nothing more;
    * else ``sorted_indices``, ``orig_indices`` (289-290), while sorting ``range`` (293) and cub's
      temp (295-298, lower bound); ``count`` (302) with ``scale_grad_by_freq``; then the output
      (``grad_weight``, 297 of the kernel file), ``segment_offsets`` (304), ``num_of_segments``
      (8 B, 305), ``unique_by_key``'s key output (N x I, cub.cuh:200 in 2.13),
      ``partials_per_segment`` and its offsets (M x I each, 320, 334), ``num_of_partial_segments``
      (8 B, 341), ``partial_segment_offset`` (P x I, 353); then the two-pass path's
      ``grad_weight_per_segment`` (P x D in the opmath dtype, 447-449), or for few segments the
      fused path's ``partial_to_segment_idx`` (P x I, 394) and, for fp16/bf16, an fp32
      ``grad_weight_acc`` (W x D, 408-410). All freed when the op returns.
    """
    b = bind(func, args, kwargs)
    grad, idx = b["grad_output"], b["indices"]
    if not (_on_cuda_meta(ctx, grad) and isinstance(idx, torch.Tensor)):
        return func(*args, **kwargs)
    n, i_size = idx.numel(), idx.element_size()
    d, e = grad.shape[-1], grad.element_size()
    w, scale = b["num_weights"], b["scale_grad_by_freq"]
    held = _hold(ctx, 0 if idx.is_contiguous() else n * i_size, 0 if grad.is_contiguous() else grad.numel() * e)
    if n <= EMBEDDING_DIRECT_MAX and not scale:
        out = func(*args, **kwargs)
        ctx.track(out)
        return out
    held += _hold(ctx, n * i_size, n * i_size)  # sorted_indices, orig_indices
    ctx.scratch(n * i_size, radix_sort_pairs_temp(n, i_size, i_size))  # range, cub temp
    if scale:
        held += _hold(ctx, n * i_size)  # count
    out = func(*args, **kwargs)  # grad_weight
    ctx.track(out)
    m = min(n, w)
    max_partial = n // NROWS_PER_THREAD + m
    held += _hold(ctx, n * i_size, 8)  # segment_offsets, num_of_segments
    ctx.scratch(n * i_size)  # unique_by_key's keys_out_owner
    held += _hold(ctx, m * i_size, m * i_size, 8, max_partial * i_size)
    if _embedding_uses_fused_kernel(ctx, m, d, max_partial):
        ctx.scratch(max_partial * i_size, w * d * 4 if e < 4 else 0)
    else:
        ctx.scratch(max_partial * d * max(4, e))  # opmath: fp32 for fp16/bf16/fp32, fp64 for fp64
    del held
    return out


# --- index_put_ with accumulate=True (audit row 24) ---------------------------------------------


def takes_sort_kernel(ctx, self, accumulate) -> bool:
    """Whether ``_index_put_impl_`` on a CUDA tensor like ``self`` calls ``index_put_with_sort_stub``:
    with ``accumulate`` or deterministic algorithms (TensorAdvancedIndexing.cpp ``_index_put_impl_``,
    line not pinned)."""
    return _on_cuda_meta(ctx, self) and (bool(accumulate) or torch.are_deterministic_algorithms_enabled())


def index_put_sort_buffers(ctx, self: torch.Tensor, indices, values: torch.Tensor) -> None:
    """Count what ``index_put_with_sort_kernel`` (Indexing.cu:662-861) allocates and frees, for
    integer (or already expanded) ``indices``; call after the op's output is tracked. With N
    broadcast index positions:

    * ``self.contiguous()`` if needed (669), held;
    * ``makeLinearIndex`` (611-637): int32 indices cast to int64 (617-619); per index
      ``remainder`` and ``* stride`` (590, ``wrapIndexOnce`` 558), N x 8 each, of which the
      first product stays as ``linearIndex`` (N x 8), held;
    * ``value.expand(vals_shape).contiguous()`` (677): a copy unless ``values`` already has that
      shape and is contiguous, held;
    * ``src.contiguous()`` when the indexed dims are not adjacent (680-681), held;
    * ``sorted_indices``, ``orig_indices`` (683-684) and ``range`` (690), N x 8 each, held to the
      end, and cub's temp while sorting on ``get_num_bits(largestIndex / sliceSize)`` bits
      (693-697), a lower bound.

    Not counted: the 0-dim ``max``/``min`` of the range check (555-556)."""
    padded = list(indices) + [None] * (self.dim() - len(indices))
    pos = [k for k, i in enumerate(padded) if i is not None]
    if not pos:
        return
    defined = [padded[k] for k in pos]
    n = math.prod(torch.broadcast_shapes(*(i.shape for i in defined)))
    adjacent = pos == list(range(pos[0], pos[-1] + 1))
    sizes = list(self.shape)
    if adjacent:  # makeLinearIndex:630-632 transposes the indexed dims to the front otherwise
        before, after = sizes[:pos[0]], sizes[pos[-1] + 1:]
    else:
        before, after = [], [s for k, s in enumerate(sizes) if k not in pos]
    slice_size = math.prod(after)
    vals_shape = tuple(before) + tuple(torch.broadcast_shapes(*(i.shape for i in defined))) + tuple(after)
    e = self.element_size()
    held = _hold(ctx, 0 if self.is_contiguous() else self.numel() * e)
    casts = [i.numel() * INDEX_BYTES for i in defined if i.dtype == torch.int32]  # before broadcasting
    held += _hold(ctx, n * INDEX_BYTES)  # linearIndex
    ctx.scratch(*casts, n * INDEX_BYTES, n * INDEX_BYTES if len(defined) > 1 else 0)
    value_copy = not (tuple(values.shape) == vals_shape and values.is_contiguous())
    held += _hold(ctx, math.prod(vals_shape) * values.element_size() if value_copy else 0)
    if n > 0 and slice_size > 0:
        held += _hold(ctx, 0 if adjacent else self.numel() * e)  # src_ = src.contiguous()
        held += _hold(ctx, n * INDEX_BYTES, n * INDEX_BYTES, n * INDEX_BYTES)  # sorted, orig, range
        largest = max(self.numel() - 1, 0)  # largestIndex of the contiguous self_
        bits = num_bits(largest // slice_size)
        ctx.scratch(radix_sort_pairs_temp(n, INDEX_BYTES, INDEX_BYTES, bits))
    del held


def index_put_with_sort(ctx, func, args, kwargs):
    """``index_put`` / ``index_put_`` / ``_index_put_impl_`` with integer indices, taking
    ``index_put_with_sort_kernel`` on the CUDA target (``takes_sort_kernel``): the op's output,
    then the kernel's buffers (``index_put_sort_buffers``). ``memcheck.rules.data_dependent``
    owns these ops' registrations (boolean masks) and calls this for the rest."""
    b = bind(func, args, kwargs)
    out = func(*args, **kwargs)
    ctx.track(out)
    index_put_sort_buffers(ctx, b["self"], b["indices"], b["values"])
    return out


# --- sort (audit row 36) -----------------------------------------------------------------------


def _dim_last_strides(x: torch.Tensor, dim: int) -> tuple[int, ...]:
    """Dense strides with ``dim`` innermost and the other dims in order (the layout
    ``infer_dense_strides_dim_last`` gives a contiguous input; for other layouts it orders the
    other dims by stride, which this does not)."""
    return torch.empty(x.shape, device="meta").movedim(dim, -1).contiguous().movedim(-1, dim).stride()


def sort_scratch(x: torch.Tensor, dim: int, values: torch.Tensor, indices: torch.Tensor) -> tuple[list, list]:
    """(held, transient) bytes ``sort_cuda_kernel`` (Sort.cpp:41-126) and ``launch_stable_sort_kernel``
    (SortStable.cu:223-289) allocate beyond the outputs, for a sort of ``x`` along ``dim``."""
    if x.numel() == 0 or x.dim() == 0:
        return [], []
    nsort, k = x.shape[dim], x.element_size()
    if nsort <= SMALL_SORT_MAX:
        return [], [nsort * INDEX_BYTES]  # fillSliceWithIndex's arange (Sort.cpp:32, 81)
    held = []
    copy = not (is_non_overlapping_and_dense_or_false(x) and x.stride(dim) == 1)
    strides = _dim_last_strides(x, dim) if copy else x.stride()
    if copy:
        held.append(x.numel() * k)  # self_ (Sort.cpp:97-100)
    if tuple(values.stride()) != tuple(strides):
        held.append(values.numel() * k)  # values_tmp (104-109)
    if tuple(indices.stride()) != tuple(strides):
        held.append(indices.numel() * INDEX_BYTES)  # indices_tmp (111-116)
    n = x.numel()
    segments = n // nsort
    if segments == 1 or nsort >= LARGE_SEGMENT:  # segmented_sort_large_segments (108-134)
        transient = [nsort * INDEX_BYTES, radix_sort_pairs_temp(nsort, k, INDEX_BYTES)]
    elif segments < FULL_SORT_MAX_SEGMENTS:  # segmented_sort_pairs_by_full_sort (137-185)
        # two int2 arrays (150, 161-162); radix_sort_pairs<scalar_t, int2> with keys_out nullptr
        # allocates the keys (cub-RadixSortPairs.cuh:28-31), then cub's temp; the keys-only sort on
        # the segment bits (171-177) is one pass: no third buffer
        transient = [n * 8, n * 8, n * k, radix_sort_pairs_temp(n, k, 8)]
    else:  # segmented_sort_pairs (188-219): reverse_indices, then cub's segmented sort
        transient = [n * INDEX_BYTES, segmented_sort_pairs_temp(n, k, INDEX_BYTES)]
    return held, transient


def sort(ctx, func, args, kwargs):
    """``sort`` / ``sort.stable`` (``argsort``, ``msort``) on the CUDA target: the outputs, then
    ``sort_scratch``'s buffers. Inputs over INT_MAX elements (sorted in batches,
    SortStable.cu:234-249) are counted as one batch."""
    b = bind(func, args, kwargs)
    x = b["self"]
    if not _on_cuda_meta(ctx, x):
        return func(*args, **kwargs)
    out = func(*args, **kwargs)
    ctx.track(out)
    dim = b["dim"] % x.dim() if x.dim() else 0
    held_bytes, transient = sort_scratch(x, dim, out[0], out[1])
    held = _hold(ctx, *held_bytes)
    ctx.scratch(*transient)
    del held
    return out


for _op in (aten.sort.default, aten.sort.stable):
    register_op_rule(_op, sort)
