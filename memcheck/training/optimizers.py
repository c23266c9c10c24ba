"""Optimizer choices, built the way torch builds them on the target device.

torch picks the ``foreach`` (whole-parameter-list) implementation by default only
when every parameter is on CUDA (``torch.optim.optimizer._default_to_fused_or_foreach``);
on CPU, and on meta, it runs the per-parameter loop. Tracing on meta therefore
needs ``foreach`` set explicitly for a CUDA target, or the list-wide temporaries
of ``step()`` would be missed.

The choices, by name (``estimate(..., optimizer=NAME)``, ``--optimizer NAME``):

* ``adamw``, ``adam``: torch's default implementation for the target (foreach on
  CUDA, the per-parameter loop on CPU).
* ``adamw-foreach``: ``AdamW(foreach=True)`` on either target.
* ``adamw-fused``, ``adam-fused``: ``fused=True`` (``torch._fused_adamw_``; CUDA, and CPU
  since torch 2.4). The fused kernels update in place and allocate nothing per step.
* ``adafactor``: ``transformers.optimization.Adafactor`` with its own defaults.
* ``adamw-8bit``: the state layout of ``bitsandbytes.optim.AdamW8bit`` (bitsandbytes
  itself is not needed; see ``_AdamW8bitLayout``). A bitsandbytes Adam/AdamW optimizer
  given as a class or an instance (``AdamW8bit``, ``PagedAdamW8bit``, ``Adam8bit``,
  32-bit ``AdamW``...) is traced as this layout with its own settings; other bitsandbytes
  optimizers run as themselves (see ``_bitsandbytes_optimizer``).
* ``sgd``, ``sgd-momentum``.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from memcheck.enums import Device
from memcheck.errors import UsageError, closest

OptimizerFactory = Callable[[Any], torch.optim.Optimizer]


# --------------------------------------------------------------------------------------
# Fused Adam/AdamW on meta tensors.
#
# ``torch._fused_adam_``/``_fused_adamw_`` have meta kernels (in-place, no outputs), but
# ``Adam._init_group`` calls ``_device_dtype_check_for_fused(p)`` when it creates a
# parameter's state, and that check only admits the devices in
# ``_get_fused_kernels_supported_devices()`` (cuda, cpu, mps, xpu, hpu, mtia, privateuse1):
# not meta. The check runs only while the state is empty, so these subclasses create the
# state first, exactly as ``_init_group`` does for ``fused=True`` (torch/optim/adam.py:
# ``step`` a float32 0-dim tensor on the parameter's device, since fused implies it is
# not kept on the host; then ``exp_avg``, ``exp_avg_sq`` and, with amsgrad,
# ``max_exp_avg_sq``, each ``zeros_like(p)``); the step itself is torch's own.
# On real tensors they are plain Adam/AdamW.


def prefill_fused_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the state of a ``fused=True`` Adam/AdamW's meta parameters that have a gradient
    and no state yet, as ``_init_group`` would (see above), so its device check never runs."""
    for group in optimizer.param_groups:
        if not group.get("fused"):
            continue
        for p in group["params"]:
            if p.grad is None or p.device.type != "meta" or optimizer.state[p]:
                continue
            state = optimizer.state[p]
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if group.get("amsgrad"):
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


class _FusedOnMeta:
    """Mixin for ``torch.optim.Adam``/``AdamW``: lets ``fused=True`` run on meta tensors."""

    def step(self, closure=None):
        prefill_fused_state(self)
        return super().step(closure)


class _FusedAdam(_FusedOnMeta, torch.optim.Adam):
    """``torch.optim.Adam`` whose ``fused=True`` also runs on meta tensors."""


class _FusedAdamW(_FusedOnMeta, torch.optim.AdamW):
    """``torch.optim.AdamW`` whose ``fused=True`` also runs on meta tensors."""


_META_FUSED = {torch.optim.Adam: _FusedAdam, torch.optim.AdamW: _FusedAdamW}


