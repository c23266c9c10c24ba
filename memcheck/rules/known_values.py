"""Values memcheck knows by construction, so that a data-dependent check on them needs no stand-in.

A meta tensor has no values, and ``memcheck.rules.data_dependent`` answers checks on the
batch's values with the worst case: the batch contains padding, so ``mask.all()`` is False.
Some tensors' values are known all the same, because the traced code made them: the
decoder of BART or Pegasus, given no ``decoder_attention_mask``, builds
``torch.ones(batch, length)`` itself, and transformers then asks whether that mask is all
ones (``masking_utils.fast_all``: ``mask.sum() == mask.numel()``) before it materialises a
``(batch, 1, length, length)`` attention mask. A real run answers True and skips the mask;
the stand-in answered False and saved a mask per decoder layer (issue 18, cause 6).

``KnownValues`` follows, per storage, one value that *every* element of the storage holds:

* **made**: ``ones``, ``zeros``, ``full``, their ``_like`` and ``new_`` forms, ``scalar_tensor``;
* **kept**: a view shares its base's storage, so ``expand``, slices, ``unsqueeze`` need nothing;
* **computed** from known inputs: casts (``.to``, ``clone``), comparisons with a number or
  another known tensor, ``~``/``logical_not``/``neg``/``abs``, ``+ - * & | ^`` and the
  logical ones with known operands, reductions (``sum``, ``all``, ``any``, ``amax``, ``amin``, ``mean``), and ops
  that only pick elements (``index``, ``index_select``, ``gather``, ``repeat``, ``cat``,
  ``stack``, and ``constant_pad_nd`` with the same value);
* **written**: ``fill_``, ``zero_`` and ``copy_`` of a known value over the whole storage
  set it; a write that covers part of the storage keeps it only when it writes the same
  value. Every other op that writes a tensor (its schema says ``a!``) forgets it.

It also follows **rows that count**: ``arange`` makes a storage whose element ``j`` holds
``start + step * (j mod length)``, and the tracer follows such rows through views (a slice,
``unsqueeze``, ``expand``, ``select`` of one position), ``+ - *`` with a number or another
row, ``cat`` along the last dimension where the pieces continue one another, and ``cumsum``
of a known value. A row whose step is 0 is a known value like the ones above. This is
what transformers' packed-sequence check needs (``masking_utils.find_packed_sequence_indices``:
``(diff(position_ids) != 1).cumsum(-1)[:, -1] == 0``): given no attention mask and no
cache, as in training with gradient checkpointing, it asks whether the position ids the
model made from ``arange`` restart anywhere. A real run answers no and lets SDPA run
causal without a mask; the stand-in answered yes and built a (batch, 1, length, length)
mask, whose recomputation under checkpointing cost +4.5% on a 2-layer Llama.

Everything else, and every tensor made before the trace (the user's batch), stays unknown,
and its checks keep the worst-case stand-in. Only values on the meta device are followed.
"""

from __future__ import annotations

import operator
import weakref

import torch

from memcheck import compat

aten = torch.ops.aten

Number = bool | int | float | complex


def cast(value: Number, dtype: torch.dtype) -> Number:
    """``value`` as an element of ``dtype`` holds it: the conversion a real tensor makes
    (truncation to an integer, rounding to float16/bfloat16, wrap-around for uint8), done
    by a one-element CPU tensor."""
    with compat.DisableTorchFunction():  # inside the tracer: no kernel-choice mode here
        return torch.tensor(value).to(dtype).item()


def _count(t: torch.Tensor, out: torch.Tensor) -> int:
    """How many input elements each element of a reduction's output reduces."""
    return t.numel() // out.numel() if out.numel() else 0


# Factories: op packet -> the fill value, from the call's arguments.
_FACTORIES = {
    aten.ones: lambda args, kwargs: 1,
    aten.ones_like: lambda args, kwargs: 1,
    aten.new_ones: lambda args, kwargs: 1,
    aten.zeros: lambda args, kwargs: 0,
    aten.zeros_like: lambda args, kwargs: 0,
    aten.new_zeros: lambda args, kwargs: 0,
    aten.full: lambda args, kwargs: args[1] if len(args) > 1 else kwargs["fill_value"],
    aten.full_like: lambda args, kwargs: args[1] if len(args) > 1 else kwargs["fill_value"],
    aten.new_full: lambda args, kwargs: args[2] if len(args) > 2 else kwargs["fill_value"],
    aten.scalar_tensor: lambda args, kwargs: args[0] if args else kwargs["s"],
}

