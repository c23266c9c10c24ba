"""cuDNN convolutions on the CUDA target: the workspace each call takes from the caching allocator.

What PyTorch does (``aten/src/ATen/native/cudnn/Conv_v8.cpp``, the cuDNN v8/v9 frontend path
every cuDNN >= 8 build takes unless ``TORCH_CUDNN_V8_API_DISABLED=1``; read from pytorch main
as mirrored at cyyever/pytorch@0d188885, the 2.11-2.13 line: the function names below are
that file's, line numbers are not given because the exact 2.11 tag could not be read here):

* ``run_single_conv`` looks the convolution up in a thread-local ``BenchmarkCache`` keyed by
  the shapes, strides, dtype, layout, alignments, ``deterministic`` and ``allow_tf32``
  (``CacheKeyWrapper``; an LRU of ``TORCH_CUDNN_V8_API_LRU_CACHE_LIMIT`` = 10,000 plans). A
  hit runs the cached plan. So every step after the first runs the plan the first chose.
* ``benchmark=False`` (the default; ``benchmark/gpu_accuracy.py`` never sets it): the
  heuristics (``CUDNN_HEUR_MODE_INSTANT``, or ``_B`` with ``TORCH_CUDNN_USE_HEURISTIC_MODE_B``)
  give their top engine config first (``get_configs_from_heuristics`` with one config), then
  all heuristic configs, then cuDNN's fallback list, each filtered by ``filterEngineConfigs``
  (no ``DOWN_CONVERT_INPUTS`` engine; for fp32 no tensor-core engine unless ``allow_tf32``; with
  ``deterministic`` no non-deterministic one). ``try_configs`` builds a plan and calls
  ``run_conv_plan``, which allocates ``plan.getWorkspaceSize()`` bytes with
  ``c10::cuda::CUDACachingAllocator::get()->allocate`` and frees them when the call returns;
  a ``c10::OutOfMemoryError`` from that allocation (or a cuDNN error) moves on to the next
  config. The first that runs is cached.
* ``benchmark=True``: ``get_plans_from_find`` builds every plan (heuristic and fallback),
  keeps those whose workspace is at most ``get_available_workspace()`` -- ``cacheInfo``'s
  largest block, which starts from ``cudaMemGetInfo``'s free bytes -- and
  ``generate_and_filter_plans`` allocates ONE workspace as large as the largest of them
  (halving it on an OOM and dropping the plans that no longer fit). Every plan is timed with
  it (``time_sorted_plan``), the block is freed, ``emptyCache()`` releases the cached
  segments (``_cudnn_get_conv_benchmark_empty_cache()``, on by default), and ``try_plans``
  runs the fastest with its own workspace. That happens once per distinct convolution.
* The freed workspace block stays cached: ``max_memory_reserved`` keeps the segment it was
  carved from, and later tensors are carved from it.
* ``CUDNN_CONV_WSCAP_DBG`` is read by cuDNN, not PyTorch (PyTorch's
  ``docs/source/cuda_environment_variables.rst`` lists it as cuDNN's per-allocation workspace
  cap): engines needing more than that many MiB are not offered.

What memcheck models, and what is an ASSUMPTION (the engine cuDNN's heuristics pick is not
knowable without the GPU):

* Each cuDNN forward, backward-data and backward-filter call is a transient, named block
  (``"cuDNN workspace: conv forward"`` ...) allocated after the call's output and freed
  before the next op, through the allocator simulation. Backward allocates grad_input, its
  workspace, then grad_weight's workspace, as ``cudnn_convolution_backward`` calls the two
  one after the other.
* Its size, :func:`heuristic_workspace_bytes`, ASSUMES the top heuristic engine is a tensor-core
  implicit-GEMM engine, which computes in NHWC: a tensor-core kernel needs channels in NHWC
  order (NVIDIA's Deep Learning Performance Guide, "Tensor Layouts in Memory: NCHW vs NHWC":
  NCHW data is transposed to NHWC around tensor-core convolutions, "the transpose kernels"),
  so each of the call's three tensors that is not channels-last is copied into the workspace
  in NHWC, its channels padded to 16 bytes (8 fp16/bf16 or 4 TF32 channels: the guide's
  channel-multiple rule). A channels-last call needs no copy and is taken as 0 bytes. A call
  without tensor cores (fp32 with ``allow_tf32=False``, fp64) is taken as 0 bytes (the
  native-NCHW implicit-GEMM engines). Not modelled: split-K partials, precomputed-index
  buffers, FFT and Winograd engines.
* ``benchmark=True`` adds the search block on each distinct convolution's first call:
  :func:`search_workspace_bytes`, the larger of the NHWC copies and the explicit-GEMM
  (im2col) engine's column buffer, ``N * C * prod(kernel) * prod(output spatial)`` elements,
  the largest workspace among the classic algorithms whose size can be written down; FFT
  engines can need more, so it is a lower bound of the real search block. The
  ``emptyCache()`` after the search is not modelled (the simulation keeps the segments, so
  its reserved figure is the higher). The chosen plan is then assumed to need what the
  heuristic one does.
* The OOM fallback to the next config is not modelled: memcheck keeps the top config's
  workspace, the larger, so a fit verdict does not depend on it.

``benchmark`` is a parameter of :func:`conv_workspace_calls` with ``False`` the default. The
dispatch rules read it from the tracer (``ctx.cudnn_benchmark``, absent = False): a job
setting reaches it by ``tracer.cudnn_benchmark = job.cudnn_benchmark`` where the tracer is
built (``memcheck/engine/estimate.py``, ``MemoryTracer(device, arch=...)``, and
``memcheck/engine/script.py``). ``allow_tf32`` is taken as torch's default, True, and
``deterministic`` is not modelled (it only drops engines; the NHWC assumption is unchanged).
"""