# --------------------------------------------------------------------------------------
# bitsandbytes AdamW8bit, as a memory layout.
#
# Source: bitsandbytes-foundation/bitsandbytes, bitsandbytes/optim/optimizer.py at commit
# 51294d909e914f80d2f2c85f9e9229dd4386ef85 (bitsandbytes >= 0.44), ``Optimizer2State.init_state``:
#   * a parameter with fewer than ``min_8bit_size`` elements keeps 32-bit state:
#     ``state1``, ``state2`` = ``zeros_like(p, dtype=float32)``;
#   * otherwise ``state1``, ``state2`` = ``zeros_like(p, dtype=uint8)``, ``absmax1``,
#     ``absmax2`` = ``zeros((ceil(numel / 256),), float32)`` (block_wise=True is the default),
#     and ``qmap1``/``qmap2`` = ``self.name2qmap["dynamic"/"udynamic"]``: two 256-entry
#     float32 maps (``F.create_dynamic_map``) made once per optimizer and *shared* by every
#     parameter (moved to the parameter's device on first use), not one per parameter;
#   * ``step`` is a Python int; no ``gnorm_vec`` (percentile_clipping=100) and no
#     ``unorm_vec`` (max_unorm=0) with the defaults.
# The blocksize was 2048 before bitsandbytes 0.44 (bitsandbytes PR #1365; commit
# 06029dd6edcc719e5831443179bcb206c6355093 still has ``n // 2048``).
# ``update_step`` calls ``F.optimizer_update_8bit_blockwise`` (or ``optimizer_update_32bit``
# for the small parameters), i.e. ``torch.ops.bitsandbytes.optimizer_update_8bit_blockwise``,
# whose CUDA implementation (bitsandbytes/backends/cuda/ops.py,
# ``_optimizer_update_8bit_blockwise_impl``) passes pointers to one kernel that updates
# ``p``, the states and absmax in place: no tensor is allocated by a step.
# The CPU implementation (bitsandbytes 0.50.2, backends/cpu/ops.py,
# ``_optimizer_update_8bit_blockwise_cpu`` and ``_optimizer_update_32bit_cpu``) is torch
# code that dequantizes both states to fp32, computes in fp32 and quantizes back: per
# parameter of n elements it holds up to 20n bytes of fp32 temporaries (``_cpu_step``).
# Optimizer8bit on CPU ignores ``is_paged``; on CUDA a paged optimizer keeps the state of
# parameters of >= 1e5 elements in CUDA unified memory (``get_state_buffer``), which the
# driver may page out to host memory under pressure: counted here as resident.

BNB_MIN_8BIT_SIZE = 4096  # elements; Optimizer2State(min_8bit_size=4096)
BNB_BLOCKSIZE = 256  # elements per absmax entry; init_state ``n // 256`` (bitsandbytes >= 0.44)
BNB_QMAP_ENTRIES = 256  # float32 entries of each dynamic map; F.create_dynamic_map (8 bits)


