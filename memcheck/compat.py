"""Every private torch API memcheck uses, imported here and nowhere else (tests/test_layers.py
checks that no other module imports a private torch name or reads a ``torch._...`` attribute).

Each name says which torch versions have it and what stands in for it elsewhere. The versions are
those of the matrix of benchmarks/versions.py (virtualenvs with torch 2.6, 2.7, 2.8, 2.9, 2.10,
2.11, 2.12, 2.14 and 2.15 from the package index, 2.13 the CPU wheel the Makefile pins): "2.6+"
means every one of them. Older torch is outside the supported range (transformers 5 wants 2.6).

A name the running torch lacks is None here, or its stand-in. An estimate never needs one of
those: a setting that does (a real FSDP2 or context-parallel run, selective checkpointing)
asks ``memcheck.errors.require_torch``, which raises one ``TorchVersionError`` line naming the
setting and the torch it needs, from ``SINCE`` below.

The heavy or optional ones (torch.distributed's) are imported on first use (``__getattr__``), so
that importing memcheck imports no more of torch than an estimate needs.

Version-dependent behaviour that needs no name of its own, recorded here as the one place that
states what differs between minors:

* autograd nodes' Python wrappers: up to torch 2.12 a C++ node does not keep its wrapper alive
  (``functionToPyObject``, torch/csrc/autograd/python_cpp_function.cpp), so a dropped wrapper's
  address is reused by the next one and node ``id()``s are not unique over time; from 2.13 the
  node keeps it. Measured with a 101-node chain and an id-only walk: 2 or 3 nodes found on
  2.6-2.12, all 101 on 2.13-2.15. memcheck holds the nodes it compares by id on every version
  (``memcheck.trace.tracer.reachable_nodes``, ``_GradientSums``), so nothing here switches on it.
"""

from __future__ import annotations

import contextlib
import importlib
import re
import sys

import torch

__all__ = [  # the names present on every supported torch; the optional ones are in ``SINCE``
    "TORCH", "TORCH_VERSION", "SINCE", "tree_flatten", "tree_leaves", "tree_map", "tree_map_only", "tree_unflatten",
    "TorchDispatchMode", "disable_current_modes", "current_dispatch_modes", "current_function_modes",
    "flatten_dense_tensors", "take_tensors", "unflatten_dense_tensors", "grad_fn_or_grad_acc", "MultiHandle",
    "suggest_memory_format", "is_non_overlapping_and_dense_or_false", "engine_run_backward", "OpOverload",
    "OpOverloadPacket", "current_graph_task_id", "will_engine_execute_node", "current_autograd_node",
    "storage_use_count", "mkldnn_enabled", "VariableFunctions", "parse_to", "ProfilerDeviceType",
    "ExtraFieldsAllocation", "AccumulateGrad", "IndexBackward0", "DisableTorchFunction", "fused_sdp_choice",
    "amp_foreach_non_finite_check_and_unscale_", "amp_update_scale_", "queue_engine_callback",
    "cudnn_version_int", "default_device_type", "import_dynamo", "aten_op", "GROUPED_MM", "FUSED_RMS_NORM_CUDA",
    "compiled_parts", "eager_module", "eager_function", "uncompile_copy", "eager_stance",
    "no_function_modes", "inductor_partition_backend", "inductor_extern_ops", "no_global_module_hooks",
    "INDUCTOR_REALIZE",
]

_parts = re.match(r"(\d+)\.(\d+)", torch.__version__)
TORCH: tuple[int, int] = (int(_parts[1]), int(_parts[2])) if _parts else (0, 0)
"""The running torch's (major, minor)."""
TORCH_VERSION: str = torch.__version__

# --- Present on 2.6+ (every torch of the matrix) ---------------------------------------------

# torch.utils._pytree: 2.6+ (since 1.x).
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map, tree_map_only, tree_unflatten  # noqa: E402

# torch.utils._python_dispatch: 2.6+ (TorchDispatchMode since 1.13; the mode-stack helpers 2.0+).
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._python_dispatch import _disable_current_modes as disable_current_modes  # noqa: E402
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack as current_dispatch_modes  # noqa: E402

# torch.overrides: 2.6+.
from torch.overrides import _get_current_function_mode_stack as current_function_modes  # noqa: E402