# Elementwise ops on one tensor: op packet -> f(value).
_UNARY = {
    aten._to_copy: lambda v: v,
    aten.clone: lambda v: v,
    aten.lift_fresh_copy: lambda v: v,
    aten.bitwise_not: lambda v: (not v) if isinstance(v, bool) else ~v,
    aten.logical_not: lambda v: not v,
    aten.neg: operator.neg,
    aten.abs: abs,
}

# Elementwise ops on two operands (tensor or number): op packet -> f(a, b).
_BINARY = {
    aten.eq: operator.eq, aten.ne: operator.ne, aten.lt: operator.lt, aten.le: operator.le,
    aten.gt: operator.gt, aten.ge: operator.ge, aten.mul: operator.mul,
    aten.logical_and: lambda a, b: bool(a) and bool(b), aten.logical_or: lambda a, b: bool(a) or bool(b),
    aten.bitwise_and: operator.and_, aten.bitwise_or: operator.or_, aten.bitwise_xor: operator.xor,
}

# Reductions: op packet -> f(value, number of elements reduced).
_REDUCTIONS = {
    aten.sum: lambda v, n: v * n,
    aten.all: lambda v, n: n == 0 or bool(v),
    aten.any: lambda v, n: n > 0 and bool(v),
    aten.amax: lambda v, n: v, aten.amin: lambda v, n: v,
    aten.mean: lambda v, n: v if n else float("nan"),  # the mean of nothing is NaN
}

# Ops whose output elements are some of their input's elements.
_PICKS = frozenset({aten.index, aten.index_select, aten.gather, aten.repeat})

_FILLS = frozenset({aten.fill_, aten.zero_, aten.copy_})
_FOLLOWED = frozenset({*_FACTORIES, *_UNARY, *_BINARY, aten.add, aten.sub, aten.rsub, *_REDUCTIONS, *_PICKS,
                       aten.cat, aten.stack, aten.constant_pad_nd, aten.arange, aten.cumsum})
# Row arithmetic: (start, step) of each operand -> (start, step) of the result, elementwise.
_ROW_OPS = {
    aten.add: lambda a, b, alpha: (a[0] + alpha * b[0], a[1] + alpha * b[1]),
    aten.sub: lambda a, b, alpha: (a[0] - alpha * b[0], a[1] - alpha * b[1]),
    aten.rsub: lambda a, b, alpha: (b[0] - alpha * a[0], b[1] - alpha * a[1]),
}


def _written_slots(func) -> tuple:
    """``(index, name, kwarg_only)`` of each argument the op writes (``Tensor(a!)`` in its schema)."""
    return tuple((i, a.name, a.kwarg_only) for i, a in enumerate(func._schema.arguments)
                 if a.alias_info is not None and a.alias_info.is_write)


def _is_meta(t) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == "meta"


def _storage(t):
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def _covers(t: torch.Tensor) -> bool:
    """Whether ``t`` is every element of its storage, once each."""
    st = _storage(t)
    return (st is not None and t.storage_offset() == 0 and t.is_contiguous()
            and t.numel() * t.element_size() == st.nbytes())