class _AdamW8bitLayout(torch.optim.Optimizer):
    """The per-parameter state of ``bitsandbytes.optim.AdamW8bit``, allocated as bitsandbytes does.

    It reproduces memory, not numerics: ``step()`` allocates the state on first use
    and then updates each parameter in place (a plain ``p -= lr * grad``). For the
    CUDA target (the default) a step allocates nothing, as the fused bitsandbytes
    kernel allocates nothing; for the CPU target it allocates, and frees, what
    bitsandbytes' CPU kernels do (``_cpu_step``). ``optim_bits=32`` is the layout of the
    32-bit variants (``bitsandbytes.optim.AdamW``, ``AdamW32bit``): fp32 state throughout.
    Use it to estimate, never to train.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 min_8bit_size=BNB_MIN_8BIT_SIZE, blocksize=BNB_BLOCKSIZE, optim_bits=8, max_unorm=0.0,
                 target=Device.CUDA):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.min_8bit_size = min_8bit_size
        self.blocksize = blocksize
        self.optim_bits = optim_bits
        self.max_unorm = max_unorm
        self.target = Device.parse(target)
        self._qmaps: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def _init_state(self, p: torch.Tensor) -> None:
        state = self.state[p]
        state["step"] = 0
        if self.max_unorm > 0.0:  # init_state: the update norm, one fp32 per parameter
            state["unorm_vec"] = torch.zeros((1,), device=p.device)
        if p.numel() < self.min_8bit_size or self.optim_bits == 32:
            state["state1"] = torch.zeros_like(p, dtype=torch.float32)
            state["state2"] = torch.zeros_like(p, dtype=torch.float32)
            return
        if p.device not in self._qmaps:  # name2qmap: one signed and one unsigned map per optimizer
            self._qmaps[p.device] = (
                torch.zeros(BNB_QMAP_ENTRIES, dtype=torch.float32, device=p.device),
                torch.zeros(BNB_QMAP_ENTRIES, dtype=torch.float32, device=p.device),
            )
        blocks = -(-p.numel() // self.blocksize)
        state["state1"] = torch.zeros_like(p, dtype=torch.uint8)
        state["qmap1"] = self._qmaps[p.device][0]
        state["state2"] = torch.zeros_like(p, dtype=torch.uint8)
        state["qmap2"] = self._qmaps[p.device][1]
        state["absmax1"] = torch.zeros((blocks,), dtype=torch.float32, device=p.device)
        state["absmax2"] = torch.zeros((blocks,), dtype=torch.float32, device=p.device)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if not self.state[p]:
                    self._init_state(p)
                self.state[p]["step"] += 1
                if self.target is Device.CPU:
                    self._cpu_step(p, group["lr"], group["eps"])
                else:
                    p.add_(p.grad, alpha=-group["lr"])
        return loss

    def _cpu_step(self, p: torch.Tensor, lr: float, eps: float) -> tuple:
        """One parameter's update with the temporaries of bitsandbytes' CPU kernels ("adam"),
        in their order; the values are not bitsandbytes' (the update is ``p -= lr * grad``).
        Returns the kernel's fp32 locals, freed when the caller drops them, as at its return."""
        state = self.state[p]
        if state["state1"].dtype == torch.uint8:  # _optimizer_update_8bit_blockwise_cpu
            s1 = torch.empty_like(state["state1"], dtype=torch.float32)  # dequantize_blockwise: n fp32
            s2 = torch.empty_like(state["state2"], dtype=torch.float32)
            grad = p.grad.float() * 1.0  # g.float() * gnorm_scale
            p32 = p.data.float()  # the parameter itself when it is fp32
            denom = (s2.sqrt() / 1.0).add_(eps)  # sqrt and its quotient: 2n fp32 at once
            p32.add_(grad, alpha=-lr)
            p.data.copy_(p32)
            for key in ("1", "2"):  # quantize_blockwise: absmax, then the uint8 copy, both copied in
                absmax = torch.empty_like(state["absmax" + key])
                quantized = torch.empty_like(state["state" + key])
                state["state" + key].copy_(quantized)
                state["absmax" + key].copy_(absmax)
                del absmax, quantized
            return s1, s2, grad, denom
        # _optimizer_update_32bit_cpu
        grad = p.grad.float() * 1.0
        p32 = p.data.float()
        update = state["state1"] / (state["state2"].sqrt() + eps)  # sqrt, sum, quotient: 3n at most
        p32.add_(grad, alpha=-lr)
        p.data.copy_(p32)
        return grad, update


# --------------------------------------------------------------------------------------
# The table.


def _adafactor() -> type:
    """transformers' Adafactor, imported on first use, whose learning rate needs no values on meta.

    ``Adafactor._get_lr`` scales the relative step by ``max(eps[1], state["RMS"])``, and
    that comparison asks for the value of a 0-dim tensor (``bool()``), which a meta
    tensor has not. The learning rate only scales the update in place (``update.mul_(lr)``),
    so its value moves no memory: on meta tensors the subclass hands ``_get_lr`` a
    stand-in RMS of 1.0 instead; the step and its temporaries are transformers' own. On
    real tensors it is Adafactor unchanged.
    """
    try:
        from transformers.optimization import Adafactor
    except ImportError as exc:  # memcheck itself does not need transformers
        raise UsageError("optimizer 'adafactor' needs transformers (pip install transformers)") from exc

    class _Adafactor(Adafactor):
        @staticmethod
        def _get_lr(param_group, param_state):
            rms = param_state.get("RMS")
            if isinstance(rms, torch.Tensor) and rms.device.type == "meta":
                param_state = {**param_state, "RMS": 1.0}
            return Adafactor._get_lr(param_group, param_state)

    _Adafactor.__name__ = _Adafactor.__qualname__ = "Adafactor"
    return _Adafactor


@dataclass(frozen=True)
class OptimizerChoice:
    """A named optimizer: its class (``load`` imports it lazily), settings and report label."""

    load: Callable[[], type]
    kwargs: dict = field(default_factory=dict)
    label: str | None = None