from __future__ import annotations

import math
import os
import weakref
from dataclasses import dataclass

import torch

from memcheck.compat import suggest_memory_format
from memcheck.enums import Device
from memcheck.errors import UsageError
from memcheck.units import MiB

WSCAP_ENV = "CUDNN_CONV_WSCAP_DBG"  # cuDNN's workspace cap, MiB
CHANNEL_ALIGN_BYTES = 16  # tensor-core kernels read channels in 16-byte vectors: 8 fp16 or 4 tf32

FORWARD = "forward"
BACKWARD_DATA = "backward data"
BACKWARD_FILTER = "backward filter"
KINDS = (FORWARD, BACKWARD_DATA, BACKWARD_FILTER)


def workspace_name(kind: str) -> str:
    """The block's name in a snapshot: ``"cuDNN workspace: conv forward"``."""
    return f"cuDNN workspace: conv {kind}"


def search_name(kind: str) -> str:
    """The benchmark search's block name: ``"cuDNN benchmark search workspace: conv forward"``."""
    return f"cuDNN benchmark search workspace: conv {kind}"


@dataclass(frozen=True)
class WorkspaceCall:
    """One block a cuDNN convolution call allocates and frees: its name and bytes."""

    name: str
    nbytes: int


def wscap_bytes(environ=None) -> int | None:
    """``CUDNN_CONV_WSCAP_DBG`` (MiB) in bytes, None when unset.

    Raises:
        UsageError: naming the value, when it is not a non-negative integer.
    """
    value = (os.environ if environ is None else environ).get(WSCAP_ENV)
    if value is None or value.strip() == "":
        return None
    value = value.strip()
    if not (value.isascii() and value.isdigit()):
        raise UsageError(f"{WSCAP_ENV}={value!r} is not a whole number of MiB")
    return int(value) * MiB


def _channels_last(t: torch.Tensor) -> bool:
    if t.dim() == 4:
        return t.is_contiguous(memory_format=torch.channels_last) and not t.is_contiguous()
    if t.dim() == 5:
        return t.is_contiguous(memory_format=torch.channels_last_3d) and not t.is_contiguous()
    return False


