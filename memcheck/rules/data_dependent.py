"""Stand-ins for data-dependent ops: ops whose output's size, or the Python value they
return, depends on tensor values that meta tensors do not have.

Two kinds of answer, and every rule says which it gives in the report (``ctx.assume``):

* **Worst case**, where the output has a largest size: boolean-mask indexing and
  ``masked_select`` select every element, ``unique`` finds every element distinct,
  ``nonzero`` finds every element non-zero. The trace is then an upper bound for the op.
* **A documented synthetic value**, where there is no bound or the op yields a Python
  value: ``.item()``, ``.tolist()`` and ``.numpy()`` read 1 (``True`` for bool, and the
  checks of ``any``/``all``/``==``/``!=`` below), ``bincount``'s largest value gives it
  as many bins as it has inputs, and each of ``repeat_interleave``'s repeats is 1.
* **A known total**, for the routing masks of mixture-of-experts layers: a one-hot mask
  holds one 1 per index it was made from, ``tokens * top_k`` in all, so ``nonzero`` over
  its slices (one per expert) selects that many elements in all, not every element of
  every slice (see "Routing masks" below).

A check on a tensor whose values the trace itself made known (``torch.ones`` and what
follows from it: ``memcheck.rules.known_values``) reads the true value instead, and lists
no assumption: the all-ones mask a decoder builds when given none is all ones.

On the CPU target the rules also emit what the CPU kernels allocate inside the op
(``ctx.scratch``). Those sizes were measured with the profiler's allocator events
(torch 2.13; 64 to 100,000 elements; bool, 8-, 16-, 32- and 64-bit dtypes; 1 and 2
threads; worst-case data: all-True masks, all-distinct values); each rule gives its
figure. On CUDA only the outputs (and the index tensors that ATen's shared indexing
code allocates) are traced; the CUDA kernels' own temporaries are not modelled, except
``index_put_with_sort_kernel``'s (``index_put`` with ``accumulate=True``), which
``memcheck.rules.cuda_sort`` counts.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from memcheck import compat
from memcheck.choices import PADDING, ROUTING, ROUTING_BALANCED
from memcheck.enums import Device
from memcheck.rules import cuda_sort
from memcheck.rules.registry import bind, register_op_rule
from memcheck.rules.tags import StorageTags
from memcheck.units import nbytes

aten = torch.ops.aten

INDEX_BYTES = 8  # the int64 of nonzero's indices, unique's inverse and counts, repeat_interleave's output
GRAIN_SIZE = 32768  # at::internal::GRAIN_SIZE (aten/src/ATen/Parallel.h): masked_select's serial cut-off


def _is_meta(t) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == "meta"


def _index(n: int) -> torch.Tensor:
    return torch.empty(n, dtype=torch.long, device="meta")


# --------------------------------------------------------------------------------------
# Data-dependent scalars. On meta a tensor has no values, so ``bool(t)``, ``t.item()`` and
# ``if (mask == 0).any()`` need a stand-in. memcheck assumes the worst-case batch *contains
# padding*, i.e. its values are not uniform: ``all`` and ``==`` on a scalar are False,
# ``any`` and ``!=`` are True. transformers checks ``mask.sum() == mask.numel()``
# (masking_utils.fast_all) before it materialises an attention mask; the answer False
# takes the branch that allocates the mask, the costlier one. Tensors the trace made
# itself (``ctx.known``, memcheck.rules.known_values) answer with their true value.

_REDUCTION_TAG = "_memcheck_reduction"
_KNOWN_TAG = "_memcheck_known"  # the answer of ``==``/``!=`` on an index whose value memcheck chose
_NON_NEGATIVE = "_memcheck_non_negative"  # ``ids >= 0``: ``all`` of it reads True ("Validity checks")


def _tag_reduction(kind):
    def rule(ctx, func, args, kwargs):
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor) and out.device.type == "meta":
            tag = kind
            if kind == "all" and args and getattr(args[0], _NON_NEGATIVE, False):
                tag = "valid"  # all(ids >= 0): the batch's ids are valid (see "Validity checks")
                ctx.assume("token ids assumed non-negative: all(ids >= 0) read True")
            setattr(out, _REDUCTION_TAG, tag)
            known = _compared_position(tag, args)
            if known is not None:
                setattr(out, _KNOWN_TAG, known)
        return out

    return rule


def _compared_position(kind, args) -> bool | None:
    """``i == n`` / ``i != n`` where ``i`` is one index read from a ``nonzero`` output of
    this module (``position``): the answer for the position memcheck gives ``i``, so that
    ``if expert_idx == num_experts: continue`` skips the same experts ``.item()`` reads."""
    if kind not in ("==", "!=") or len(args) < 2 or not isinstance(args[1], int) or not _is_meta(args[0]):
        return None
    at = position(args[0]) if args[0].numel() == 1 else None
    if at is None:
        return None
    return (at == args[1]) == (kind == "==")


register_op_rule(aten.all, _tag_reduction("all"))
register_op_rule(aten.any, _tag_reduction("any"))
register_op_rule(aten.eq, _tag_reduction("=="))
register_op_rule(aten.ne, _tag_reduction("!="))

# Range checks on a whole tensor's largest or smallest value, ``labels.max() >= vocab_size`` or
# ``ids.min() < 0`` (transformers' CTC heads raise "Label values must be <= vocab_size" on True):
# the batch's values are in range, so the check is False. ``max``/``min`` here are the full
# reductions (``aten.max.default``), which return one value.
register_op_rule(aten.max.default, _tag_reduction("max"))
register_op_rule(aten.min.default, _tag_reduction("min"))


def _range_check(ctx, func, args, kwargs):
    out = func(*args, **kwargs)
    if isinstance(out, torch.Tensor) and out.device.type == "meta" and any(
            getattr(a, _REDUCTION_TAG, None) in ("max", "min") for a in args[:2]):
        setattr(out, _REDUCTION_TAG, "range")
    bound = args[1] if len(args) > 1 else kwargs.get("other")
    if _is_meta(out) and isinstance(bound, (int, float)) and not isinstance(bound, bool) and (
            (func._overloadpacket is aten.ge and bound == 0) or (func._overloadpacket is aten.gt and bound == -1)):
        setattr(out, _NON_NEGATIVE, True)  # ids >= 0: a validity check (below)
    return out


for _compare in (aten.ge, aten.gt, aten.le, aten.lt):
    register_op_rule(_compare, _range_check)

# Validity checks: models assert that token ids are not negative (ProphetNet's
# ``torch.all(shifted_input_ids >= 0)``). A batch a job can train on passes, so ``all`` of
# ``ids >= 0`` (or ``ids > -1``) reads True, listed as an assumption. NaN/Inf checks
# (``isnan``, ``isinf``) keep the plain stand-in: the HF Trainer's ``logging_nan_inf_filter``
# reads the loss with them, and under ``memcheck run`` its "finite" branch adds the traced
# loss to a real CPU tensor.
_FALSE_WHEN = ("all", "==", "range")


def synthetic_value(t: torch.Tensor, ctx=None):
    """The value memcheck reads from an element of meta tensor ``t``: its known value where
    the trace made it (``ctx.known``), else 1 (1.0, 1+0j), and for bool the answer of the
    check that made ``t`` (see above), True by default."""
    known = ctx.known.value(t) if ctx is not None else None
    if known is not None:
        return known
    if t.dtype == torch.bool:
        known = getattr(t, _KNOWN_TAG, None)
        return known if known is not None else getattr(t, _REDUCTION_TAG, None) not in _FALSE_WHEN
    if t.is_complex():
        return 1 + 0j
    return 1.0 if t.is_floating_point() else 1


@register_op_rule(aten._local_scalar_dense.default)
def local_scalar_dense(ctx, func, args, kwargs):
    """``Tensor.item()`` on a meta tensor: a documented synthetic value (``synthetic_value``)."""
    t = args[0]
    if t.device.type != "meta":
        return func(*args, **kwargs)
    known = ctx.known.value(t)
    if known is not None:
        return known  # made by the trace (torch.ones(...).all()): no stand-in needed
    kind = getattr(t, _REDUCTION_TAG, None)
    if t.dtype == torch.bool and getattr(t, _KNOWN_TAG, None) is not None:
        return getattr(t, _KNOWN_TAG)  # follows from an index memcheck chose (position), already listed
    if t.dtype == torch.bool and kind == "valid":
        return True  # all(ids >= 0), listed where it was taken ("Validity checks")
    if t.dtype == torch.bool:
        value = kind not in _FALSE_WHEN
        _padding_decides(ctx, t, value)
        ctx.assume(
            f"data-dependent check ({kind or 'bool'}) resolved to {value}: the batch is assumed to contain padding"
        )
        return value
    if t.is_floating_point():
        ctx.assume("a data-dependent float (.item()) was taken as 1.0")
        return 1.0
    at = position(t)
    if at is not None:
        ctx.assume("an index read from nonzero() (.item()) was taken as the position of the element it "
                   "selects, every element being selected")
        return at
    ctx.assume("a data-dependent integer (.item()) was taken as 1")
    return 1


def _padding_decides(ctx, t: torch.Tensor, answer: bool) -> None:
    """Mark the ``padding`` choice point consulted (``memcheck.choices``) when an unpadded
    batch, whose attention masks are all ones, would answer this check otherwise: the
    step is then traced again with the answer ``no-padding``."""
    unpadded = getattr(ctx, "if_unpadded", None)
    other = unpadded.value(t) if unpadded is not None else None
    if other is not None and bool(other) != answer:
        ctx.choices.consult(PADDING, (ctx.step, ctx.phase))


def _unequal(what: str):
    def rule(ctx, func, args, kwargs):
        """``torch.equal`` / ``torch.allclose`` on meta tensors: False, as ``==`` on a scalar
        (the batch is assumed to contain padding, so two tensors are not the same); the
        true answer where the trace made both tensors' values known."""
        if not any(_is_meta(a) for a in args[:2]):
            return func(*args, **kwargs)
        a, b = (ctx.known.value(x) if _is_meta(x) else None for x in args[:2])
        if a is not None and b is not None:  # both made by the trace: compare one element of each
            with compat.DisableTorchFunction():
                real = [torch.tensor(v, dtype=x.dtype).expand(x.shape) for x, v in zip(args[:2], (a, b))]
                return func(*real, *args[2:], **kwargs)
        ctx.assume(f"{what} resolved to False: the batch is assumed to contain padding")
        return False

    return rule