class KnownValues:
    """The value every element of a meta storage holds, where the trace made it so.

    Weakly keyed by storage (``UntypedStorage`` hashes by identity, and torch keeps one
    Python object per storage), so an entry goes with its storage.

    Example:
        >>> known = KnownValues()
        >>> t = torch.ones(2, 3, device="meta")
        >>> known.observe(aten.ones.default, ([2, 3],), {"device": "meta"}, t)
        >>> known.value(t[0].expand(4, 3))
        1.0
    """

    def __init__(self):
        # storage -> (dtype, start, step, length): element j holds start + step * (j % length); step 0: one value
        self._values: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._writes: dict = {}  # OpOverload -> ((index, name, kwarg_only), ...) of the arguments it writes

    def value(self, t) -> Number | None:
        """The value every element of ``t`` holds, or None where it is not known."""
        row = self.row(t)
        if row is None or (row[1] != 0 and (t.dim() and t.shape[-1] > 1)):
            return None
        return row[0]

    def row(self, t) -> tuple[Number, Number] | None:
        """``(start, step)`` where element ``i`` of ``t``'s last dimension holds ``start + step * i``
        whatever its other indices, or None where that is not known."""
        if not _is_meta(t):
            return None
        st = _storage(t)
        entry = self._values.get(st) if st is not None else None
        if entry is None or entry[0] != t.dtype:  # a view as another dtype reads other values
            return None
        _, start, step, length = entry
        if step == 0:
            return start, 0
        # A view reads a row that counts when its last dimension walks along one storage row and
        # its other dimensions move by whole rows (or not at all).
        offset = t.storage_offset() % length
        last = t.shape[-1] if t.dim() else 1
        stride = t.stride()[-1] if t.dim() else 0
        if any(n > 1 and s % length for n, s in zip(t.shape[:-1], t.stride()[:-1])):
            return None
        if last > 1 and (offset + stride * (last - 1) >= length or stride < 0):
            return None
        return start + step * offset, step * stride if last > 1 else 0

    def __bool__(self) -> bool:
        """Whether any value is known."""
        return bool(self._values)

    def set_value(self, t: torch.Tensor, value: Number) -> None:
        """Know that every element of ``t``'s storage holds ``value`` (a batch's attention mask
        under the answer ``no-padding``, ``memcheck.choices``)."""
        if _is_meta(t):
            self._set(t, value)

    def forget(self, t: torch.Tensor) -> None:
        """Stop knowing ``t``'s values (the tracer calls it for the batch: the user's data)."""
        st = _storage(t)
        if st is not None:
            self._values.pop(st, None)

    def clear(self) -> None:
        self._values.clear()

    def _set(self, t, value: Number, step: Number = 0) -> None:
        st = _storage(t)
        if st is None:
            return
        length = t.shape[-1] if t.dim() else 1
        try:
            start = cast(value, t.dtype)
            if step and (length < 2 or cast(value + step * (length - 1), t.dtype) != start + step * (length - 1)):
                step = None  # the row does not survive the dtype (rounding, wrap-around): not followed
            if step is None:
                self._values.pop(st, None)
            else:
                self._values[st] = (t.dtype, start, step, max(length, 1))
        except (RuntimeError, TypeError, ValueError, OverflowError):
            self._values.pop(st, None)

    def _operand(self, a) -> Number | None:
        if isinstance(a, torch.Tensor):
            if a.device.type == "cpu" and a.numel() == 1:
                return a.item()  # a wrapped number, or a real one-element tensor
            return self.value(a)
        if isinstance(a, (bool, int, float, complex)):
            return a
        return None

    # ---- following an op -------------------------------------------------------------
    def observe(self, func, args: tuple, kwargs: dict, out) -> None:
        """Update what is known after the op ``func(*args, **kwargs)`` returned ``out``."""
        packet = func._overloadpacket
        if not self._values and packet not in _FACTORIES and packet not in _FILLS and packet is not aten.arange:
            return  # nothing known yet, and this op makes nothing known
        slots = self._writes.get(func)
        if slots is None:
            slots = self._writes[func] = _written_slots(func)
        if not slots and packet not in _FOLLOWED:
            return  # writes nothing, and its output's value is not followed
        written = self._written(slots, args, kwargs)
        if written:
            if packet in _FILLS and _is_meta(args[0]):
                try:
                    self._fill(packet, args, kwargs)
                except (TypeError, ValueError, ArithmeticError, RuntimeError):
                    self.forget(args[0])
            else:
                for t in written:
                    self.forget(t)
            return
        if func.is_view or not _is_meta(out):
            return
        try:
            value = self._compute(packet, args, kwargs, out)
        except (TypeError, ValueError, ArithmeticError, IndexError, KeyError, RuntimeError):
            value = None
        if value is not None and _covers(out):
            start, step = value if isinstance(value, tuple) else (value, 0)
            self._set(out, start, step)

    @staticmethod
    def _written(slots, args, kwargs) -> list[torch.Tensor]:
        tensors = []
        for i, name, kwarg_only in slots:
            a = args[i] if i < len(args) and not kwarg_only else kwargs.get(name)
            for t in a if isinstance(a, (list, tuple)) else (a,):
                if isinstance(t, torch.Tensor):
                    tensors.append(t)
        return tensors

    def _fill(self, packet, args, kwargs) -> None:
        """``fill_``, ``zero_``, ``copy_``: the written value over the whole storage sets it;
        over part of it, the storage keeps its value only if that is the value written."""
        self_ = args[0]
        if packet is aten.zero_:
            new = 0
        else:
            new = self._operand(args[1] if len(args) > 1 else kwargs.get("value", kwargs.get("src")))
        if new is None:
            self.forget(self_)
        elif _covers(self_):
            self._set(self_, new)
        elif self.value(self_) is None or self.value(self_) != cast(new, self_.dtype):
            self.forget(self_)

    def _operand_row(self, a) -> tuple[Number, Number] | None:
        if isinstance(a, torch.Tensor) and _is_meta(a):
            return self.row(a)
        v = self._operand(a)
        return None if v is None else (v, 0)

    def _compute(self, packet, args, kwargs, out) -> Number | tuple[Number, Number] | None:
        """The value of every element of ``out``, or ``(start, step)`` of its rows, where the op and
        its inputs make it known."""
        if packet in _FACTORIES:
            return _FACTORIES[packet](args, kwargs)
        if packet is aten.arange:  # arange(end), arange(start, end), arange(start, end, step)
            numbers = [a for a in args if isinstance(a, (int, float))]
            start = numbers[0] if len(numbers) > 1 else kwargs.get("start", 0)
            step = numbers[2] if len(numbers) > 2 else kwargs.get("step", 1)
            return (start, step) if out.dim() == 1 else None
        if packet in _ROW_OPS and out.dim():
            a = self._operand_row(args[0])
            b = self._operand_row(args[1] if len(args) > 1 else kwargs.get("other"))
            if a is not None and b is not None and (a[1] or b[1]):
                alpha = args[2] if len(args) > 2 else kwargs.get("alpha", 1)
                return _ROW_OPS[packet](a, b, alpha)
        if packet is aten.mul and out.dim():
            a, b = (self._operand_row(x) for x in (args[0], args[1]))
            if a is not None and b is not None and (a[1] == 0 or b[1] == 0) and (a[1] or b[1]):
                (v, _), (s, d) = (a, b) if a[1] == 0 else (b, a)
                return s * v, d * v
        if packet is aten.cat and out.dim() and args[1:2] in ((-1,), (out.dim() - 1,)):
            return self._joined_row(args[0])
        if packet is aten.cumsum and out.dim():
            dim = args[1] if len(args) > 1 else kwargs.get("dim")
            v = self.value(args[0])
            if v is not None and dim in (-1, out.dim() - 1):
                return v, v  # element i sums i + 1 copies of v
            return None
        if packet in _UNARY:
            v = self.value(args[0])
            return None if v is None else _UNARY[packet](v)
        if packet in _BINARY or packet in (aten.add, aten.sub, aten.rsub):
            a, b = self._operand(args[0]), self._operand(args[1] if len(args) > 1 else kwargs.get("other"))
            if a is None or b is None:
                return None
            if packet in _BINARY:
                return _BINARY[packet](a, b)
            alpha = args[2] if len(args) > 2 else kwargs.get("alpha", 1)
            return {aten.add: a + alpha * b, aten.sub: a - alpha * b, aten.rsub: b - alpha * a}[packet]
        if packet in _REDUCTIONS:
            v = self.value(args[0])
            return None if v is None else _REDUCTIONS[packet](v, _count(args[0], out))
        if packet in _PICKS:
            return self.value(args[0])
        if packet in (aten.cat, aten.stack):
            values = {self.value(t) for t in args[0] if not (isinstance(t, torch.Tensor) and t.numel() == 0)}
            return values.pop() if len(values) == 1 else None
        if packet is aten.constant_pad_nd:
            v = self.value(args[0])
            pad = args[2] if len(args) > 2 else kwargs.get("value", 0)
            return v if v is not None and v == cast(pad, args[0].dtype) else None
        return None

    def _joined_row(self, pieces) -> tuple[Number, Number] | None:
        """``(start, step)`` of ``cat(pieces, dim=-1)`` where each piece continues the row before it
        (``cat([x[:, :1] - 1, x], -1)``, the first step of ``torch.diff(x, prepend=...)``)."""
        pieces = [t for t in pieces if isinstance(t, torch.Tensor) and t.numel()]
        rows = [self.row(t) for t in pieces]
        if not rows or any(r is None for r in rows):
            return None
        steps = {r[1] for r, t in zip(rows, pieces) if t.shape[-1] > 1}
        if len(steps) > 1:
            return None
        step = steps.pop() if steps else (rows[1][0] - rows[0][0] if len(rows) > 1 else 0)
        at = 0
        for (start, _), t in zip(rows, pieces):
            if start != rows[0][0] + step * at:
                return None
            at += t.shape[-1]
        return rows[0][0], step
