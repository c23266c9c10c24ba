"""What memcheck knows about popular PyTorch extensions: flash-attn, bitsandbytes, TRL's kernels.

Both register their kernels as torch custom ops (``torch.ops.flashattn.*``,
``torch.ops.bitsandbytes.*``) whose meta ("fake") kernels return outputs of the
right shapes but not the buffers the CUDA or CPU kernels allocate inside the op.
The rules here add those, keyed by qualified op name (``memcheck.rules.registry.NAMED_RULES``),
so neither package is imported by memcheck: a rule is found only when a traced
model calls the op. What needs a package's classes (bitsandbytes' quantized
parameters) runs only when the package is already in ``sys.modules``, which it is
whenever a model of it exists.

* ``memcheck.rules.extensions.flash_attn``: ``flash_attn_func`` and friends (flash-attn >= 2.7).
* ``memcheck.rules.extensions.bitsandbytes``: ``Linear4bit``, ``Linear8bitLt`` and the 8-bit
  optimizers (bitsandbytes 0.50; the optimizers' layout since 0.44).
* ``memcheck.rules.extensions.trl``: TRL's fused LM head, whose Triton folds allocate nothing
  on CUDA (trl 1.16); entered while tracing (``tracing``), as TRL's module is a Python one.
* ``memcheck.rules.extensions.triton``: a Triton kernel launched on meta tensors does nothing
  (kernels allocate nothing; their callers' host code is traced): Liger's kernels.

Anything else without a meta kernel: ``memcheck.register_op_rule`` (see
``examples/custom_op_rule.py``).
"""

from __future__ import annotations

import contextlib

from memcheck.rules.extensions import bitsandbytes, flash_attn, triton, trl


def twin_memo(model, memo: dict) -> None:
    """Add meta stand-ins for extension parameters to ``memo``, the ``copy.deepcopy`` memo
    from which ``memcheck.engine.setup.meta_twin`` builds a model's meta twin (see
    ``memcheck.rules.extensions.bitsandbytes.twin_memo``)."""
    bitsandbytes.twin_memo(model, memo)


def weight_side_tensors(module) -> tuple:
    """Tensors that belong to ``module``'s weights without being parameters or buffers
    (bitsandbytes' quantization statistics); the tracer counts them as parameters."""
    return bitsandbytes.weight_side_tensors(module)


def explain_failure(exc: BaseException) -> str | None:
    """A one-line explanation when ``exc`` was raised inside an extension memcheck knows
    but cannot trace (flash-attn's direct CUDA-extension calls), else None."""
    return flash_attn.explain_failure(exc)


@contextlib.contextmanager
def tracing(tracer, device):
    """What the extensions loaded by now change while ``tracer`` traces for ``device``
    (``memcheck.rules.extensions.trl.tracing``, ``memcheck.rules.extensions.triton.tracing``);
    entered again after a script has imported more."""
    with trl.tracing(tracer, device), triton.tracing(tracer):
        yield