# torch._utils (DDP's and DataParallel's bucketing helpers): 2.6+.
from torch._utils import _flatten_dense_tensors as flatten_dense_tensors  # noqa: E402
from torch._utils import _take_tensors as take_tensors  # noqa: E402
from torch._utils import _unflatten_dense_tensors as unflatten_dense_tensors  # noqa: E402

# torch.autograd.graph (register_multi_grad_hook's pieces): 2.6+.
from torch.autograd.graph import _get_grad_fn_or_grad_acc as grad_fn_or_grad_acc  # noqa: E402
from torch.autograd.graph import _MultiHandle as MultiHandle  # noqa: E402

# torch._prims_common: 2.6+.
from torch._prims_common import suggest_memory_format  # noqa: E402

# torch._prims_common.is_non_overlapping_and_dense_or_false: 2.11+ (2.10 and older:
# is_non_overlapping_and_dense, the same answer for the concrete shapes memcheck traces; the new
# name answers False where a symbolic shape leaves it undecided).
try:
    from torch._prims_common import is_non_overlapping_and_dense_or_false
except ImportError:
    from torch._prims_common import is_non_overlapping_and_dense as is_non_overlapping_and_dense_or_false

# torch.autograd.graph._engine_run_backward (the function that enters the autograd engine; stack
# records stop there): 2.6+. None elsewhere: the recorded stacks then keep the caller's frames.
try:
    from torch.autograd.graph import _engine_run_backward as engine_run_backward
except ImportError:  # pragma: no cover - older torch
    engine_run_backward = None

# torch._ops: 2.6+.
OpOverload = torch._ops.OpOverload
OpOverloadPacket = torch._ops.OpOverloadPacket

# torch._C bindings: 2.6+.
current_graph_task_id = torch._C._current_graph_task_id  # -1 outside a backward
will_engine_execute_node = torch._C._will_engine_execute_node
current_autograd_node = torch._C._current_autograd_node
storage_use_count = torch._C._storage_Use_Count
mkldnn_enabled = torch._C._get_mkldnn_enabled
VariableFunctions = torch._C._VariableFunctions
parse_to = torch._C._nn._parse_to  # Tensor.to's argument parser: (device, dtype, non_blocking, memory_format)
ProfilerDeviceType = torch._C._autograd.DeviceType
ExtraFieldsAllocation = torch._C._profiler._ExtraFields_Allocation
AccumulateGrad = torch._C._functions.AccumulateGrad
IndexBackward0 = torch._C._functions.IndexBackward0
DisableTorchFunction = torch._C.DisableTorchFunction  # a context manager: no torch-function mode inside

# Ops of torch's private namespace: 2.6+.
fused_sdp_choice = torch._fused_sdp_choice  # the SDPA kernel torch would choose (an int of SDPBackend)
amp_foreach_non_finite_check_and_unscale_ = torch._amp_foreach_non_finite_check_and_unscale_  # GradScaler.unscale_
amp_update_scale_ = torch._amp_update_scale_  # GradScaler.update