OPTIMIZERS: dict[str, OptimizerChoice] = {
    "adamw": OptimizerChoice(lambda: torch.optim.AdamW),
    "adamw-foreach": OptimizerChoice(lambda: torch.optim.AdamW, {"foreach": True}),
    "adamw-fused": OptimizerChoice(lambda: _FusedAdamW, {"fused": True}),
    "adam": OptimizerChoice(lambda: torch.optim.Adam),
    "adam-fused": OptimizerChoice(lambda: _FusedAdam, {"fused": True}),
    # transformers' own defaults (optimization.py ``Adafactor.__init__``): lr=None with a
    # relative step, parameter scaling on, no warmup, no first moment (beta1=None).
    # HF Trainer's optim="adafactor" passes scale_parameter=False, relative_step=False and
    # its learning rate instead (trainer_optimizer.py ``_get_adafactor``): the same state
    # and step temporaries; only the learning rate is a float rather than a 0-dim tensor.
    "adafactor": OptimizerChoice(
        _adafactor, {"lr": None, "scale_parameter": True, "relative_step": True, "warmup_init": False}
    ),
    "adamw-8bit": OptimizerChoice(lambda: _AdamW8bitLayout, label="adamw-8bit (bitsandbytes layout)"),
    # bitsandbytes' paged AdamW (PagedAdamW8bit, PagedAdamW32bit): the same state in CUDA unified memory
    # (cudaMallocManaged, outside torch's caching allocator): max_memory_allocated never shows it, nvidia-smi
    # does while it is resident, and the driver pages it to host memory when the GPU runs short. Counted
    # here as resident, in the allocated peak (a real max_memory_allocated reads lower by the state).
    "paged-adamw-8bit": OptimizerChoice(lambda: _AdamW8bitLayout,
                                        label="paged-adamw-8bit (bitsandbytes layout, paged state counted as resident)"),
    "paged-adamw-32bit": OptimizerChoice(lambda: _AdamW8bitLayout, {"optim_bits": 32},
                                         label="paged-adamw-32bit (bitsandbytes layout, paged state counted as "
                                               "resident)"),
    "sgd": OptimizerChoice(lambda: torch.optim.SGD, {"lr": 1e-3}),
    "sgd-momentum": OptimizerChoice(lambda: torch.optim.SGD, {"lr": 1e-3, "momentum": 0.9}),
}


def _for_target(cls: type, kwargs: dict, device: Device) -> dict:
    """Set ``foreach`` as torch's default would on ``device``."""
    params = inspect.signature(cls.__init__).parameters
    if "foreach" in params and kwargs.get("foreach") is None and not kwargs.get("fused"):
        kwargs = {**kwargs, "foreach": device is Device.CUDA}
    if cls is _AdamW8bitLayout and "target" not in kwargs:  # bitsandbytes' CPU kernels allocate
        kwargs = {**kwargs, "target": device}
    return kwargs


def implementation(kwargs: dict) -> str | None:
    """Which of torch's implementations the settings pick: ``fused``, ``foreach`` (one kernel per
    step over all tensors, with its temporaries) or ``for-loop``; None for an optimizer without them."""
    if kwargs.get("fused"):
        return "fused"
    if "foreach" in kwargs:
        return "foreach" if kwargs["foreach"] else "for-loop"
    return None


def _labelled(name: str, kwargs: dict) -> str:
    impl = implementation(kwargs)
    return name if impl is None or impl in name else f"{name} ({impl})"