def uses_tensor_cores(dtype: torch.dtype, allow_tf32: bool = True) -> bool:
    """Whether cuDNN may take a tensor-core engine: fp16/bf16 always, fp32 when TF32 is allowed
    (``filterEngineConfigs`` drops tensor-core engines for fp32 only when ``allow_tf32`` is off;
    ``torch.backends.cudnn.allow_tf32`` defaults to True)."""
    return dtype in (torch.float16, torch.bfloat16) or (dtype == torch.float32 and allow_tf32)


def nhwc_copy_bytes(t: torch.Tensor) -> int:
    """Bytes of an NHWC copy of NCHW ``t`` with its channels (dim 1) padded to 16 bytes; 0 for a
    channels-last tensor (no copy).

    Example: (32, 3, 224, 224) fp32 -> 4 channels: 32 * 4 * 224 * 224 * 4 B = 25,690,112 B.
    """
    if t.dim() < 3 or _channels_last(t):
        return 0
    size = t.element_size()
    align = max(1, CHANNEL_ALIGN_BYTES // size)
    channels = -(-t.shape[1] // align) * align
    return math.prod(t.shape) // max(t.shape[1], 1) * channels * size if t.shape[1] else 0


def heuristic_workspace_bytes(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, *,
                              allow_tf32: bool = True, cap: int | None = None) -> int:
    """The workspace memcheck assumes for one call of the heuristic (``benchmark=False``) plan.

    ``a, b, c`` are the call's three tensors in any order (x, w, y for forward; dx, w, dy for
    backward data; x, dw, dy for backward filter). With tensor cores: the NHWC copies of
    the NCHW ones (:func:`nhwc_copy_bytes`); without: 0. ``cap`` (``CUDNN_CONV_WSCAP_DBG``
    in bytes) bounds it.
    """
    if not uses_tensor_cores(a.dtype, allow_tf32):
        return 0
    total = sum(nhwc_copy_bytes(t) for t in (a, b, c))
    return total if cap is None else min(total, cap)


def im2col_bytes(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> int:
    """The explicit-GEMM engine's column buffer: N * C * prod(kernel) * prod(output spatial) elements
    of x's dtype (``CUDNN_CONVOLUTION_FWD_ALGO_GEMM``; the same matrix for the backward calls).

    Example: x (32, 64, 224, 224), w (64, 64, 3, 3), y (32, 64, 224, 224) fp32:
    32 * 64 * 9 * 50,176 * 4 B = 3,699,376,128 B.
    """
    n, c = x.shape[0], x.shape[1]
    return n * c * math.prod(w.shape[2:]) * math.prod(y.shape[2:]) * x.element_size()


def search_workspace_bytes(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, *,
                           allow_tf32: bool = True, cap: int | None = None) -> int:
    """The one block ``generate_and_filter_plans`` allocates for ``benchmark=True``'s search:
    the largest workspace among the plans, here the larger of the NHWC copies and the im2col
    buffer (a lower bound: FFT engines can need more). ``cap`` bounds it."""
    total = max(heuristic_workspace_bytes(x, w, y, allow_tf32=allow_tf32), im2col_bytes(x, w, y))
    return total if cap is None else min(total, cap)


def conv_workspace_calls(kind: str, x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, *,
                         benchmark: bool = False, first_call: bool = True, allow_tf32: bool = True,
                         cap: int | None = None) -> tuple[WorkspaceCall, ...]:
    """The blocks one cuDNN convolution call allocates and frees, in order.

    Args:
        kind: ``FORWARD``, ``BACKWARD_DATA`` or ``BACKWARD_FILTER``.
        x, w, y: tensors of the forward convolution's input, weight and output shapes (for
            backward data, grad_input, weight and grad_output; for backward filter, input,
            grad_weight and grad_output: the same three shapes).
        benchmark: ``torch.backends.cudnn.benchmark``; default False, as torch's.
        first_call: the first call of this convolution in the process (benchmark's search runs then).
        allow_tf32: ``torch.backends.cudnn.allow_tf32`` (default True).
        cap: ``CUDNN_CONV_WSCAP_DBG`` in bytes, None when unset.

    Raises:
        UsageError: for an unknown ``kind``.

    Example:
        >>> x = torch.empty(32, 64, 56, 56, dtype=torch.float16, device="meta")
        >>> w = torch.empty(64, 64, 3, 3, dtype=torch.float16, device="meta")
        >>> [c.nbytes for c in conv_workspace_calls(FORWARD, x, w, x)]  # 2 x 12,845,056 + 73,728
        [25763840]
    """
    if kind not in KINDS:
        raise UsageError(f"cuDNN convolution kind {kind!r} is not one of {', '.join(KINDS)}")
    calls = []
    if benchmark and first_call:
        calls.append(WorkspaceCall(search_name(kind), search_workspace_bytes(x, w, y, allow_tf32=allow_tf32,
                                                                             cap=cap)))
    calls.append(WorkspaceCall(workspace_name(kind), heuristic_workspace_bytes(x, w, y, allow_tf32=allow_tf32,
                                                                               cap=cap)))
    return tuple(c for c in calls if c.nbytes > 0)


def note(benchmark: bool, cap: int | None) -> str:
    """The report's line on how cuDNN workspaces were counted."""
    text = ("cuDNN convolution workspaces: assumed a tensor-core engine that copies NCHW tensors to NHWC "
            "in its workspace (16-byte channel padding), a block per call freed on return "
            "(Conv_v8.cpp run_conv_plan); the engine cuDNN's heuristics pick is not known without the GPU")
    if benchmark:
        text += ("; cudnn.benchmark=True: each convolution's first call also allocates a search block at "
                 "least the im2col buffer (the search can take up to the free memory; its emptyCache() is "
                 "not modelled)")
    if cap is not None:
        text += f"; capped at {WSCAP_ENV}={cap // MiB} MiB"
    return text


# -- the dispatch side -------------------------------------------------------------------------
# Distinct convolutions seen per tracer, for benchmark mode's once-per-convolution search.
_SEEN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _key(kind: str, *tensors: torch.Tensor) -> tuple:
    """The plan cache's key of one call: shapes, dtypes and memory format, not strides, since
    ATen makes every tensor contiguous in the convolution's memory format before cuDNN sees it
    (``cudnn_convolution_backward_weight``: ``grad_output.contiguous(layout)``), so an expanded
    gradient (the backward of ``sum()``) hits the plan the same shape's contiguous one made."""
    return (kind,) + tuple((tuple(t.shape), t.dtype, suggest_memory_format(t)) for t in tensors)


def is_depthwise(inp: torch.Tensor, weight: torch.Tensor, groups: int) -> bool:
    """A depthwise convolution (groups == in_channels > 1), which ATen sends to its own CUDA kernels
    (``ConvBackend::CudaDepthwise2d/3d``) unless ``use_cudnn_depthwise`` (Convolution.cpp) picks
    cuDNN for some fp16 shapes; memcheck takes the native kernel, which has no workspace."""
    return groups > 1 and inp.dim() >= 3 and inp.shape[1] == groups and weight.shape[1] == 1


def cudnn_convolution_scratch(ctx, calls: list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
    """Emit the workspace blocks of one convolution op on the CUDA target, call by call.

    ``calls``: ``(kind, x, w, y)`` per cuDNN call the op makes, in its order, with tensors of
    the forward input, weight and output shapes. The op's outputs must already be tracked
    (``ctx.track``). Reads ``ctx.cudnn_benchmark`` (absent: False) and ``CUDNN_CONV_WSCAP_DBG``.
    """
    if ctx.device is not Device.CUDA or not calls:
        return
    benchmark = bool(getattr(ctx, "cudnn_benchmark", False))
    cap = wscap_bytes()
    ctx.assume(note(benchmark, cap))
    seen = _SEEN.setdefault(ctx, set())
    for kind, x, w, y in calls:
        key = _key(kind, x, w, y)
        first = key not in seen
        seen.add(key)
        for call in conv_workspace_calls(kind, x, w, y, benchmark=benchmark, first_call=first, cap=cap):
            ctx.scratch(call.nbytes, name=call.name)