def queue_engine_callback(callback) -> None:
    """Run ``callback`` when the running backward ends (the autograd engine's
    ``queue_callback``, ``torch.autograd.Variable._execution_engine``: 2.6+)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


# --- aten ops and kernels that differ between minors -------------------------------------------

def aten_op(name: str):
    """``torch.ops.aten.<name>`` (an OpOverloadPacket), or None on a torch without that op."""
    return getattr(torch.ops.aten, name, None) if hasattr(torch.ops.aten, name) else None


# aten._grouped_mm (the grouped GEMM of mixture-of-experts layers, F.grouped_mm): 2.8+. Older
# torch has no such op to trace; its rule (memcheck.rules.grouped_mm) is then not registered.
GROUPED_MM = aten_op("_grouped_mm")

# rms_norm on a CUDA tensor calls the fused kernel ``_fused_rms_norm`` (one output and an fp32
# rstd; layer_norm.cpp) from 2.9: the 2.9.1+cu128 wheel registers a CUDA kernel for it and for
# ``_fused_rms_norm_backward``. 2.8 has the op with no CUDA kernel (its 2.8.0+cu128 wheel's
# dispatch table), 2.6 and 2.7 not the op: there rms_norm on CUDA is the composite of pow, mean,
# rsqrt and mul, which the trace runs as it is. Keyed on the version, not read from the dispatch
# table: the CPU wheels register no CUDA kernel at all, and memcheck predicts CUDA runs from them.
FUSED_RMS_NORM_CUDA: bool = TORCH >= (2, 9)


def cudnn_version_int() -> int | None:
    """The loaded cuDNN's version (``torch._C._cudnn.getVersionInt``; CUDA builds 2.6+), or None
    where the build has no cuDNN or its library does not load. Unlike
    ``torch.backends.cudnn.version()`` it initialises no CUDA device."""
    try:
        return int(torch._C._cudnn.getVersionInt()) or None
    except Exception:  # a CPU build (no torch._C._cudnn), or a broken install: never stop an estimate
        return None


def default_device_type() -> str | None:
    """The device type the caller made the default (``torch.set_default_device``, ``with
    torch.device(...)``), or None: torch's own record, ``torch.utils._device.CURRENT_DEVICE``
    (2.6+). ``torch.get_default_device()`` makes a tensor there to answer, which fails for
    ``cuda`` on a machine without CUDA."""
    device_module = importlib.import_module("torch.utils._device")
    current = getattr(device_module, "CURRENT_DEVICE", None)
    return None if current is None else torch.device(current).type


def import_dynamo() -> None:
    """Import ``torch._dynamo`` (2.6+): it maps torch's functions to its rules when first imported.

    The torch-function modes in force (``with torch.device("meta")`` while a model is built) are
    set aside meanwhile: on 2.6 to 2.8 the import runs tensor ops at module level
    (torch/_dynamo/variables/torch_function.py, ``populate_builtin_to_tensor_fn_map`` on
    ``torch.ones(1)``); on meta tensors those reach Python meta kernels wrapped in
    ``_disable_dynamo``, which imports torch._dynamo again, half-made: "partially initialized module
    'torch._dynamo' has no attribute 'disable'" (or 'external_utils'), every --device cuda estimate
    on those versions. 2.9 and later import cleanly either way."""
    if "torch._dynamo" in sys.modules:
        return
    with no_function_modes():
        importlib.import_module("torch._dynamo")


@contextlib.contextmanager
def no_function_modes():
    """Set aside the torch-function modes in force (``torch._C._pop_torch_function_stack``, 2.6+) inside."""
    modes = [torch._C._pop_torch_function_stack() for _ in range(torch._C._len_torch_function_stack())]
    try:
        yield
    finally:
        for mode in reversed(modes):
            torch._C._push_on_torch_function_stack(mode)


def _optimized_module_class():
    """``torch._dynamo.eval_frame.OptimizedModule`` (what ``torch.compile(module)`` returns; 2.6+), or None
    while torch._dynamo is not imported: nothing can have been compiled then, and importing it
    costs a second."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return getattr(eval_frame, "OptimizedModule", None)


def compiled_parts(model=None, **functions) -> list[str]:
    """What of a training step ``torch.compile`` compiled, as the report names it: the model
    (``torch.compile(model)``, an ``OptimizedModule`` with the module in ``_orig_mod``; or
    ``module.compile()`` in place, which sets ``_compiled_call_impl`` on that module: 2.6+), and
    each of ``functions`` (name -> function) that ``torch.compile(fn)`` wrapped (the wrapper keeps
    the function in ``_torchdynamo_orig_callable``: 2.6+)."""
    parts = []
    optimized = _optimized_module_class()
    if model is not None:
        if optimized is not None and isinstance(model, optimized):
            parts.append("the model (torch.compile(model))")
        elif isinstance(model, torch.nn.Module):
            for how, test in (("module.compile()", _compiled_call), ("compiled methods", _compiled_methods)):
                inner = [n or type(model).__name__ for n, m in model.named_modules() if test(m)]
                if inner:
                    parts.append(f"{inner[0]} ({how})" if len(inner) == 1 else f"{len(inner)} modules ({how})")
    parts += [f"{name} (torch.compile)" for name, fn in functions.items()
              if getattr(fn, "_torchdynamo_orig_callable", None) is not None]
    return parts


def _compiled_call(module) -> bool:
    """Whether ``module.compile()`` compiled ``module``'s call (it sets ``_compiled_call_impl``)."""
    return getattr(module, "_compiled_call_impl", None) is not None