def _constructor_kwargs(cls: type, defaults: dict) -> dict:
    """The entries of ``defaults`` that ``cls(params, ...)`` accepts.

    ``defaults`` can hold settings the constructor sets itself: ``AdamW`` stores
    ``decoupled_weight_decay=True`` but does not take it as an argument.
    """
    params = inspect.signature(cls.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(defaults)
    return {k: v for k, v in defaults.items() if k in params}


def _bitsandbytes_optimizer(optimizer, device: Device) -> tuple[str, OptimizerFactory] | None:
    """A bitsandbytes optimizer class or instance as ``(label, factory)``; None for anything else.

    Adam and AdamW in every variant (8-bit, 32-bit, paged: bitsandbytes' ``optimizer_name``
    "adam") trace as ``_AdamW8bitLayout`` with the optimizer's settings (``defaults`` and
    ``args``: optim_bits, min_8bit_size, max_unorm). The others (Lion, SGD, RMSprop, Adagrad,
    LAMB, LARS, AdEMAMix) run as themselves on meta, their own ``init_state`` making the
    state, with ``is_paged`` off (paging asks CUDA for unified memory); their fused CUDA
    kernels allocate nothing, and on the CPU target the rules of
    ``memcheck.rules.extensions.bitsandbytes`` add their CPU kernels' temporaries. A paged
    optimizer's state counts as resident on the GPU.
    Per-parameter overrides (``GlobalOptimManager``, e.g. ``StableEmbedding``'s 32-bit state)
    are keyed by the user's parameters and do not reach the trace.
    """
    cls = optimizer if isinstance(optimizer, type) else type(optimizer)
    if not (cls.__module__.startswith("bitsandbytes.") and issubclass(cls, torch.optim.Optimizer)):
        return None
    template = optimizer
    if isinstance(optimizer, type):  # the class's own settings: AdamW8bit passes optim_bits=8 itself
        try:
            template = cls([torch.nn.Parameter(torch.empty(1, device="meta"))])
        except Exception as exc:  # SGD8bit() without momentum refuses to be built
            raise UsageError(f"bitsandbytes' {cls.__name__} cannot be built with its defaults ({exc}); "
                             "pass an instance with your settings") from exc
    args = vars(template.args) if getattr(template, "args", None) is not None else {}
    paged = getattr(template, "is_paged", False) and device is Device.CUDA
    notes = ["paged state counted as resident"] if paged else []
    defaults = template.defaults
    if getattr(template, "optimizer_name", None) == "adam" and len(defaults.get("betas", ())) == 2:
        kwargs = dict(lr=defaults["lr"], betas=tuple(defaults["betas"]), eps=defaults["eps"],
                      weight_decay=defaults["weight_decay"], target=device,
                      min_8bit_size=args.get("min_8bit_size", BNB_MIN_8BIT_SIZE),
                      optim_bits=args.get("optim_bits", 8), max_unorm=args.get("max_unorm", 0.0))
        label = f"{cls.__name__} (bitsandbytes layout{''.join('; ' + n for n in notes)})"
        return label, lambda params: _AdamW8bitLayout(params, **kwargs)
    base = next((c for c in cls.__mro__ if c.__name__ in ("Optimizer1State", "Optimizer2State")), None)
    if base is None:  # e.g. bitsandbytes.optim.PytorchLARS, a plain torch optimizer
        return None
    # The base class's constructor, as every bitsandbytes optimizer calls it: the subclasses'
    # own arguments (SGD's momentum) are stored under other names in ``defaults``.
    state_args = copy.copy(template.args)
    if getattr(state_args, "max_unorm", 0.0) > 0.0:
        # optimizer_update_32bit takes the parameter's norm as a float, which a meta tensor
        # cannot give; without it bitsandbytes allocates 4 B less per parameter (unorm_vec).
        state_args.max_unorm = 0.0
        notes.append("max_unorm's 4 B per parameter left out")
    accepted = inspect.signature(base.__init__).parameters
    kwargs = {k: v for k, v in defaults.items() if k in accepted}

    def build(params):
        opt = cls.__new__(cls)
        base.__init__(opt, template.optimizer_name, params, **kwargs, args=state_args, is_paged=False)
        return opt

    return f"{cls.__name__} (bitsandbytes{''.join('; ' + n for n in notes)})", build


def _bitsandbytes_made(factory: OptimizerFactory, device: Device) -> OptimizerFactory:
    """``factory``, except that a bitsandbytes optimizer it makes (a model file's
    ``make_optimizer``) is traced as ``_bitsandbytes_optimizer`` traces one, with its groups."""

    def make(params):
        made = factory(params)
        mapped = _bitsandbytes_optimizer(made, device)
        return made if mapped is None else mapped[1]([dict(group) for group in made.param_groups])

    return make


def resolve_optimizer(optimizer, device: Device) -> tuple[str, OptimizerFactory]:
    """Turn a name, a factory ``params -> Optimizer`` or an Optimizer instance into ``(label, factory)``.

    Raises:
        UsageError: for an unknown name (naming the closest one and all allowed), or for
            an optimizer of any other type.
    """
    if isinstance(optimizer, str):
        key = optimizer.strip().lower()
        if key not in OPTIMIZERS:
            raise UsageError(
                f"unknown optimizer {optimizer!r}{closest(key, OPTIMIZERS)}; allowed: {', '.join(OPTIMIZERS)}"
            )
        choice = OPTIMIZERS[key]
        cls = choice.load()
        kwargs = _for_target(cls, dict(choice.kwargs), device)
        return choice.label or _labelled(key, kwargs), lambda params: cls(params, **kwargs)
    bitsandbytes = _bitsandbytes_optimizer(optimizer, device)
    if bitsandbytes is not None:
        return bitsandbytes
    if isinstance(optimizer, torch.optim.Optimizer):
        cls = type(optimizer)
        kwargs = _for_target(cls, _constructor_kwargs(cls, optimizer.defaults), device)
        label = _labelled(cls.__name__, kwargs)
        if kwargs.get("fused") and cls in _META_FUSED:
            cls = _META_FUSED[cls]
        return label, lambda params: cls(params, **kwargs)
    if callable(optimizer):
        label = getattr(optimizer, "__name__", type(optimizer).__name__)
        return label, _bitsandbytes_made(optimizer, device)
    raise UsageError(
        f"optimizer must be a name ({', '.join(OPTIMIZERS)}), a function of the parameters, "
        f"or an Optimizer, not {type(optimizer).__name__}"
    )


# TrainingArguments.optim -> memcheck's optimizer names (``OPTIMIZERS``); used for ``optim=`` in a
# job's settings and when the Trainer has not built its optimizer yet. HF's choices:
# transformers' trainer_optimizer.py, _get_*.
HF_OPTIMIZERS = {
    "adamw_torch": "adamw",
    "adamw_torch_fused": "adamw-fused",
    "adafactor": "adafactor",
    "sgd": "sgd",
    "adamw_bnb_8bit": "adamw-8bit",
    "adamw_8bit": "adamw-8bit",  # OptimizerNames.ADAMW_8BIT: an alias of adamw_bnb_8bit
    "paged_adamw_8bit": "paged-adamw-8bit",
    "paged_adamw_32bit": "paged-adamw-32bit",
}


def hf_optimizer(optim: Any, optim_args: str | None = None) -> str:
    """memcheck's optimizer name for ``TrainingArguments.optim`` (with ``optim_args`` for SGD's momentum).

    Raises:
        UsageError: for a name memcheck has no equivalent of, naming it and the known ones.
    """
    name = str(getattr(optim, "value", optim))
    if name not in HF_OPTIMIZERS:
        raise UsageError(f"optim={name!r} has no memcheck equivalent{closest(name, HF_OPTIMIZERS)}; memcheck knows "
                         f"{', '.join(HF_OPTIMIZERS)} (or pass the optimizer itself: "
                         "Trainer(optimizers=(optimizer, None)))")
    if name == "sgd" and optim_args:
        if _sgd_momentum(optim_args) > 0:
            return "sgd-momentum"
    return HF_OPTIMIZERS[name]


def _sgd_momentum(optim_args) -> float:
    """SGD's momentum in ``TrainingArguments.optim_args`` ("momentum=0.9,nesterov=True", split as the
    Trainer splits it: trainer.py, ``get_optimizer_cls_and_kwargs``); 0 when it names none.

    Raises:
        UsageError: naming optim_args when it is not key=value pairs or the momentum not a number of 0 or more.
    """
    if not isinstance(optim_args, str):
        raise UsageError(f"optim_args must be a string of key=value pairs such as 'momentum=0.9', "
                         f"got {type(optim_args).__name__}")
    settings = {}
    for piece in optim_args.replace(" ", "").split(","):
        if piece:
            key, eq, value = piece.partition("=")
            if not eq or not key:
                raise UsageError(f"optim_args {optim_args[:80]!r}: {piece[:40]!r} is not key=value, "
                                 "as in 'momentum=0.9'")
            settings[key] = value
    text = settings.get("momentum", "0")
    try:
        momentum = float(text)
    except ValueError:
        raise UsageError(f"optim_args momentum must be a number, got {text[:40]!r}") from None
    if not 0 <= momentum < float("inf"):  # nan too
        raise UsageError(f"optim_args momentum must be a finite number of 0 or more, got {text[:40]!r}")
    return momentum


def optimizer_name(optimizer) -> str:
    """An optimizer setting as a report names it: its name (``adamw-fused``), or the name of a model
    file's ``make_optimizer`` function (or an Optimizer's class)."""
    if isinstance(optimizer, str):
        return optimizer
    return getattr(optimizer, "__name__", type(optimizer).__name__)