register_op_rule(aten.equal.default, _unequal("torch.equal"))
register_op_rule(aten.allclose.default, _unequal("torch.allclose"))


# --------------------------------------------------------------------------------------
# Reading a meta tensor's data from Python. These are Tensor methods, so they are
# FUNCTION_RULES: the tracer's TorchFunctionMode sees them before they fail.

_NUMPY_DTYPES = {
    torch.bool: np.bool_, torch.uint8: np.uint8, torch.int8: np.int8, torch.int16: np.int16,
    torch.int32: np.int32, torch.int64: np.int64, torch.float16: np.float16, torch.float32: np.float32,
    torch.float64: np.float64, torch.complex64: np.complex64, torch.complex128: np.complex128,
}  # what Tensor.numpy() supports (torch/csrc/utils/tensor_numpy.cpp aten_to_numpy_dtype)


def _numpy_dtype(dtype: torch.dtype):
    if dtype in _NUMPY_DTYPES:
        return _NUMPY_DTYPES[dtype]
    # Other dtypes: ask torch with an empty CPU tensor; it raises as a real .numpy() does (bfloat16).
    return torch.empty(0, dtype=dtype).numpy().dtype


def _nested(shape, value):
    if not shape:
        return value
    return [_nested(shape[1:], value) for _ in range(shape[0])]


