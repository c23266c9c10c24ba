"""The choices memcheck knows, as enums parsed from user strings with clear errors, and the
kinds of the tracer's memory events."""

from __future__ import annotations

import enum
from typing import Any, NamedTuple

from memcheck.errors import UsageError, closest


class _Choice(str, enum.Enum):
    """An enum whose values are the strings users type."""

    @classmethod
    def parse(cls, value, *, what: str | None = None):
        """Return the member for ``value`` (a member or its string), or raise UsageError listing the allowed values."""
        if isinstance(value, cls):
            return value
        text = str(value).strip().lower()
        for member in cls:
            if member.value == text:
                return member
        allowed = [m.value for m in cls]
        label = what or cls.__name__.lower()
        raise UsageError(
            f"unknown {label} {value!r}{closest(text, allowed)}; allowed: {', '.join(allowed)}"
        )

    def __str__(self) -> str:
        return self.value


class Category(_Choice):
    """What a byte of memory is for. Every traced byte is in exactly one category."""

    PARAMETER = "params"
    BUFFER = "buffers"
    GRADIENT = "grads"
    OPTIMIZER = "optimizer"
    ACTIVATION = "activations"  # saved by autograd for backward
    TEMPORARY = "temporaries"  # alive now, not saved for backward, not a result
    OUTPUT = "outputs"  # the model's outputs and the loss
    INPUT = "inputs"  # the batch
    WORKSPACE = "workspaces"  # library workspaces held by the caching allocator (cuBLAS)
    COMMUNICATION = "communication"  # multi-GPU buffers: DDP buckets, all-gather / reduce-scatter buffers
    OTHER = "other"  # tensors that existed before the trace and belong to none of the above


class Phase(_Choice):
    """Where in a training step an event happened."""

    SETUP = "setup"
    FORWARD = "forward"
    LOSS = "loss"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer_step"
    ZERO_GRAD = "zero_grad"
    EVAL = "eval"


class Device(_Choice):
    """The device the estimate is for. Tracing itself always runs on the meta device."""

    CPU = "cpu"
    CUDA = "cuda"


class Precision(_Choice):
    """Training precision. ``bf16``/``fp16`` mean pure low-precision weights.

    Lightning's names are accepted for the same thing (``PRECISION_ALIASES``):
    ``bf16-mixed`` and ``16-mixed`` are autocast (``amp-bf16``, ``amp-fp16``), ``bf16-true``
    and ``16-true`` pure low-precision weights, ``32-true`` and ``32`` fp32. Lightning's
    legacy ``"bf16"`` meant ``"bf16-mixed"``; here ``bf16`` is pure bf16.
    """

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"
    AMP_BF16 = "amp-bf16"
    AMP_FP16 = "amp-fp16"

    @classmethod
    def parse(cls, value, *, what: str | None = None):
        text = str(getattr(value, "value", value)).strip().lower()
        return super().parse(PRECISION_ALIASES.get(text, value), what=what)

    @property
    def weights_dtype(self):
        """The dtype of pure low-precision weights, or None (fp32 weights)."""
        import torch

        return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.value)

    @property
    def autocast_dtype(self):
        """The dtype ``torch.autocast`` runs in, or None without autocast."""
        import torch

        return {"amp-bf16": torch.bfloat16, "amp-fp16": torch.float16}.get(self.value)


class WeightsDtype(_Choice):
    """The dtype the model's weights are created in (``--weights-dtype``); ``auto``: the
    model's own (for ``hf:``, what ``from_pretrained`` picks by default: config.json's dtype)."""

    AUTO = "auto"
    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"

    @property
    def torch_dtype(self):
        """The torch dtype, or None for ``auto``."""
        import torch

        return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}.get(self.value)