def _compiled_methods(module) -> list[str]:
    """The instance methods that torch.compile wrapped: Lightning's ``from_compiled``
    (lightning/pytorch/utilities/compile.py:24-62) sets ``forward``, ``training_step``,
    ``validation_step``, ``test_step`` and ``predict_step`` to ``dynamo_ctx(<the bound method>)``
    when a compiled LightningModule is given to ``Trainer.fit``."""
    return [name for name, value in vars(module).items()
            if callable(value) and getattr(value, "_torchdynamo_orig_callable", None) is not None]


def eager_module(model):
    """The module a ``torch.compile``'d model runs (``OptimizedModule._orig_mod``), else ``model``."""
    optimized = _optimized_module_class()
    while optimized is not None and isinstance(model, optimized):
        model = model._orig_mod
    return model


def eager_function(fn):
    """The function ``torch.compile(fn)`` wrapped, else ``fn``."""
    return getattr(fn, "_torchdynamo_orig_callable", None) or fn


def uncompile_copy(module: torch.nn.Module) -> None:
    """Drop compiled calls from every module of a *copy* (a meta twin): ``module.compile()``'s
    ``_compiled_call_impl`` and a compiled instance ``forward`` are bound to the original module,
    so calling them from the copy would run the user's own module and weights."""
    for m in module.modules():
        if _compiled_call(m):
            m._compiled_call_impl = None
        for name in _compiled_methods(m):
            del m.__dict__[name]  # the class's method, on the copy's own parameters


def eager_stance():
    """A context in which compiled code runs eagerly: ``torch.compiler.set_stance("force_eager")``
    (2.6+; compiled functions and modules call the code they wrap, nothing is compiled), so a
    trace never compiles (a compiled helper inside a loss function). Nothing to do while
    torch._dynamo is not imported: nothing has been compiled."""
    if "torch._dynamo" not in sys.modules:
        return contextlib.nullcontext()
    return torch.compiler.set_stance("force_eager")


def inductor_partition_backend(fw_compiler, bw_compiler):
    """A TorchDynamo backend that splits each captured graph into a forward and a backward as
    TorchInductor does, then hands them to ``fw_compiler``/``bw_compiler`` (each ``(gm,
    example_inputs) -> callable`` in AOTAutograd's boxed convention) instead of inductor's codegen.

    What it shares with ``torch._inductor.compile_fx._compile_fx_main`` (2.13: compile_fx.py:3061-3067):
    ``aot_autograd`` (torch._dynamo.backends.common, 2.6+) with inductor's decompositions
    (``torch._inductor.decomposition.select_decomp_table``, 2.6+), the min-cut partition with
    ``compiler="inductor"`` (``torch._functorch.partitioners.min_cut_rematerialization_partition``,
    2.6+: its recomputation choices are inductor's, compile_fx.py:2313) and
    ``keep_inference_input_mutations=True``. Left out: inductor's joint-graph passes
    (``compile_fx.partition_fn``, compile_fx.py:2291: pattern rewrites; on meta tensors its
    ``constant_fold_uniform_value`` folds every meta value and breaks the graph) and the
    post-grad passes; what inductor fuses is modelled by ``memcheck.trace.compiled``."""
    import functools

    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table

    return aot_autograd(fw_compiler=fw_compiler, bw_compiler=bw_compiler, decompositions=select_decomp_table(),
                        partition_fn=functools.partial(min_cut_rematerialization_partition, compiler="inductor"),
                        keep_inference_input_mutations=True)


def inductor_extern_ops() -> frozenset:
    """The aten ops whose inputs TorchInductor realizes into buffers of their own: its extern and
    fallback kernels (matmuls, convolutions, attention, ...): ``needs_realized_inputs``
    (torch/_inductor/lowering.py:134, filled as lowering.py registers them; 2.6+). Importing it
    registers every lowering: about a second."""
    from torch._inductor import lowering

    return frozenset(lowering.needs_realized_inputs)


# TorchInductor's thresholds for materialising a fused pointwise value (torch/_inductor/config.py
# 2.13: realize_reads_threshold = 4 at :861, realize_cpu_acc_reads_threshold = 12 at :871; the
# same values since 2.6), and the ops that make a value used twice worth storing on the CPU
# (``StorageBox.should_realize_on_reuse``, torch/_inductor/ir.py:10093-10115).
INDUCTOR_REALIZE = {"reads_on_reuse": 4, "cpu_acc_reads": 12,
                    "heavy_on_cpu": ("exp", "log", "log10", "log1p", "log2", "sigmoid", "tanh")}


