"""Keep the GPU untouched while memcheck runs a model's code for an estimate.

A model file may call ``.cuda()``, ``.to("cuda")``, ``torch.zeros(..., device="cuda")``
or ``torch.cuda.synchronize()`` in ``build_model``, ``make_batch`` or ``forward``. Run as
written, the first such call initialises CUDA in this process (a context of several
hundred MiB on the GPU) and the rest would allocate real memory. Inside
:func:`redirect_cuda`:

- tensor moves and factory calls aimed at a redirected device type land on the meta
  device instead (``.cuda()``, ``.to(...)``, ``device=`` keywords, ``.cpu()`` and
  ``.pin_memory()`` of meta tensors);
- the ``torch.cuda`` calls models commonly make answer without the driver:
  synchronisation and cache calls do nothing, device queries describe the target GPU
  (unless CUDA is already initialised, as in a pre-flight check inside a training
  script: then ``torch.cuda`` is left as it is, and the redirected moves still hold);
- anything else that would initialise CUDA (``torch.cuda._lazy_init``, which torch's
  C++ side calls too before the first CUDA tensor or stream) raises a
  :class:`~memcheck.errors.TraceError` naming the call, instead of touching the GPU;
- an op that mixes meta tensors with CPU tensors the model made without naming a device
  (``x + torch.arange(n)``) is run again with those moved to meta, as the target
  device would hold them.

While loading a model (``memcheck.workloads.source``) every device is redirected, so nothing
real is built; while tracing only ``cuda``, so the host memory memcheck itself uses
(a CPU stand-in for SDPA's kernel choice, Adam's step counters) stays on the host.
Everything is restored on exit.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import traceback
from pathlib import Path
from types import SimpleNamespace

import torch
from torch.overrides import TorchFunctionMode

from memcheck import compat
from memcheck.compat import tree_flatten, tree_map_only
from memcheck.errors import TraceError

_Tensor = torch.Tensor
_MIXED = ("is not on the expected device meta", "Expected all tensors to be on the same device")
_LOCK = threading.RLock()
_depth = 0
_saved: list[tuple[object, str, object]] = []


class _MetaDevices(TorchFunctionMode):
    """Send tensor moves and factory calls for ``devices`` to the meta device. In force in
    backward too (``memcheck.trace.engine_modes``)."""

    stands_for_device = True

    def __init__(self, devices: frozenset[str]):
        super().__init__()
        self.devices = devices

    def _redirected(self, device) -> bool:
        if device is None:
            return False
        if isinstance(device, int):  # a bare index means a CUDA device
            return "cuda" in self.devices
        try:
            return torch.device(device).type in self.devices
        except (RuntimeError, TypeError):
            return False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is _Tensor.cuda:
            return _to_meta(args[0])
        if func in (_Tensor.cpu, _Tensor.pin_memory):
            return args[0] if args[0].is_meta else func(*args, **kwargs)
        if func is _Tensor.to:
            return self._to(func, args, kwargs)
        if "device" in kwargs and self._redirected(kwargs["device"]):
            kwargs["device"] = "meta"
        try:
            return func(*args, **kwargs)
        except RuntimeError as exc:
            if not any(text in str(exc) for text in _MIXED):
                raise
            moved = _meta_leaves((args, kwargs))
            if moved is None:
                raise
            return func(*moved[0], **moved[1])

    def _to(self, func, args, kwargs):
        self_, rest = args[0], args[1:]
        copy = kwargs.pop("copy", False)
        device, dtype, non_blocking, memory_format = compat.parse_to(*rest, **kwargs)
        if device is not None and (self._redirected(device) or (self_.is_meta and device.type == "cpu")):
            device = torch.device("meta")
        options = dict(dtype=dtype, non_blocking=non_blocking, copy=copy)
        if memory_format is not None:
            options["memory_format"] = memory_format
        return func(self_, device, **options) if device is not None else func(self_, **options)


def _to_meta(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_meta else t.to("meta")


def _meta_leaves(tree):
    """``tree`` with its non-scalar CPU tensors moved to meta, if it also holds meta tensors
    (None when there is nothing to move)."""
    leaves = [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]
    if not any(t.is_meta for t in leaves) or not any(t.device.type == "cpu" and t.dim() for t in leaves):
        return None
    return tree_map_only(torch.Tensor, lambda t: t.to("meta") if t.device.type == "cpu" and t.dim() else t, tree)


class _Stream:
    """A stand-in for ``torch.cuda.Stream``: every method does nothing."""

    def __init__(self, *args, **kwargs):
        self.device = torch.device("meta")

    def __getattr__(self, name):
        return lambda *args, **kwargs: 0.0 if name == "elapsed_time" else True if name == "query" else None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _Event(_Stream):
    """A stand-in for ``torch.cuda.Event``."""


def _nothing(name: str):
    """A do-nothing stand-in for ``torch.cuda.NAME`` (one function object per name: torch._dynamo
    refuses one object under two names)."""

    def nothing(*args, **kwargs):
        return None

    nothing.__name__ = nothing.__qualname__ = name
    return nothing


def _caller() -> tuple[str, str]:
    """('file:line', 'torch.FUNCTION') for the innermost call from outside torch and memcheck into torch."""
    root = Path(torch.__file__).parent
    skip = (str(root), str(Path(__file__).parent))
    called = "a torch.cuda function"
    for frame in reversed(traceback.extract_stack()[:-2]):
        if frame.filename.startswith(skip) or frame.filename.startswith("<"):
            if frame.filename.startswith(str(root)):
                module = Path(frame.filename).relative_to(root.parent).with_suffix("").parts
                called = ".".join(p for p in module if p != "__init__") + f".{frame.name}()"
            continue
        return f"{frame.filename}:{frame.lineno}", called
    return "the model's code", called


def _tripwire(*args, **kwargs):
    where, called = _caller()
    raise TraceError(
        f"{where}: {called} would initialise CUDA, and memcheck never touches the GPU while estimating "
        "(it redirects .cuda(), .to('cuda'), device='cuda' and the common torch.cuda calls, not this one); "
        "move the call out of build_model/make_batch/forward, or skip it while memcheck runs"
    )


def _standins(gpu) -> dict[str, object]:
    """What the common ``torch.cuda`` calls answer for the trace: the target GPU's description,
    no-ops for synchronisation and the cache."""
    arch = tuple(getattr(gpu, "arch", None) or (8, 0))
    capacity = int(getattr(gpu, "capacity_bytes", 0) or 0)
    name = getattr(gpu, "name", None) or "memcheck target GPU"
    props = SimpleNamespace(name=name, major=arch[0], minor=arch[1], total_memory=capacity,
                            multi_processor_count=getattr(gpu, "sms", 0) or 0, is_integrated=False)
    standins = {
        name: _nothing(name)
        for name in ("synchronize", "empty_cache", "ipc_collect", "init", "set_device",
                     "set_per_process_memory_fraction", "reset_peak_memory_stats", "reset_max_memory_allocated",
                     "reset_max_memory_cached", "reset_accumulated_memory_stats")
    }
    standins.update(
        current_device=lambda: 0,
        get_device_capability=lambda device=None: arch,
        get_device_name=lambda device=None: name,
        get_device_properties=lambda device=None: props,
        mem_get_info=lambda device=None: (capacity, capacity),
        is_bf16_supported=lambda *args, **kwargs: arch >= (8, 0),
        current_stream=lambda device=None: _Stream(),
        default_stream=lambda device=None: _Stream(),
        stream=lambda stream=None: contextlib.nullcontext(),
        Stream=_Stream,
        Event=_Event,
        _lazy_init=_tripwire,
    )
    return standins


def _patch(gpu) -> None:
    # torch._dynamo maps torch's functions to its rules when first imported (which a meta
    # tensor's first random init does); import it now, so the map holds torch.cuda's own.
    compat.import_dynamo()

    modules = [torch.cuda] + [sys.modules[m] for m in ("torch.cuda.memory", "torch.cuda.random") if m in sys.modules]
    for name, value in _standins(gpu).items():
        for module in modules:
            if module is torch.cuda or (name == "_lazy_init" and hasattr(module, name)):
                _saved.append((module, name, getattr(module, name, None)))
                setattr(module, name, value)


def _unpatch() -> None:
    while _saved:
        module, name, value = _saved.pop()
        setattr(module, name, value)


@contextlib.contextmanager
def redirect_cuda(gpu=None, *, devices: tuple[str, ...] = ("cuda",)):
    """Run model code without touching the GPU (see the module docstring).

    ``gpu`` (a ``memcheck.cuda.gpus.GpuSpec`` or None) is what device queries describe;
    ``devices`` are the device types sent to meta (``("cuda", "cpu")`` while loading).
    Nesting is allowed: the ``torch.cuda`` stand-ins are installed once, by the outermost.
    """
    with cuda_stubbed(gpu), _MetaDevices(frozenset(devices)):
        yield


@contextlib.contextmanager
def cuda_stubbed(gpu=None):
    """The ``torch.cuda`` stand-ins of :func:`redirect_cuda` alone, tensors left as they are:
    what memcheck reads configs and imports third-party libraries under, since some ask the
    GPU at import (bitsandbytes' ``cuda_specs.get_compute_capabilities`` calls
    ``torch.cuda.get_device_capability`` for every device when PEFT imports it, which
    initialises CUDA). Nesting is allowed; the outermost installs and restores them."""
    global _depth
    with _LOCK:
        # Once CUDA is up (a pre-flight check inside a training script), nothing can initialise
        # it again, and torch.cuda is left alone for the script's other threads.
        if _depth == 0 and not torch.cuda.is_initialized():
            _patch(gpu)
        _depth += 1
    try:
        yield
    finally:
        with _LOCK:
            _depth -= 1
            if _depth == 0:
                _unpatch()


@contextlib.contextmanager
def on_meta(gpu=None):
    """Build on the meta device and nowhere else: what memcheck runs a model's ``build_model``,
    ``make_batch`` or a batch factory under. Factory calls with no device land on meta
    (``torch.device("meta")``), and every device named is redirected to meta."""
    with torch.device("meta"), redirect_cuda(gpu, devices=("cuda", "cpu")):
        yield


# How torch says Python code read a meta tensor's data (it has none).
_DATA_READ = ("Cannot copy out of meta tensor", "cannot be called on meta tensors",
             "can't convert meta device type tensor to numpy", "Not available for 'meta' device type")


def reads_meta_data(exc: BaseException) -> bool:
    """Whether ``exc`` (or what it was raised from) is torch refusing to read a meta tensor's values."""
    while exc is not None:
        if any(text in str(exc) for text in _DATA_READ):
            return True
        exc = exc.__cause__
    return False


