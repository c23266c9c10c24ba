"""Triton kernels on meta tensors: a launch allocates nothing, its callers' host code is traced.

A Triton kernel (``@triton.jit``) is launched from Python as ``kernel[grid](*args)``
(``KernelInterface.__getitem__``, triton/runtime/jit.py:369 in triton 3.9; autotuned and
heuristic kernels and the interpreter's ``InterpretedFunction`` are ``KernelInterface`` too)
and reads and writes only the tensors it is given: device code has no allocator, so
every buffer a kernel fills (an output, a per-row statistic, a gradient written in place)
is allocated by its caller's host code with torch ops, which the tracer sees. Liger's
fused linear cross-entropy is that shape (liger_kernel 0.8.5,
liger_kernel/ops/fused_linear_cross_entropy.py ``fused_linear_cross_entropy_forward``,
lines 51-397): it allocates the hidden states' and the weight's gradients up front
(lines 108-120), projects ``chunk_size`` tokens at a time (lines 103-106: the tokens split
so that a chunk's logits are about as large as the hidden states), and its kernel
(``liger_cross_entropy_kernel``, line 218) overwrites each chunk's logits with their
gradient in place; the backward only scales those gradients (``element_mul_kernel``).

A kernel cannot run on meta tensors (no data, no driver). While tracing, a launch whose
arguments include a meta tensor does nothing, and the tracer says so once per kernel.

Known limitations:
    A kernel that asks the runtime for global scratch memory (``triton.set_allocator``:
    TMA descriptors, some Hopper kernels) gets it from the torch allocator at launch;
    that allocation is not traced. Host code that branches on the device type takes the
    branch of neither target on meta: in Liger's forward, ``_can_use_mm_out`` (line 32)
    reuses one logits buffer only on CUDA, where a trace allocates a new chunk each
    time (the same peak: one chunk live), and on CUDA bf16/fp16 weight gradients
    accumulate through ``addmm`` into the accumulator (lines 332-372), where a trace
    takes the fallback with a weight-sized temporary (line 378). Measured on the CPU only
    (``TRITON_INTERPRET=1`` runs the kernels there): benchmarks/liger_cpu.py.
"""

from __future__ import annotations

import contextlib
import sys

import torch

from memcheck.compat import tree_flatten


def _touches_meta(args, kwargs) -> bool:
    return any(isinstance(t, torch.Tensor) and t.device.type == "meta" for t in tree_flatten((args, kwargs))[0])


@contextlib.contextmanager
def tracing(tracer):
    """While tracing, a Triton launch on meta tensors is a no-op (the tracer lists the kernel).
    A no-op itself when Triton is not loaded."""
    jit = sys.modules.get("triton.runtime.jit")
    interface = getattr(jit, "KernelInterface", None)
    if interface is None:
        yield
        return
    original = interface.__getitem__

    def __getitem__(self, grid):
        launch = original(self, grid)

        def maybe_launch(*args, **kwargs):
            if not _touches_meta(args, kwargs):
                return launch(*args, **kwargs)
            name = getattr(getattr(self, "fn", self), "__name__", type(self).__name__)
            tracer.assume(f"Triton kernel {name}: writes only the tensors its caller allocated (launch not run)")
            return None

        return maybe_launch

    interface.__getitem__ = __getitem__
    try:
        yield
    finally:
        interface.__getitem__ = original