@register_op_rule(torch.Tensor.tolist)
def tolist(ctx, func, args, kwargs):
    """``Tensor.tolist()`` on a meta tensor: nested lists (a scalar for a 0-d tensor) holding
    the synthetic value ``.item()`` reads (``synthetic_value``). The lists are Python
    objects, not tensor memory: nothing is counted."""
    t = args[0]
    if not _is_meta(t):
        return func(*args, **kwargs)
    value = synthetic_value(t, ctx)
    if ctx.known.value(t) is None:
        ctx.assume(f"Tensor.tolist() of a meta tensor read every element as {value!r}")
    return _nested(tuple(t.shape), value)


def _ones_array(ctx, t: torch.Tensor, dtype):
    """A read-only array of ``t``'s shape whose every element is the synthetic value, backed
    by one element (zero strides, ``np.broadcast_to``): no host memory for the data."""
    return np.broadcast_to(np.asarray(synthetic_value(t, ctx), dtype=dtype), tuple(t.shape))


def _assume_read(ctx, t: torch.Tensor) -> None:
    if ctx.known.value(t) is None:
        ctx.assume(f"Tensor.numpy() of a meta tensor read every element as {synthetic_value(t)!r} (a read-only array)")


@register_op_rule(torch.Tensor.numpy)
def numpy(ctx, func, args, kwargs):
    """``Tensor.numpy()`` on a meta tensor: a read-only, zero-stride array of the synthetic
    value (``synthetic_value``) in the dtype a real ``.numpy()`` gives. A real CPU
    ``.numpy()`` shares the tensor's memory, so nothing is counted."""
    t = args[0]
    if not _is_meta(t):
        return func(*args, **kwargs)
    out = _ones_array(ctx, t, _numpy_dtype(t.dtype))
    _assume_read(ctx, t)
    return out


@register_op_rule(torch.Tensor.__array__)
def array(ctx, func, args, kwargs):
    """``np.asarray(t)`` (``Tensor.__array__``) on a meta tensor: as ``Tensor.numpy()``, in
    the dtype asked for, still backed by one element."""
    t = args[0]
    if not _is_meta(t):
        return func(*args, **kwargs)
    dtype = args[1] if len(args) > 1 else kwargs.get("dtype")
    out = _ones_array(ctx, t, dtype if dtype is not None else _numpy_dtype(t.dtype))
    _assume_read(ctx, t)
    return out