@contextlib.contextmanager
def meta_parameters():
    """Every parameter and buffer a module registers becomes a meta tensor of the same shape and
    dtype as it is registered (torch's global ``register_module_parameter_registration_hook`` and
    buffer hook), so a module holds one real parameter at a time while it is built and none
    after; tensors that are not registered stay as they are. Parameters already on meta (a tied
    weight assigned again) are kept, so ties hold. The hooks are removed on exit."""
    from torch.nn.modules import module as module_mod

    def to_meta(module, name, value):
        if value is None or value.is_meta:
            return None
        if isinstance(value, torch.nn.Parameter):
            return torch.nn.Parameter(torch.empty_like(value, device="meta"), requires_grad=value.requires_grad)
        return torch.empty_like(value, device="meta")

    handles = [module_mod.register_module_parameter_registration_hook(to_meta),
               module_mod.register_module_buffer_registration_hook(to_meta)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def on_meta_keeping_host(gpu=None):
    """Build on meta, but leave the host tensors a model's code makes as they are: factory calls
    without a device run on the CPU for real (a drop-path schedule from
    ``torch.linspace(...).tolist()`` reads its values), while every parameter and buffer becomes
    meta as it is registered (``meta_parameters``) and ``cuda`` is redirected. What memcheck
    builds under when ``on_meta`` fails because the code read a meta tensor's values."""
    with meta_parameters(), redirect_cuda(gpu, devices=("cuda",)):
        yield



@contextlib.contextmanager
def tracing_globals():
    """The torch globals a trace needs, whatever the caller set, all restored on exit: grad on
    and inference mode off (a backward is traced, even from inside ``torch.no_grad()`` or
    ``torch.inference_mode()`` in an evaluation script), and, when the caller set a default
    device (``torch.set_default_device("cuda")``, ``with torch.device("meta")``), the CPU
    (memcheck's own host tensors stay on the host; the model's code is redirected to meta as
    always). The default dtype is the caller's, as the real job would run with it (Adam's step
    counters follow it), and is put back if anything changed it. Used by ``estimate()``,
    ``plan()`` and ``check()``, also as a decorator."""
    dtype = torch.get_default_dtype()
    set_device = _default_device()
    try:
        with torch.inference_mode(False), torch.enable_grad(), \
                (torch.device("cpu") if set_device not in (None, "cpu") else contextlib.nullcontext()):
            yield
    finally:
        torch.set_default_dtype(dtype)


def _default_device() -> str | None:
    """The device type the caller made the default, or None. Read from torch's own record
    (``torch.utils._device.CURRENT_DEVICE``, set by ``set_default_device`` and ``with
    torch.device(...)``): ``torch.get_default_device()`` makes a tensor there to answer, which
    fails for ``cuda`` on a machine without CUDA."""
    return compat.default_device_type()
