"""The registry of op rules: knowledge about particular ops, as small registered functions.

Two registries, one per level at which a choice is made:

* ``FUNCTION_RULES`` are keyed by a Python-level torch function (for example
  ``torch.nn.functional.scaled_dot_product_attention``). They exist because a
  composite op picks its kernel by device type *before* reaching the dispatcher:
  on meta, SDPA always decomposes into the math path, which stores the
  (s x s) attention matrix that the target device's fused kernels never allocate.
* ``DISPATCH_RULES`` are keyed by an aten ``OpOverload``. They stand in for ops
  whose meta behaviour differs from a real run (data-dependent ops and scalars, in
  ``memcheck.rules.data_dependent``) or that have no meta kernel at all (custom extensions).
* ``NAMED_RULES`` are keyed by an op's qualified name (``"flashattn::_flash_attn_forward"``,
  ``"ns::op.overload"``), for ops of packages that may not be installed or imported
  when memcheck is (``memcheck.rules.extensions``); the tracer looks there when an op has
  no ``DISPATCH_RULES`` entry.

A rule is ``rule(ctx, func, args, kwargs) -> result``. ``ctx`` is the running
``memcheck.trace.tracer.MemoryTracer``: rules read ``ctx.device`` (the target) and call
``ctx.assume(text)`` to list what they assumed in the report.

Users add rules with ``memcheck.register_op_rule``. The registry imports none of its
rules: each rule module registers itself, and ``memcheck.rules`` imports them all (the
shape of ``torch.utils.flop_counter``'s ``register_flop_formula``). Registering a second
rule for the same op raises ``ValueError``; ``replace=True`` is for a user who means it.
"""

from __future__ import annotations

from typing import Any, Callable

from memcheck import compat

Rule = Callable[[Any, Any, tuple, dict], Any]
FUNCTION_RULES: dict[Any, Rule] = {}
DISPATCH_RULES: dict[Any, Rule] = {}
NAMED_RULES: dict[str, Rule] = {}


def _put(table: dict, key, fn: Rule, replace: bool) -> None:
    """Add ``fn`` under ``key``; a second rule for the same op is a mistake unless ``replace``."""
    old = table.get(key)
    if old is not None and old is not fn and not replace:
        raise ValueError(f"an op rule for {key} is already registered ({old.__module__}.{old.__qualname__}); "
                         "pass replace=True to register_op_rule to replace it")
    table[key] = fn


def register_op_rule(op, rule: Rule | None = None, *, replace: bool = False):
    """Register ``rule`` for ``op``; usable as a decorator.

    ``op`` is an aten ``OpOverload`` or ``OpOverloadPacket`` (``torch.ops.aten.nonzero``,
    ``torch.ops.mylib.fused_norm.default``), a qualified name (``"mylib::fused_norm"``
    for every overload, ``"mylib::fused_norm.out"`` for one; the op need not exist yet),
    or a Python torch function such as ``torch.nn.functional.scaled_dot_product_attention``.
    A packet registers every overload. The rule receives ``(ctx, func, args, kwargs)`` and must return what
    the op would return, built from meta tensors of the right shapes and dtypes
    (``torch.empty(..., device="meta")``); memcheck counts their bytes. A second rule for
    an op that has one raises ``ValueError`` unless ``replace=True``.

    Example:
        >>> @memcheck.register_op_rule(torch.ops.mylib.fused_norm.default)
        ... def fused_norm(ctx, func, args, kwargs):
        ...     x = args[0]
        ...     return torch.empty_like(x), torch.empty(x.shape[0], device="meta")
    """

    def add(fn: Rule) -> Rule:
        if isinstance(op, str):
            if "::" not in op:
                raise TypeError(f"register_op_rule needs a qualified op name such as 'mylib::fused_norm', not {op!r}")
            _put(NAMED_RULES, op, fn, replace)
        elif isinstance(op, compat.OpOverloadPacket):
            for name in op.overloads():
                _put(DISPATCH_RULES, getattr(op, name), fn, replace)
        elif isinstance(op, compat.OpOverload):
            _put(DISPATCH_RULES, op, fn, replace)
        elif callable(op):
            _put(FUNCTION_RULES, op, fn, replace)
        else:
            raise TypeError(f"register_op_rule needs an aten op or a torch function, not {op!r}")
        return fn

    return add(rule) if rule is not None else add


def named_rule(func) -> Rule | None:
    """The rule registered for ``func`` by name: its overload's (``"ns::op.overload"``), else its op's."""
    if not NAMED_RULES or not isinstance(func, compat.OpOverload):
        return None
    return NAMED_RULES.get(func.name()) or NAMED_RULES.get(func._schema.name)


def bind(func, args: tuple, kwargs: dict, *, names: tuple[str, ...] | None = None,
         defaults: dict | None = None) -> dict:
    """A call's arguments by name, each one present: passed positionally, by keyword,
    else its default, else None.

    For an aten ``OpOverload`` (``names`` not given) the names and defaults are its
    schema's, so a rule is robust to arguments a package version adds or drops; a
    keyword-only argument is taken from ``kwargs`` only. A Python function (such as
    ``F.scaled_dot_product_attention``) has no schema: ``names`` lists its parameters in
    order (or the first few a rule reads) and ``defaults`` those that have one. Keywords
    not named are left out.

    Example:
        >>> bind(F.softmax, (x, -1), {}, names=("input", "dim", "_stacklevel", "dtype"),
        ...      defaults={"_stacklevel": 3})
        {'input': x, 'dim': -1, '_stacklevel': 3, 'dtype': None}
    """
    if names is None:
        params = [(arg.name, arg.kwarg_only, arg.default_value if arg.has_default_value() else None)
                  for arg in func._schema.arguments]
    else:
        defaults = defaults or {}
        params = [(name, False, defaults.get(name)) for name in names]
    bound = {}
    for i, (name, kwarg_only, default) in enumerate(params):
        if i < len(args) and not kwarg_only:
            bound[name] = args[i]
        else:
            bound[name] = kwargs.get(name, default)
    return bound