@contextlib.contextmanager
def no_global_module_hooks():
    """Set aside the global module hooks (``torch.nn.modules.module._global_*_hooks``, 2.6+; memcheck's
    ModuleTracker) inside: a compiled forward runs as a real one does, without them (TorchDynamo
    would otherwise trace or break on them)."""
    module = sys.modules["torch.nn.modules.module"]
    names = [n for n in ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_forward_hooks_always_called",
                         "_global_forward_hooks_with_kwargs", "_global_backward_pre_hooks", "_global_backward_hooks")
             if isinstance(getattr(module, n, None), dict)]
    saved = {n: dict(getattr(module, n)) for n in names}
    for n in names:
        getattr(module, n).clear()
    try:
        yield
    finally:
        for n in names:
            getattr(module, n).update(saved[n])


# --- Optional features, imported on first use --------------------------------------------------
# name -> (the torch versions that have it, its loader). A loader returns None where the running
# torch lacks it. ``SINCE`` is what ``memcheck.errors.require_torch`` names.


def _fully_shard():
    try:  # public from 2.6
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        try:  # 2.4 and 2.5 kept FSDP2 under _composable
            from torch.distributed._composable.fsdp import fully_shard
        except ImportError:
            return None
    return fully_shard


def _attr(module: str, name: str):
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None


def _module(module: str):
    try:
        return importlib.import_module(module)
    except ImportError:
        return None


_OPTIONAL = {
    # FSDP2: torch.distributed.fsdp.fully_shard 2.6+ (torch.distributed._composable.fsdp 2.4-2.5).
    "fully_shard": ("2.4", _fully_shard),
    # public DTensor (torch.distributed.tensor): 2.5+ (torch.distributed._tensor before).
    "DTensor": ("2.5", lambda: _attr("torch.distributed.tensor", "DTensor")),
    # DTensor's sharding-strategy registry: torch.distributed.tensor._ops.utils 2.6-2.9 and 2.11+;
    # 2.10 moved register_op_strategy to torch.distributed.tensor._ops.registration.
    "register_op_strategy": ("2.6", lambda: _attr("torch.distributed.tensor._ops.utils", "register_op_strategy")
                             or _attr("torch.distributed.tensor._ops.registration", "register_op_strategy")),
    "expand_to_full_mesh_op_strategy": (
        "2.6", lambda: _attr("torch.distributed.tensor._ops.utils", "expand_to_full_mesh_op_strategy")),
    # context parallelism's public entry (torch.distributed.tensor.experimental.context_parallel): 2.6+.
    "context_parallel": ("2.6", lambda: _attr("torch.distributed.tensor.experimental", "context_parallel")),
    # context parallelism's ring attention and sharding rules, as memcheck's CPU measurement drives
    # them (``custom_ops``, ``_templated_ring_attention``, ``SEQ_DIM``): the package
    # torch.distributed.tensor.experimental._context_parallel, 2.10+; 2.6-2.9 kept other internals
    # in torch.distributed.tensor.experimental._attention (``customized_ops``), not stood in for.
    "cp_attention": ("2.10", lambda: _module("torch.distributed.tensor.experimental._context_parallel._attention")),
    "cp_sharding_rules": (
        "2.10", lambda: _module("torch.distributed.tensor.experimental._context_parallel._sharding_rules")),
    # selective activation checkpointing (torch.utils.checkpoint): 2.4+.
    "CheckpointPolicy": ("2.4", lambda: _attr("torch.utils.checkpoint", "CheckpointPolicy")),
    "create_selective_checkpoint_contexts": (
        "2.4", lambda: _attr("torch.utils.checkpoint", "create_selective_checkpoint_contexts")),
    # the "fake" process-group backend (every collective completes at once, nothing is sent) and
    # its store: torch.testing._internal.distributed.fake_pg, in torch since 2.1, checked on 2.6 and
    # 2.13 (the matrix's floor and the tests' torch); what ``memcheck run`` hands a launched script's
    # init_process_group.
    "FakeStore": ("2.6", lambda: _attr("torch.testing._internal.distributed.fake_pg", "FakeStore")),
}

SINCE: dict[str, str] = {name: since for name, (since, _) in _OPTIONAL.items()}
"""The first torch minor that has each optional name, as ``"2.6"``."""


def __getattr__(name: str):
    entry = _OPTIONAL.get(name)
    if entry is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = entry[1]()
    globals()[name] = value
    return value
