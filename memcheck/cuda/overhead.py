"""Memory a CUDA training step uses that is not a traced tensor: BLAS and cuDNN
workspaces, and the CUDA context.

Sources are PyTorch's C++ files as of torch 2.11-2.13 (checked against the headers and
Python of the installed torch 2.13.0; the .cpp files were read from pytorch/pytorch
versions of early-to-mid 2026, see each constant):

* ``aten/src/ATen/cuda/CublasHandlePool.cpp`` — cuBLAS/cuBLASLt workspaces.
  ``setWorkspaceForHandle`` allocates one workspace per (cuBLAS handle, stream) with
  ``c10::cuda::CUDACachingAllocator::get()->allocate(getChosenWorkspaceSize())``, keeps it
  in ``cublas_handle_stream_to_workspace()`` for the life of the process, and binds it
  with ``cublasSetWorkspace``. So it is counted by ``torch.cuda.memory_allocated()`` and
  ``max_memory_reserved()`` (pytorch#95668: one ``nn.Linear`` call on an A10G left
  8,519,680 B allocated, exactly ``:4096:2:16:8``).
* Handles come from a ``DeviceThreadHandlePool``: each host thread reserves its own
  handle per device. A training step calls cuBLAS from two threads per GPU: the forward
  runs on the Python thread, and ``loss.backward()`` runs its CUDA work on the autograd
  engine's thread for that device (``torch/csrc/autograd/engine.cpp``
  ``start_device_threads``: "allocate one thread for every GPU device"). Both use the
  same (default) stream, so after one step there are two cuBLAS workspaces per GPU.
* cuBLASLt (``addmm`` with a bias epilogue, ``_scaled_mm`` ...): on CUDA builds the Lt
  handle is the cuBLAS handle cast, and with ``TORCH_CUBLASLT_UNIFIED_WORKSPACE`` unset
  (the default outside fbcode, PR #168175 / #175879) ``getCUDABlasLtWorkspace`` returns
  the cuBLAS workspace of the same (handle, stream): no extra memory. The installed
  torch 2.13 says so in ``torch/backends/cuda/__init__.py`` (``blas_workspace_size``
  note: "the default on open-source CUDA builds ... physically reuses the same
  allocation"). With ``TORCH_CUBLASLT_UNIFIED_WORKSPACE=0`` there is a second map,
  ``cublaslt_handle_stream_to_workspace()``, of ``CUBLASLT_WORKSPACE_SIZE`` KiB each.
* cuDNN convolution workspaces are per-call blocks of the traced step, not a fixed
  overhead: ``memcheck.rules.cuda_conv``.

Known limitations:
    ``torch.backends.cuda.cublas_workspace_size(n)`` (torch 2.13) overrides the
    environment at run time; memcheck cannot see it. After torch 2.13, pytorch/pytorch
    main (PR #194311, Aug 2026) adds ``TORCH_CUBLAS_WORKSPACE_CACHE``, default off on
    CUDA, under which workspaces become per-call allocations instead of persistent ones;
    :func:`workspace_allocations` describes the 2.11-2.13 behaviour.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

from memcheck.cuda.gpus import GENERIC_CONTEXT_BYTES, GENERIC_CONTEXT_SOURCE, GpuSpec
from memcheck.errors import UsageError
from memcheck.units import KiB, MiB

# CublasHandlePool.cpp parseChosenWorkspaceSize: "/* :4096:2:16:8 default, 32MiB for Hopper
# and Blackwell */" -> 4096 * 1024 * 2 + 16 * 1024 * 8 bytes = 8 MiB + 128 KiB = 8,519,680 B.
CUBLAS_WORKSPACE_DEFAULT = 4096 * KiB * 2 + 16 * KiB * 8
# Same function: 4096 * 8 * 1024 bytes = 32 MiB when properties->major is 9, 10, 11 or 12.
CUBLAS_WORKSPACE_LARGE = 4096 * KiB * 8
# sm90 since PR #89027 (2022); Blackwell majors 10 and 12 since PR #175344 (Feb 2026, so in
# torch 2.11 or 2.12 onwards: not verified which); major 11 (Thor) appears later in main.
# On torch <= 2.10 a Blackwell GPU gets CUBLAS_WORKSPACE_DEFAULT.
_LARGE_WORKSPACE_MAJORS = frozenset({9, 10, 11, 12})
# CublasHandlePool.cpp parseCUDABlasLtWorkspaceSize: "size_t workspace_size = 1024; /* default
# size in KiB according to #73328 */", read from CUBLASLT_WORKSPACE_SIZE in KiB.
CUBLASLT_WORKSPACE_DEFAULT = 1024 * KiB
# Host threads that call cuBLAS on one GPU in a training step: the Python thread (forward,
# loss) and the autograd engine's device thread (backward).
BLAS_THREADS = 2
_THREAD_LABELS = ("main thread", "autograd thread")

_CONFIG = re.compile(r"(?::[0-9]+:[0-9]+)+")
_PAIR = re.compile(r":([0-9]+):([0-9]+)")


def _environ(env: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if env is None else env


def _check_arch(arch) -> tuple[int, int]:
    try:
        major, minor = arch
    except (TypeError, ValueError):
        raise UsageError(f"compute capability {arch!r} must be two integers, such as (9, 0)") from None
    if not isinstance(major, int) or not isinstance(minor, int):
        raise UsageError(f"compute capability {arch!r} must be two integers, such as (9, 0)")
    return major, minor


def parse_cublas_workspace_config(value: str) -> int:
    """Bytes per workspace for a ``CUBLAS_WORKSPACE_CONFIG`` value: the sum of ``:SIZE_KiB:COUNT`` pairs.

    ``":4096:8"`` is 4096 KiB x 8 = 32 MiB; ``":4096:2:16:8"`` is 8 MiB + 128 KiB.
    torch finds the pairs with ``std::regex(":([0-9]+):([0-9]+)")`` anywhere in the
    string and falls back to the default, with a warning, when there is none; memcheck
    is stricter and accepts only a string made of such pairs.

    Raises:
        UsageError: naming the value when it is not of that form.
    """
    text = value.strip()
    if not _CONFIG.fullmatch(text):
        raise UsageError(
            f"CUBLAS_WORKSPACE_CONFIG {value!r} is not of the form :SIZE_KiB:COUNT[:SIZE_KiB:COUNT...], "
            "such as :4096:8 or :16:8"
        )
    return sum(int(size) * KiB * int(count) for size, count in _PAIR.findall(text))


def cublas_workspace_bytes(arch: tuple[int, int], env: Mapping[str, str] | None = None) -> int:
    """The size of each cuBLAS workspace torch allocates (``at::cuda::getChosenWorkspaceSize()``).

    Args:
        arch: the target's compute capability; majors 9-12 (Hopper, Blackwell) default to
            32 MiB, others to ``:4096:2:16:8`` = 8 MiB + 128 KiB.
        env: environment to read ``CUBLAS_WORKSPACE_CONFIG`` from (default ``os.environ``);
            set and non-empty, it replaces the default.

    Raises:
        UsageError: for a malformed ``CUBLAS_WORKSPACE_CONFIG`` or compute capability.
    """
    major, _ = _check_arch(arch)
    value = _environ(env).get("CUBLAS_WORKSPACE_CONFIG")
    if value is not None and value.strip():
        return parse_cublas_workspace_config(value)
    return CUBLAS_WORKSPACE_LARGE if major in _LARGE_WORKSPACE_MAJORS else CUBLAS_WORKSPACE_DEFAULT


def cublaslt_unified(env: Mapping[str, str] | None = None) -> bool:
    """Whether cuBLASLt reuses the cuBLAS workspace (``TORCH_CUBLASLT_UNIFIED_WORKSPACE``).

    Unset means unified on open-source builds (``unified_env_var == std::nullopt``);
    ``"1"`` unified, ``"0"`` separate. torch's ``c10::utils::check_env`` warns about and
    ignores other values (so they mean unified); memcheck rejects them.

    Raises:
        UsageError: for a value other than 0 or 1.
    """
    value = _environ(env).get("TORCH_CUBLASLT_UNIFIED_WORKSPACE")
    if value is None:
        return True
    if value.strip() not in ("0", "1"):
        raise UsageError(f"TORCH_CUBLASLT_UNIFIED_WORKSPACE {value!r} must be 0 or 1")
    return value.strip() == "1"


def cublaslt_workspace_bytes(arch: tuple[int, int], env: Mapping[str, str] | None = None) -> int:
    """The workspace size torch hands cuBLASLt (``at::cuda::getCUDABlasLtWorkspaceSize()``).

    ``CUBLASLT_WORKSPACE_SIZE`` in KiB, default 1024 KiB = 1 MiB on CUDA for every
    arch; when unified, capped at :func:`cublas_workspace_bytes`. (PR #173002, Mar 2026,
    makes the unified default the cuBLAS size instead of 1 MiB; that changes which Lt
    algorithms may run, not the memory, because the unified path hands out the cuBLAS
    workspace.) Only when not unified is this a separate allocation.

    Raises:
        UsageError: for a ``CUBLASLT_WORKSPACE_SIZE`` that is not a whole number of KiB.
    """
    value = _environ(env).get("CUBLASLT_WORKSPACE_SIZE")
    size = CUBLASLT_WORKSPACE_DEFAULT
    if value is not None and value.strip():
        if not value.strip().isdigit():
            raise UsageError(f"CUBLASLT_WORKSPACE_SIZE {value!r} must be a whole number of KiB, such as 1024")
        size = int(value.strip()) * KiB
    if cublaslt_unified(env):
        size = min(size, cublas_workspace_bytes(arch, env))
    return size


def workspace_allocations(
    arch: tuple[int, int], env: Mapping[str, str] | None = None, *, threads: int = BLAS_THREADS
) -> list[tuple[str, int]]:
    """The persistent BLAS workspaces a training step leaves on one GPU, as (label, bytes).

    Each is one caching-allocator block that lives until the process ends, made at the
    thread's first cuBLAS/cuBLASLt call (the first matmul of the forward, of the backward).

    Args:
        arch: the target's compute capability.
        env: environment to read (default ``os.environ``).
        threads: host threads that run matmuls on this GPU: 2 for a training step (the
            Python thread and autograd's device thread), 1 for forward-only work.

    Example:
        >>> workspace_allocations((9, 0), {})
        [('cuBLAS workspace (main thread)', 33554432), ('cuBLAS workspace (autograd thread)', 33554432)]

    Raises:
        UsageError: for a malformed environment value or a negative ``threads``.
    """
    if not isinstance(threads, int) or threads < 0:
        raise UsageError(f"threads {threads!r} must be a non-negative integer")
    labels = [_THREAD_LABELS[i] if i < len(_THREAD_LABELS) else f"thread {i + 1}" for i in range(threads)]
    out = []
    size = cublas_workspace_bytes(arch, env)
    if size > 0:
        out += [(f"cuBLAS workspace ({label})", size) for label in labels]
    if not cublaslt_unified(env):
        lt = cublaslt_workspace_bytes(arch, env)
        if lt > 0:
            out += [(f"cuBLASLt workspace ({label})", lt) for label in labels]
    return out


# CUDA module loading. Lazy loading (CUDA >= 11.7; torch >= 1.13 sets CUDA_MODULE_LOADING=LAZY
# when it is unset, pytorch/pytorch#86509; CUDA >= 12.2 loads lazily by default) puts a kernel
# into the context when it is first used, which the per-GPU figures assume. EAGER loads every
# kernel of the libraries when they load. pytorch#86509 measured, after a first tensor on the
# GPU (cudaMemGetInfo total - free): 287,047,680 B lazy against 666,632,192 B eager; the
# difference is added under EAGER. ptrblck (pytorch#107667): before 11.7 "all kernels were
# loaded into the context ... which took >1000MB".
EAGER_EXTRA_BYTES = 666_632_192 - 287_047_680  # 379,584,512 B


def module_loading() -> str:
    """``"eager"`` when ``CUDA_MODULE_LOADING=EAGER`` is set, else ``"lazy"`` (torch's default)."""
    return "eager" if os.environ.get("CUDA_MODULE_LOADING", "").strip().upper() == "EAGER" else "lazy"


def _check_gpu(gpu) -> None:
    if gpu is not None and not isinstance(gpu, GpuSpec):
        raise UsageError(f"expected a GpuSpec or None, got {gpu!r}")


def context_bytes(gpu: GpuSpec | None) -> int:
    """Device memory the CUDA context and libraries take outside the caching allocator.

    The GPU's table figure (``memcheck.cuda.gpus``: a published bare context plus the
    estimated kernels of a training step where one was published, else the estimate;
    :func:`context_source` says which), or ``GENERIC_CONTEXT_BYTES`` for None (no GPU
    named and none local), for lazy module loading; plus ``EAGER_EXTRA_BYTES`` when the
    environment asks for eager loading. The estimate and the planner both use this.

    Raises:
        UsageError: for something other than a GpuSpec or None.
    """
    _check_gpu(gpu)
    base = GENERIC_CONTEXT_BYTES if gpu is None else gpu.context_bytes
    return base + (EAGER_EXTRA_BYTES if module_loading() == "eager" else 0)


def context_source(gpu: GpuSpec | None) -> str:
    """Where :func:`context_bytes` comes from: ``"published: ..."`` or ``"estimated: ..."``
    (``GpuSpec.context_source``), with the eager-loading addition when it applies.

    Raises:
        UsageError: for something other than a GpuSpec or None.
    """
    _check_gpu(gpu)
    source = GENERIC_CONTEXT_SOURCE if gpu is None else gpu.context_source
    if module_loading() == "eager":
        source += f"; + {EAGER_EXTRA_BYTES / MiB:.0f} MiB for eager module loading (measured, pytorch#86509)"
    return source
