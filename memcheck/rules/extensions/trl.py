"""TRL's fused LM head on the CUDA target: its Triton folds allocate nothing.

TRL's ``SFTTrainer`` (and its DPO, KTO, GRPO and RLOO trainers) compute the loss through a
fused LM head (trl 1.16, ``add_fused_lm_head``, trl/trainer/utils.py:1548), whose
``ChunkedLogProbFunction`` (trl/kernels/chunked_logprob.py:299) projects the hidden states
through the LM head one ``[4096 tokens, 32768 vocabulary]`` tile at a time into a reused
buffer (``mm_buf``, lines 347 and 413) and folds each tile into per-token running statistics
(log-sum-exp, entropy, top-1) in the forward, and into the logits gradient, in place, in the
backward. Everything but the fold is torch ops, and is traced as it runs.

The fold depends on the device (``_use_triton``, line 48): on CUDA with Triton it is
``_forward_kernel`` and ``_backward_kernel`` (lines 79 and 151), one program per token that
keeps its state in registers and ``tl.store``s only into the tensors it is given, so it
allocates nothing; elsewhere it is the torch fallback ``_forward_tile``/``_backward_tile``
(lines 211 and 257), whose fp32 temporaries are each the size of a tile (about 94% of the
CPU step's peak in tests/test_integrations_trl.py). A trace runs on meta tensors, which
take the fallback. So on the CUDA target, while tracing, the fallback's two functions are
replaced by stand-ins that allocate nothing, as the kernels do; on the CPU target the
fallback is what really runs, and is traced as it is (measured within 2%). Likewise the
backward's gradient GEMMs (``_addmm_fp32``, line 52): on CUDA a bf16/fp16 tile goes into the
fp32 accumulator through ``addmm``'s ``out_dtype`` (line 60), elsewhere both operands are first
copied to fp32 (line 62), a tile-sized copy each; the CUDA target traces the CUDA branch.

Known limitations:
    On CUDA the real head scores only the positions whose label is not -100 (``compact``,
    utils.py:1642, ``hidden_states[mask]``); on meta it scores every position
    (``reshape``). With memcheck's worst-case batch every position has a label, so the
    two select the same tokens; their index tensors differ by a few bytes per token.
    Not measured: no GPU was available; the stand-ins follow the kernels' source.
"""

from __future__ import annotations

import contextlib
import sys

import torch

from memcheck.enums import Device

MODULE = "trl.kernels.chunked_logprob"
_FOLDS = ("_forward_tile", "_backward_tile")
_LOW = (torch.float16, torch.bfloat16)


@contextlib.contextmanager
def tracing(tracer, device: Device):
    """While tracing for CUDA, TRL's fused head as it runs on CUDA: the folds allocate nothing
    (the tracer lists the assumption once one runs), and the gradient GEMMs accumulate into
    fp32 without a copy. A no-op when TRL's kernels module is not loaded, or on the CPU target."""
    module = sys.modules.get(MODULE)
    names = (*_FOLDS, "_addmm_fp32")
    if module is None or Device.parse(device) is not Device.CUDA or not all(hasattr(module, n) for n in names):
        yield
        return
    saved = {name: getattr(module, name) for name in names}

    def fold_in_registers(*args, **kwargs) -> None:  # its outputs are the buffers passed in
        tracer.assume("TRL's fused LM head: each logits tile folded by its Triton kernels, which allocate nothing "
                      "(trl/kernels/chunked_logprob.py _forward_kernel, _backward_kernel)")

    def addmm_fp32(acc, a, b) -> None:
        # chunked_logprob.py:59-60: on CUDA, bf16/fp16 tiles go through addmm's out_dtype into
        # the fp32 accumulator; meta takes the other branch, which copies both tiles to fp32
        if a.dtype in _LOW and acc.dtype == torch.float32:
            torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
        else:
            saved["_addmm_fp32"](acc, a, b)

    for name in _FOLDS:
        setattr(module, name, fold_in_registers)
    module._addmm_fp32 = addmm_fp32
    try:
        yield
    finally:
        for name, original in saved.items():
            setattr(module, name, original)