class Dtype(_Choice):
    """A floating-point dtype a wrapper casts to: FSDP2's ``MixedPrecisionPolicy`` and FSDP1's
    ``MixedPrecision`` fields (``--param-dtype``, ``--reduce-dtype``, ...). torch's names are
    accepted too (``DTYPE_ALIASES``: ``bfloat16``, ``torch.float32``, a ``torch.dtype``), as
    torchtitan's ``mixed_precision_param = "bfloat16"`` writes them."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"

    @classmethod
    def parse(cls, value, *, what: str | None = None):
        text = str(getattr(value, "value", value)).strip().lower()  # a torch.dtype prints as torch.bfloat16
        return super().parse(DTYPE_ALIASES.get(text.removeprefix("torch."), value), what=what)

    @property
    def torch_dtype(self):
        import torch

        return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[self.value]


# torch's dtype names (torch.bfloat16 prints as "torch.bfloat16"), as torchtitan, Accelerate and Lightning write them
DTYPE_ALIASES = {"float32": "fp32", "float": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16"}


# Lightning Trainer(precision=...) names for memcheck's precisions (lightning/fabric/plugins/precision/precision.py:24-36:
# "32" means "32-true" and "16" "16-mixed"; its legacy "bf16" alias, "bf16-mixed", is not taken: here bf16 is pure).
PRECISION_ALIASES = {"bf16-mixed": "amp-bf16", "16-mixed": "amp-fp16", "16": "amp-fp16", "bf16-true": "bf16",
                     "16-true": "fp16", "32-true": "fp32", "32": "fp32"}


class Strategy(_Choice):
    """How training is spread over GPUs (``--strategy``)."""

    SINGLE = "single"
    DP = "dp"
    DP_BALANCED = "dp-balanced"
    DDP = "ddp"
    FSDP = "fsdp"
    FSDP1 = "fsdp1"
    ZERO1 = "zero1"
    ZERO2 = "zero2"
    ZERO3 = "zero3"

    @property
    def multi_gpu(self) -> bool:
        return self is not Strategy.SINGLE


class FsdpSharding(_Choice):
    """fsdp1's ``sharding_strategy`` (``--fsdp-sharding``): torch's ``ShardingStrategy`` members,
    lower case (torch/distributed/fsdp/api.py ``ShardingStrategy``; the same words as HF
    ``TrainingArguments.fsdp``'s options)."""

    FULL_SHARD = "full_shard"
    SHARD_GRAD_OP = "shard_grad_op"
    NO_SHARD = "no_shard"
    HYBRID_SHARD = "hybrid_shard"


class Schedule(_Choice):
    """A pipeline schedule of ``torch.distributed.pipelining.schedules`` (``--layout ...,schedule=``)."""

    GPIPE = "gpipe"  # ScheduleGPipe
    ONE_F_ONE_B = "1f1b"  # Schedule1F1B
    INTERLEAVED_1F1B = "interleaved-1f1b"  # ScheduleInterleaved1F1B
    ZERO_BUBBLE = "zero-bubble"  # ScheduleInterleavedZeroBubble


class Offload(_Choice):
    """What ``--offload`` moves to CPU memory under fsdp / zero."""

    NONE = "none"
    OPTIMIZER = "optimizer"
    PARAMS = "params"


class StepOrder(_Choice):
    """The order of one training step's zero_grad, forward, backward, clipping and optimizer step
    (``--step-order``), named after the loop that runs it. Every one frees the gradients with
    ``zero_grad(set_to_none=True)``; what differs is whether they are alive through the forward.

    - ``hf``: forward, backward, clip, step, zero_grad. The HF Trainer (transformers 5.23,
      trainer.py: ``model.zero_grad()`` at :1651 before the first step and at :1946 after
      ``optimizer.step()`` at :1935; the clipping at :1928-1931; ``training_step`` runs forward at
      :2081 and backward at :2118), and memcheck's own loop: the default.
    - ``accelerate``: the same sequence, as Accelerate's ``accumulate`` loop runs it (accelerate
      1.15: accelerator.py:1256 ``accumulate`` and its docstring's loop; ``AcceleratedOptimizer.step``
      and ``zero_grad`` do nothing until the window's last micro-batch, optimizer.py:113 and :169;
      ``zero_grad`` passes ``set_to_none=True``, optimizer.py:116-118).
    - ``plain``: zero_grad, forward, backward, clip, step: the textbook PyTorch loop. The gradients
      are freed at the same point as in ``hf`` (between the step and the next forward), so the
      peak is the same; traced in its own order all the same.
    - ``lightning``: forward, zero_grad, backward, clip, step: Lightning's automatic optimization
      (lightning 2.6.6, loops/optimization/automatic.py: ``Closure.closure`` runs ``training_step``
      at :131, then ``zero_grad`` at :137, then backward at :140; the closure runs inside
      ``optimizer.step(closure=...)``, plugins/precision/precision.py:123, which clips after it,
      :109 and :89; ``zero_grad`` only on a window's first micro-batch, automatic.py:220-222).
      The previous step's gradients are alive through the next forward.
    """

    HF = "hf"
    ACCELERATE = "accelerate"
    PLAIN = "plain"
    LIGHTNING = "lightning"


class Padding(_Choice):
    """How the job's batches are padded: every one to ``max_len``, or each to its longest
    sample (a tokenizer's or collator's ``padding=True``/``"longest"``), so lengths vary."""

    MAX_LENGTH = "max_length"
    LONGEST = "longest"


class Task(_Choice):
    """What a transformers model is trained for; decides the worst-case batch's labels (its
    inputs follow the model's ``main_input_name``: token ids, pixels, log-mel features, raw audio).

    ``seq2seq`` covers speech encoder-decoders (Whisper) and ``classification`` audio
    classifiers; ``ctc`` is speech recognition with a CTC head (Wav2Vec2, HuBERT);
    ``contrastive`` is image-text training with the model's own loss (CLIP, SigLIP:
    ``return_loss=True``).
    """

    CAUSAL_LM = "causal-lm"
    MASKED_LM = "masked-lm"
    SEQ2SEQ = "seq2seq"
    CLASSIFICATION = "classification"
    IMAGE_CLASSIFICATION = "image-classification"
    CTC = "ctc"
    CONTRASTIVE = "contrastive"


class Attention(_Choice):
    """transformers ``attn_implementation`` values memcheck can trace."""

    EAGER = "eager"
    SDPA = "sdpa"


# The kinds of the tracer's memory events (``memcheck.trace.tracer.TraceLog.events``): a storage
# allocated, freed, or given a new category (RECAT, nbytes 0). The allocator simulation and the
# timeline read them too, so they live here, below both.
ALLOC, FREE, RECAT = 0, 1, 2

# The host threads that hold a cuBLAS handle (and its workspace) in a traced step
# (``TraceLog.blas_first``, ``memcheck.cuda.replay.with_workspaces``).
AUTOGRAD_THREAD = "autograd thread"  # backward's ops run on autograd's device thread
MAIN_THREAD = "main thread"  # every other phase's, on the Python thread


class Event(NamedTuple):
    """One memory event of a trace (``memcheck.trace.tracer.TraceLog.events``), as the allocator
    simulation, its process-life replay and the timeline read it. A plain tuple of the first
    fields stands for one (``Event(*t)``; the tests' allocator sequences are ``(kind, sid, nbytes)``)."""

    kind: int  # ALLOC, FREE or RECAT
    sid: Any  # the storage's key; reused after its FREE
    nbytes: int  # the request (0 for RECAT)
    category: Any = None  # a Category
    module: str | None = None  # the module it was made in (ALLOC) or moved to (RECAT)
    phase: Any = None  # the Phase it happened in
    step: int = 0  # the training step, from 0
    gpu: int = 0  # the traced device it lives on
    stream: int = 0  # the CUDA stream an ALLOC is made on