@register_op_rule(torch.Tensor.__format__)
def format_scalar(ctx, func, args, kwargs):
    """``f"{loss:.3f}"`` on a 0-d meta tensor: formats ``.item()``'s synthetic value (torch
    formats a real 0-d tensor through ``.item()``)."""
    t = args[0]
    if _is_meta(t) and t.dim() == 0:
        spec = args[1] if len(args) > 1 else kwargs.get("format_spec", "")
        return format(t.item(), spec)  # .item() reaches local_scalar_dense, which lists the assumption
    return func(*args, **kwargs)


# --------------------------------------------------------------------------------------
# Routing masks. A mixture-of-experts layer that loops over its experts (transformers'
# "eager" experts implementation, Switch Transformers) builds a one-hot mask of the top-k
# expert indices, ``one_hot(top_k_index, num_experts)``, and takes each expert's tokens
# with ``torch.where(mask[expert])``, i.e. ``nonzero``. The worst case of ``nonzero`` alone,
# every element of every slice, would send every token to every expert: E * tokens rows
# instead of tokens * top_k. But a one-hot mask holds exactly one 1 per index it was made
# from, so memcheck gives each mask a budget of ``numel(indices)`` ones, shared by the
# tensors made from it (views, ``mask[expert]``, ``mask * capacity_mask``), and each
# ``nonzero`` over them takes as many as its slice holds while the budget lasts.
#
# The split across experts is what the trace cannot know. memcheck assumes every expert
# hit (``nonzero``'s worst case on the "hit" mask, whose indices ``position`` reads back as
# 0, 1, 2, ...) and takes the budget in the order the experts are looped over: the first
# experts get every token (at most once each when the indices are ``topk``'s), the rest
# none. The rows saved for backward add up to tokens * top_k whatever the split; with
# every expert's weight gradient alive and the largest per-expert buffers, this was the
# costliest split measured (a real Mixtral block routed so, 127 tokens on two experts and
# one on the others, is within 0.3% of the trace; a random router's split, or one that
# hits only top_k experts, needs up to 20% less there). The split is a choice point
# (``memcheck.choices``, ``routing``): the step is traced again with a balanced split,
# ``tokens * top_k / experts`` rows each, and the larger peak reported, unless the job pins
# one (``assume="routing=balanced"``).

class _Ones:
    """The ones left to select in a one-hot mask and the tensors made from it, and the most
    one ``nonzero`` can take: the number of tokens when the indices are ``topk``'s (each
    token picks an expert at most once), else every one. ``total`` and ``experts`` (the
    mask's classes) give the balanced split; ``calls`` counts the ``nonzero`` calls so far."""

    __slots__ = ("left", "per_call", "total", "experts", "calls")

    def __init__(self, left: int, per_call: int, experts: int):
        self.left, self.per_call, self.total, self.experts, self.calls = left, per_call, left, max(experts, 1), 0

    def balanced_share(self) -> int:
        """The next expert's share of an even split: ``total // experts``, one more for the
        first ``total % experts`` experts looped over."""
        base, extra = divmod(self.total, self.experts)
        return base + (1 if self.calls < extra else 0)


_ONE_HOT = StorageTags()  # a one-hot mask and the tensors made from it -> their _Ones
_TOP_K = StorageTags()  # topk's indices -> (k, how many candidates each row chose among)
ROUTING_ASSUMPTION = (
    "MoE routing: every expert hit, tokens x top_k rows in all, the first experts looped over taking "
    "every token (the costliest split; a real router's split needs less)"
)
BALANCED_ROUTING_ASSUMPTION = (
    "MoE routing: balanced, tokens x top_k rows in all, tokens x top_k / experts to each expert "
    "(routing=balanced)"
)


def _ones_of(t) -> _Ones | None:
    return _ONE_HOT.get(t)


def _mark(out, ones: _Ones) -> None:
    _ONE_HOT.put(out, ones)


@register_op_rule(aten.topk.default)
def topk(ctx, func, args, kwargs):
    """``topk``: as torch runs it; its indices are remembered as ``k`` distinct picks per row."""
    out = func(*args, **kwargs)
    b = bind(func, args, kwargs)
    if _is_meta(out[1]) and b["k"] > 0:
        t = b["self"]
        _TOP_K.put(out[1], (int(b["k"]), t.shape[b["dim"]] if t.dim() else 1))
    return out


@register_op_rule(torch.nn.functional.one_hot)
def one_hot(ctx, func, args, kwargs):
    """``F.one_hot``: as torch runs it, and its output holds ``numel(indices)`` ones (above)."""
    out = func(*args, **kwargs)
    indices = args[0] if args else kwargs.get("tensor", kwargs.get("input"))
    if _is_meta(indices):
        k, candidates = _TOP_K.get(indices) or (None, None)
        n = indices.numel()
        # the experts are topk's candidates (a mask may have more classes: transformers' eager
        # loop adds one it skips), else the mask's classes
        _mark(out, _Ones(n, n // k if k else n, candidates or (out.shape[-1] if out.dim() else 1)))
    return out


def _keep_ones(ctx, func, args, kwargs):
    """An op that makes a new tensor from a one-hot mask with at most its ones: ``mask[i]``
    (the expert's slice), ``mask * keep`` (Switch Transformers' capacity mask), a copy to
    another dtype. The output shares the mask's budget."""
    out = func(*args, **kwargs)
    for a in args:
        ones = _ones_of(a) if isinstance(a, torch.Tensor) else None
        if ones is not None:
            _mark(out, ones)
            break
    return out


for _op in (aten.mul.Tensor, aten._to_copy.default):
    register_op_rule(_op, _keep_ones)


# --------------------------------------------------------------------------------------
# Ops whose output's size depends on the data.


_POSITIONS = StorageTags()  # nonzero's output -> its input's shape


def _positions(t: torch.Tensor, n: int) -> torch.Tensor:
    """``nonzero(t)``'s output when it selects the first ``n`` elements of ``t``: ``(n, dim)``
    int64. Its values, if read (``.item()``), are those elements' positions (``position``)."""
    out = torch.empty((n, t.dim()), dtype=torch.long, device="meta")
    _POSITIONS.put(out, tuple(t.shape))
    return out


def position(t: torch.Tensor) -> int | None:
    """The value ``.item()`` reads from one element of a ``nonzero`` output of this module:
    row ``r``, column ``c`` holds coordinate ``c`` of the input's ``r``-th element in
    row-major order (what a real ``nonzero`` gives when it selects every element). So
    ``for i in mask.nonzero(): experts[i]`` visits every expert, not expert 1 each time."""
    shape = _POSITIONS.get(t)
    if not shape:
        return None
    row, col = divmod(t.storage_offset(), len(shape))
    return int(np.unravel_index(row, shape)[col]) if row < math.prod(shape) else None


@register_op_rule(aten.nonzero.default)
def nonzero(ctx, func, args, kwargs):
    """Worst case for ``nonzero``: every element is non-zero, so ``(numel, dim)`` int64 indices;
    over a one-hot routing mask, as many as its slice holds while the mask's ones last
    ("Routing masks" above)."""
    t = args[0]
    if t.device.type != "meta":
        return func(*args, **kwargs)
    ones = _ones_of(t)
    if ones is None:
        ctx.assume("nonzero() assumed to select every element (worst case)")
        return _positions(t, t.numel())
    n = min(t.numel(), ones.left, ones.per_call)
    balanced = ctx.choices.answer(ROUTING) == ROUTING_BALANCED
    if balanced:
        n = min(n, ones.balanced_share())
    ones.left -= n
    ones.calls += 1
    ctx.choices.consult(ROUTING, (ctx.step, ctx.phase))
    ctx.assume(BALANCED_ROUTING_ASSUMPTION if balanced else ROUTING_ASSUMPTION)
    return _positions(t, n)


def _is_mask(i) -> bool:
    return _is_meta(i) and i.dtype in (torch.bool, torch.uint8) and i.dim() > 0


def _expand_masks(indices) -> tuple[list, int]:
    """``indices`` with each boolean mask replaced by the long indices ``nonzero`` would give
    if every element were True (one ``(numel,)`` tensor per mask dimension), and the bytes of
    those indices. ATen's shared indexing code (``expandTensors``, aten/src/ATen/native/
    IndexingUtils.h) calls ``nonzero`` on each mask on every device, CPU and CUDA alike."""
    out, index_bytes = [], 0
    for i in indices:
        if _is_mask(i):
            out.extend(_index(i.numel()) for _ in range(i.dim()))
            index_bytes += i.numel() * i.dim() * INDEX_BYTES
        else:
            out.append(i)
    return out, index_bytes


@register_op_rule(aten.index.Tensor)
def index_with_mask(ctx, func, args, kwargs):
    """``x[mask]``: worst case, the mask is all True and every element is selected. The
    meta kernel cannot run (it calls ``nonzero``), so the mask is replaced by the indices
    of every element. Real kernels also hold ``nonzero``'s ``(numel, mask.dim())`` int64
    indices while the output is written (measured on CPU: exact)."""
    b = bind(func, args, kwargs)
    if not any(_is_mask(i) for i in b["indices"]):
        return _keep_ones(ctx, func, args, kwargs)
    indices, nz_bytes = _expand_masks(b["indices"])
    out = func(b["self"], indices)
    ctx.assume("boolean-mask indexing x[mask] assumed to select every element (worst case)")
    ctx.track(out)
    ctx.scratch(nz_bytes)
    return out


def _index_put(ctx, func, args, kwargs):
    """``x[mask] = v`` (``index_put_``) and the backward of ``x[mask]`` (``index_put`` with
    ``accumulate=True``): the meta kernel runs, but the real one first turns the mask into
    ``nonzero``'s indices; worst case, every element. A single mask with a one-element
    value and no accumulation is ``masked_fill_`` instead, with no indices
    (``canDispatchToMaskedFill``, aten/src/ATen/native/TensorAdvancedIndexingUtils.h).
    Measured on CPU: exact.

    On the CUDA target, with ``accumulate=True`` (or deterministic algorithms) the kernel is
    ``index_put_with_sort_kernel``, whose index arrays and sort buffers
    ``memcheck.rules.cuda_sort`` counts, for integer indices and for the masks' indices alike."""
    b = bind(func, args, kwargs)
    indices = b["indices"]
    sorts = cuda_sort.takes_sort_kernel(ctx, b["self"], b["accumulate"])
    if not any(_is_mask(i) for i in indices):
        if sorts:
            return cuda_sort.index_put_with_sort(ctx, func, args, kwargs)
        return func(*args, **kwargs)
    out = func(*args, **kwargs)
    defined = [i for i in indices if i is not None]
    if not b["accumulate"] and b["values"].numel() == 1 and len(defined) == 1:
        return out  # masked_fill_
    ctx.assume("x[mask] = v (and the backward of x[mask]) assumed to write every element (worst case)")
    ctx.track(out)
    expanded, nz_bytes = _expand_masks(indices)
    ctx.scratch(nz_bytes)
    if sorts:
        cuda_sort.index_put_sort_buffers(ctx, b["self"], expanded, b["values"])
    return out


for _op in (aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default):
    register_op_rule(_op, _index_put)


@register_op_rule(aten.masked_select.default)
def masked_select(ctx, func, args, kwargs):
    """``masked_select`` has no meta kernel. Worst case: the mask is all True, so the output
    holds every element of the broadcast shape. On CPU (``masked_select_out_impl_cpu``,
    aten/src/ATen/native/TensorAdvancedIndexing.cpp) ``mask.sum()`` first converts the
    mask to int64 (8 B per element, and the 8 B sum); the parallel kernel, used unless
    the input is small (< GRAIN_SIZE elements) or one thread runs, and always for a
    broadcast or non-contiguous input, then holds two int64 copies of the mask (the mask
    and its prefix sum) while writing the output. Measured on CPU: exact."""
    b = bind(func, args, kwargs)
    self, mask = b["self"], b["mask"]
    if not (_is_meta(self) or _is_meta(mask)):
        return func(*args, **kwargs)
    shape = torch.broadcast_shapes(self.shape, mask.shape)
    n = math.prod(shape)
    ctx.assume("masked_select assumed to select every element (worst case)")
    cpu = ctx.device is Device.CPU
    if cpu:
        ctx.scratch(8, n * INDEX_BYTES)
    out = torch.empty(n, dtype=self.dtype, device="meta")
    ctx.track(out)
    serial = (
        (self.numel() < GRAIN_SIZE or torch.get_num_threads() == 1)
        and self.expand(shape).is_contiguous() and mask.expand(shape).is_contiguous()
    )
    if cpu and not serial:
        ctx.scratch(n * INDEX_BYTES, n * INDEX_BYTES)
    return out


def _distinct_bound(t: torch.Tensor) -> int:
    """The most distinct values ``t`` can hold: one per element, at most as many as its dtype has."""
    if t.dtype == torch.bool:
        return min(t.numel(), 2)
    if t.element_size() <= 2:
        return min(t.numel(), 2 ** (8 * t.element_size()))
    return t.numel()


@register_op_rule(aten._unique2.default)
def unique(ctx, func, args, kwargs):
    """``torch.unique`` (``_unique2``) has no meta kernel. Worst case: every element is
    distinct, so ``numel`` values (at most 2 for bool, 256 for 8-bit and 65,536 for 16-bit
    dtypes); the inverse has the input's shape and the counts one per value, each empty
    unless asked for, as on CPU.

    The CPU kernel (measured, ``n`` elements of ``e`` bytes, ``k`` values: exact) first
    sorts a copy (``e*n``) with int64 indices (``8*n``) and one more ``8*n`` buffer freed
    before the outputs; the copy and the indices live on while the outputs are written,
    with an ``8*k + 8`` buffer when counts are asked for. bool inputs take a counting
    kernel that needs nothing beyond its outputs."""
    b = bind(func, args, kwargs)
    t = b["self"]
    if not _is_meta(t):
        return func(*args, **kwargs)
    n, k, e = t.numel(), _distinct_bound(t), t.element_size()
    ctx.assume("torch.unique assumed every element distinct (worst case)")
    sort = ctx.device is Device.CPU and t.dtype != torch.bool
    if sort:
        ctx.scratch(e * n, INDEX_BYTES * n, INDEX_BYTES * n)
    out = (
        torch.empty(k, dtype=t.dtype, device="meta"),
        torch.empty(t.shape if b["return_inverse"] else (0,), dtype=torch.long, device="meta"),
        _index(k if b["return_counts"] else 0),
    )
    ctx.track(out)
    if sort:
        ctx.scratch(e * n, INDEX_BYTES * n, INDEX_BYTES * k + 8 if b["return_counts"] else 0)
    return out


def _unique_slices(ctx, t: torch.Tensor, dim: int, *, consecutive: bool):
    """``unique(dim=...)`` and ``unique_consecutive(dim=...)``: worst case, every slice along
    ``dim`` is distinct, so the output has the input's shape; the inverse and counts (one
    int64 per slice) are returned whether asked for or not, as on CPU. On CPU the kernel
    copies the input with ``dim`` moved first when that view is not contiguous, and the
    sorting ``unique`` holds one more copy (measured: exact, but for a fixed 14,400 B
    buffer the sort takes and frees before the outputs, left out)."""
    dim = dim % t.dim() if t.dim() else 0
    slices = t.shape[dim] if t.dim() else 1
    out = (torch.empty(t.shape, dtype=t.dtype, device="meta"), _index(slices), _index(slices))
    ctx.track(out)
    if ctx.device is Device.CPU:
        copies = 0 if t.dim() == 0 or t.movedim(dim, 0).is_contiguous() else 1
        ctx.scratch((copies + (0 if consecutive else 1)) * nbytes(t))
    return out


@register_op_rule(aten.unique_dim.default)
def unique_dim(ctx, func, args, kwargs):
    """``torch.unique(x, dim=d)`` has no meta kernel; see ``_unique_slices``."""
    b = bind(func, args, kwargs)
    if not _is_meta(b["self"]):
        return func(*args, **kwargs)
    ctx.assume("torch.unique(dim=...) assumed every slice distinct (worst case)")
    return _unique_slices(ctx, b["self"], b["dim"], consecutive=False)


@register_op_rule(aten.unique_consecutive.default)
def unique_consecutive(ctx, func, args, kwargs):
    """``torch.unique_consecutive`` has no meta kernel. Worst case: no element equals its
    neighbour, so ``numel`` values; inverse and counts empty unless asked for, as on CPU,
    where the kernel needs nothing beyond its outputs (measured: exact). With ``dim``:
    ``_unique_slices``."""
    b = bind(func, args, kwargs)
    t = b["self"]
    if not _is_meta(t):
        return func(*args, **kwargs)
    ctx.assume("torch.unique_consecutive assumed no element equal to its neighbour (worst case)")
    if b["dim"] is not None:
        return _unique_slices(ctx, t, b["dim"], consecutive=True)
    n = t.numel()
    return (
        torch.empty(n, dtype=t.dtype, device="meta"),
        torch.empty(t.shape if b["return_inverse"] else (0,), dtype=torch.long, device="meta"),
        _index(n if b["return_counts"] else 0),
    )


@register_op_rule(aten.unique_dim_consecutive.default)
def unique_dim_consecutive(ctx, func, args, kwargs):
    """``unique_dim_consecutive`` has no meta kernel; see ``_unique_slices``."""
    b = bind(func, args, kwargs)
    if not _is_meta(b["self"]):
        return func(*args, **kwargs)
    ctx.assume("torch.unique_consecutive assumed no element equal to its neighbour (worst case)")
    return _unique_slices(ctx, b["self"], b["dim"], consecutive=True)


@register_op_rule(aten.bincount.default)
def bincount(ctx, func, args, kwargs):
    """``bincount`` has no meta kernel, and its size, ``max(input) + 1`` bins (at least
    ``minlength``), has no bound. Synthetic value: the largest input is ``numel - 1``, so
    ``max(minlength, numel)`` bins, what one bin per input needs. The output is int64, or
    float32/float64 for float32/float64 weights and float64 for other weights; on CPU
    other weights are first converted to float64 (``weights.to(kDouble)``, 8 B each,
    held while the output is written; measured: exact)."""
    b = bind(func, args, kwargs)
    t, weights, minlength = b["self"], b["weights"], b["minlength"]
    if not _is_meta(t):
        return func(*args, **kwargs)
    bins = max(int(minlength), t.numel())
    dtype = torch.long
    if weights is not None:
        dtype = weights.dtype if weights.dtype in (torch.float32, torch.float64) else torch.float64
    ctx.assume(
        f"bincount: the largest value taken as the element count - 1, so max(minlength, numel) = {bins} bins"
    )
    out = torch.empty(bins, dtype=dtype, device="meta")
    ctx.track(out)
    if ctx.device is Device.CPU and weights is not None and weights.dtype not in (torch.float32, torch.float64):
        ctx.scratch(weights.numel() * 8)
    return out


@register_op_rule(aten.repeat_interleave.Tensor)
def repeat_interleave(ctx, func, args, kwargs):
    """``repeat_interleave`` with a tensor of repeats: the output has ``sum(repeats)``
    elements, with no bound, and the meta kernel needs ``output_size``. Synthetic value:
    every repeat is 1 (``.item()``'s integer), so as many elements as repeats; with
    ``output_size`` given, that size. On CPU the kernel holds the repeats' cumulative sum
    (int64, 8 B per repeat) while the output is written; int32 repeats are first
    converted, with a second int64 buffer freed before the output (measured: exact)."""
    b = bind(func, args, kwargs)
    repeats, size = b["repeats"], b["output_size"]
    if not _is_meta(repeats):
        return func(*args, **kwargs)
    if size is None:
        size = repeats.numel()
        ctx.assume("repeat_interleave with a tensor of repeats: each repeat taken as 1 "
                   "(pass output_size= to trace the real size)")
    cpu = ctx.device is Device.CPU
    r = repeats.numel() * INDEX_BYTES
    if cpu and repeats.dtype != torch.long:
        ctx.scratch(r, r)
    out = torch.empty(int(size), dtype=repeats.dtype, device="meta")
    ctx.track(out)
    if cpu:
        ctx.scratch(r)
    return out


# --------------------------------------------------------------------------------------
# CTC loss (Wav2Vec2ForCTC, HubertForCTC, WavLMForCTC ...). ATen has no meta kernel for it: the
# size of its alpha table depends on the longest target, a value of ``target_lengths``.

def _ctc_sizes(ctx, log_probs, targets):
    """(time, batch, longest target). Worst case: every sample's target as long as the padded
    labels' row, so for concatenated 1-d targets (``labels.masked_select(labels >= 0)``) an
    even share of them."""
    steps, batch = log_probs.shape[0], (log_probs.shape[1] if log_probs.dim() == 3 else 1)
    if targets.dim() == 2:
        longest = targets.shape[1]
    else:
        longest = -(-targets.numel() // batch)
    ctx.assume(f"CTC targets taken as {longest} labels each (every label row full length)")
    return steps, batch, longest


@register_op_rule(aten._ctc_loss.Tensor)
def ctc_loss(ctx, func, args, kwargs):
    """``_ctc_loss`` on meta: the negative log likelihood (batch,) and the alpha table (batch,
    time, 2 * longest target + 1), as ``ctc_loss_cpu_template`` and ``ctc_loss_gpu_template``
    (aten/src/ATen/native/LossCTC.cpp, cuda/LossCTC.cu) allocate them."""
    log_probs, targets = args[0], args[1]
    if not _is_meta(log_probs):
        return func(*args, **kwargs)
    steps, batch, longest = _ctc_sizes(ctx, log_probs, targets)
    options = dict(dtype=log_probs.dtype, device="meta")
    nll = torch.empty(batch, **options) if log_probs.dim() == 3 else torch.empty((), **options)
    log_alpha = torch.empty(batch, steps, 2 * longest + 1, **options)
    if ctx.device is Device.CUDA:  # the lengths and target offsets copied to the GPU for the kernel (LossCTC.cu)
        ctx.track((nll, log_alpha))
        ctx.scratch(*(batch * INDEX_BYTES,) * 3)
    return nll, log_alpha


@register_op_rule(aten._ctc_loss_backward.Tensor)
def ctc_loss_backward(ctx, func, args, kwargs):
    """``_ctc_loss_backward`` on meta: the gradient, shaped as ``log_probs`` (``full_like(log_probs,
    -inf)``), and inside the op the beta table, shaped as alpha (``empty_like(log_alpha)``), freed
    on return (LossCTC.cpp ``ctc_loss_backward_cpu_template``, cuda/LossCTC.cu)."""
    log_probs, log_alpha = args[1], args[6]
    if not _is_meta(log_probs):
        return func(*args, **kwargs)
    grad = torch.empty_like(log_probs, memory_format=torch.contiguous_format)
    ctx.track(grad)
    extra = (log_probs.shape[1] * INDEX_BYTES,) * 3 if ctx.device is Device.CUDA and log_probs.dim() == 3 else ()
    ctx.scratch(*extra, nbytes(log_alpha))
    return grad
