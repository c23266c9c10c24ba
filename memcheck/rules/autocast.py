"""Autocast for meta tensors: torch's cast policies, applied where the Python API is called.

``torch.autocast`` does nothing to meta tensors (``is_autocast_eligible`` in
aten/src/ATen/autocast_mode.h accepts only tensors on the autocast device), and
fake CUDA tensors abort a CPU-only build. So memcheck applies the policies
itself, from the tracer's ``TorchFunctionMode``, *above* autograd, as the
Autocast dispatch key does: the casts are recorded by autograd, so the tensors
saved for backward have the dtype a real run saves.

The op lists are torch's own (aten/src/ATen/autocast_mode.h ``AT_FORALL_*`` for
CUDA, autocast_mode.cpp ``AutocastCPU`` for CPU), mapped to the Python functions
that reach them. Casts of fp32 leaf tensors that require grad (the weights) to
the low-precision dtype are cached until the outermost region exits, as
``cached_cast`` does: one low-precision copy of each weight per forward.

Known limitations:
    A Python function that handles ``__torch_function__`` hides its inner calls,
    so ops inside composites are seen only where a rule below describes them
    (``cross_entropy``; ``multi_head_attention_forward`` is approximated by
    casting its inputs and weights to the low-precision dtype). Ops whose
    policy applies at an aten level below the Python API (``_convolution``,
    ``mkldnn_rnn_layer``) are covered through their public callers.
"""

from __future__ import annotations

import contextlib
import warnings
from enum import Enum
from typing import Any, Callable

import torch
import torch.nn.functional as F

from memcheck import compat
from memcheck.compat import tree_flatten, tree_map_only
from memcheck.enums import Device, Precision
from memcheck.rules.registry import bind


class CastPolicy(Enum):
    """``at::autocast::CastPolicy``."""

    LOWER = "lower_precision_fp"  # cast every floating input to the autocast dtype
    FP32 = "fp32"  # cast every floating input to float32
    FP32_SET_OPT_DTYPE = "fp32_set_opt_dtype"  # run in float32 through the op's dtype= argument
    PROMOTE = "promote"  # cast to the widest floating dtype among the inputs


def _resolve(names: str) -> list[Callable]:
    """Python callables for names like ``torch.mm Tensor.mm F.linear torch.linalg.vecdot``."""
    roots = {"torch": torch, "Tensor": torch.Tensor, "F": F}
    out = []
    for name in names.split():
        root, *path = name.split(".")
        obj: Any = roots[root]
        for part in path:
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if obj is not None and obj not in out:
            out.append(obj)
    return out


def _ops(*names: str) -> str:
    """``torch.X Tensor.X`` for each name (the function and the method)."""
    return " ".join(f"torch.{n} Tensor.{n}" for n in names)


# aten/src/ATen/autocast_mode.h, AT_FORALL_LOWER_PRECISION_FP / AT_FORALL_FP32 /
# AT_FORALL_FP32_SET_OPT_DTYPE / AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE (norm) / AT_FORALL_PROMOTE.
_CUDA = {
    CastPolicy.LOWER: _ops("addmm", "addmv", "addr", "matmul", "mm", "mv", "addbmm", "baddbmm", "bmm", "prelu")
    + " Tensor.__matmul__ Tensor.__rmatmul__ torch.conv1d torch.conv2d torch.conv3d torch.conv_tbc"
    " torch.conv_transpose1d torch.conv_transpose2d torch.conv_transpose3d torch.einsum torch.chain_matmul"
    " torch.linalg.vecdot torch.linalg.multi_dot torch.lstm_cell torch.gru_cell torch.rnn_tanh_cell"
    " torch.rnn_relu_cell F.linear F.conv1d F.conv2d F.conv3d F.conv_transpose1d F.conv_transpose2d"
    " F.conv_transpose3d F.prelu F.scaled_dot_product_attention",
    CastPolicy.FP32: _ops(
        "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal",
        "rsqrt", "sinh", "tan", "pow", "dist", "renorm", "logsumexp",
    )
    + " Tensor.__pow__ Tensor.__rpow__ torch.layer_norm torch.group_norm torch.rms_norm torch.cosine_similarity"
    " torch.poisson_nll_loss torch.cosine_embedding_loss torch.hinge_embedding_loss torch.kl_div"
    " torch.margin_ranking_loss torch.triplet_margin_loss torch.cdist torch.pdist"
    " torch.binary_cross_entropy_with_logits F.softplus F.layer_norm F.group_norm F.rms_norm F.cosine_similarity"
    " F.poisson_nll_loss F.cosine_embedding_loss F.nll_loss F.hinge_embedding_loss F.kl_div F.l1_loss"
    " F.smooth_l1_loss F.huber_loss F.mse_loss F.margin_ranking_loss F.multilabel_margin_loss"
    " F.soft_margin_loss F.triplet_margin_loss F.multi_margin_loss F.binary_cross_entropy_with_logits"
    " F.pdist F.interpolate F.upsample F.upsample_nearest F.upsample_bilinear",
    # norm is fp32_append_dtype at aten level; in Python torch.norm reaches linalg_vector_norm,
    # whose policy is fp32_set_opt_dtype: the same result, a float32 output without a copy.
    CastPolicy.FP32_SET_OPT_DTYPE: _ops("prod", "softmax", "log_softmax", "cumprod", "cumsum", "sum", "norm")
    + " torch.linalg.vector_norm torch.linalg.matrix_norm F.softmax F.log_softmax",
    CastPolicy.PROMOTE: _ops("addcdiv", "addcmul", "atan2", "cross", "dot", "vdot", "scatter_add", "index_put")
    + " torch.bilinear F.bilinear torch.tensordot F.grid_sample",
}

# aten/src/ATen/autocast_mode.cpp, TORCH_LIBRARY_IMPL(aten, AutocastCPU, m): the ops a
# training step meets (the linear-algebra and FFT entries are left out).
_CPU = {
    CastPolicy.LOWER: _ops("bmm", "mm", "baddbmm", "addmm", "addbmm", "matmul", "prelu")
    + " Tensor.__matmul__ Tensor.__rmatmul__ torch.conv1d torch.conv2d torch.conv3d torch.conv_tbc"
    " torch.conv_transpose1d torch.conv_transpose2d torch.conv_transpose3d torch.linalg.vecdot"
    " F.linear F.conv1d F.conv2d F.conv3d F.conv_transpose1d F.conv_transpose2d F.conv_transpose3d"
    " F.prelu F.scaled_dot_product_attention",
    CastPolicy.FP32: _ops("prod", "cdist", "trace", "quantile", "nanquantile", "stft")
    + " torch.avg_pool3d F.avg_pool3d F.binary_cross_entropy F.grid_sample torch.polar F.max_pool3d"
    " F.adaptive_avg_pool3d F.adaptive_max_pool3d F.mse_loss F.cosine_embedding_loss F.nll_loss"
    " F.hinge_embedding_loss F.poisson_nll_loss F.smooth_l1_loss F.cross_entropy F.l1_loss F.huber_loss"
    " F.margin_ranking_loss F.soft_margin_loss F.triplet_margin_loss F.multi_margin_loss F.ctc_loss"
    " F.kl_div F.multilabel_margin_loss F.binary_cross_entropy_with_logits torch.cosine_embedding_loss"
    " torch.hinge_embedding_loss torch.poisson_nll_loss torch.kl_div torch.margin_ranking_loss"
    " torch.triplet_margin_loss torch.binary_cross_entropy_with_logits",
    CastPolicy.FP32_SET_OPT_DTYPE: "",
    CastPolicy.PROMOTE: _ops("index_copy") + " torch.cat torch.stack torch.concat torch.concatenate",
}


def _table(lists: dict[CastPolicy, str]) -> dict[Callable, CastPolicy]:
    return {fn: policy for policy, names in lists.items() for fn in _resolve(names)}


POLICIES: dict[Device, dict[Callable, CastPolicy]] = {Device.CUDA: _table(_CUDA), Device.CPU: _table(_CPU)}


def _eligible(t) -> bool:
    """``is_eligible``: a floating tensor that is not float64 (meta stands in for the device)."""
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64


class MetaAutocast:
    """An autocast region on meta tensors; the tracer's function mode consults ``active``.

    Use ``region()`` as the training loop's autocast factory.
    """

    def __init__(self, device: Device, dtype: torch.dtype):
        self.device = Device.parse(device)
        self.dtype = dtype
        self.policies = POLICIES[self.device]
        self.active = False
        # regions with enabled=False open inside this one (torch.autocast(..., enabled=False)): while any is,
        # nothing is cast, a checkpointed block's recomputation included (the tracer's function mode)
        self.paused = 0
        self._cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._depth = 0

    # -- the region --------------------------------------------------------------------
    def region(self) -> "MetaAutocast":
        return self

    def __enter__(self):
        self._depth += 1
        self.active = True
        return self

    def __exit__(self, *exc):
        self._depth -= 1
        if self._depth == 0:
            self.active = False
            self._cache.clear()  # autocast clears its weight-cast cache on leaving the outermost region

    # -- casting -----------------------------------------------------------------------
    def _cached_cast(self, to: torch.dtype, t):
        """``at::autocast::cached_cast``."""
        if not _eligible(t) or t.dtype == to:
            return t
        cacheable = to == self.dtype and t.dtype == torch.float32 and t.requires_grad and t.is_leaf and not t._is_view()
        if not cacheable:
            return t.to(to)
        hit = self._cache.get(id(t))
        if hit is not None and hit[0] is t:
            return hit[1]
        cast = t.to(to)
        self._cache[id(t)] = (t, cast)
        return cast

    def _cast_all(self, to, args, kwargs):
        cast = lambda t: self._cached_cast(to, t)  # noqa: E731
        return tree_map_only(torch.Tensor, cast, args), tree_map_only(torch.Tensor, cast, kwargs)

    def run(self, func, args: tuple, kwargs: dict, call: Callable):
        """Run ``func`` as autocast would, making its casts first; ``call(func, args, kwargs)``
        runs an op (through memcheck's kernel rules)."""
        special = _SPECIAL.get(func)
        if special is not None:
            return special(self, func, args, kwargs, call)
        policy = self.policies.get(func)
        if policy is CastPolicy.LOWER:
            args, kwargs = self._cast_all(self.dtype, args, kwargs)
        elif policy is CastPolicy.FP32:
            args, kwargs = self._cast_all(torch.float32, args, kwargs)
        elif policy is CastPolicy.FP32_SET_OPT_DTYPE:
            first = args[0] if args else next(iter(kwargs.values()), None)
            if _eligible(first) and kwargs.get("dtype") is None:
                kwargs = {**kwargs, "dtype": torch.float32}
        elif policy is CastPolicy.PROMOTE:
            floats = [t for t in tree_flatten((args, kwargs))[0] if _eligible(t)]
            to = torch.float32 if any(t.dtype == torch.float32 for t in floats) else self.dtype
            args, kwargs = self._cast_all(to, args, kwargs)
        return call(func, args, kwargs)


# F.cross_entropy's parameters, and its defaults other than None.
_CROSS_ENTROPY_NAMES = ("input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction",
                        "label_smoothing")
_CROSS_ENTROPY_DEFAULTS = {"ignore_index": -100, "reduction": "mean", "label_smoothing": 0.0}


def _cross_entropy(ac: MetaAutocast, func, args, kwargs, call):
    """CPU lists ``cross_entropy_loss`` itself as fp32. On CUDA it is composite, so
    autocast meets its parts: ``log_softmax`` (fp32_set_opt_dtype), then ``nll_loss`` (fp32)."""
    bound = bind(func, args, kwargs, names=_CROSS_ENTROPY_NAMES, defaults=_CROSS_ENTROPY_DEFAULTS)
    x, target = bound["input"], bound["target"]
    simple = (
        ac.device is Device.CUDA and _eligible(x) and x.dtype != torch.float32
        and not target.is_floating_point() and not bound["label_smoothing"]
        and bound["size_average"] is None and bound["reduce"] is None
    )
    if not simple:
        args, kwargs = ac._cast_all(torch.float32, args, kwargs)
        return call(func, args, kwargs)
    logp = call(torch.log_softmax, (x, 0 if x.dim() == 1 else 1), {"dtype": torch.float32})
    nll_kwargs = {"weight": bound["weight"], "ignore_index": bound["ignore_index"], "reduction": bound["reduction"]}
    return call(F.nll_loss, (logp, target), nll_kwargs)


def _mha_forward(ac: MetaAutocast, func, args, kwargs, call):
    """``multi_head_attention_forward`` is Python whose linears and attention autocast
    would cast: approximated by casting its floating inputs and weights first."""
    args, kwargs = ac._cast_all(ac.dtype, args, kwargs)
    return call(func, args, kwargs)


_SPECIAL: dict[Callable, Callable] = {F.cross_entropy: _cross_entropy, F.multi_head_attention_forward: _mha_forward}


class MetaGradScaler:
    """``torch.amp.GradScaler`` for one device, on meta tensors.

    The real scaler disables itself where CUDA is unavailable, so memcheck runs
    the same tensor work (torch/amp/grad_scaler.py): a float32 scale and an int32
    growth tracker, ``inv_scale`` and ``found_inf`` made in ``unscale_``, the
    in-place ``_amp_foreach_non_finite_check_and_unscale_`` on the gradients and
    ``_amp_update_scale_``. The step is always taken (no overflow assumed).
    """

    def __init__(self, init_scale: float = 2.0**16, device: str = "meta"):
        self.init_scale, self.device = init_scale, device
        self._scale = self._growth_tracker = None

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        if self._scale is None:
            self._scale = torch.full((), self.init_scale, dtype=torch.float32, device=self.device)
            self._growth_tracker = torch.full((), 0, dtype=torch.int32, device=self.device)
        return loss * self._scale

    def step(self, optimizer: torch.optim.Optimizer):
        inv_scale = self._scale.double().reciprocal().float()
        found_inf = torch.full((), 0.0, dtype=torch.float32, device=self.device)
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
        for grads in by_dtype.values():
            compat.amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
        self._found_inf = found_inf
        return optimizer.step()

    def update(self):
        compat.amp_update_scale_(self._scale, self._growth_tracker, self._found_inf, 2.0, 0.5, 2000)
        self._found_inf = None


_DEFAULT_DTYPE = {"cuda": torch.float16, "cpu": torch.bfloat16}  # torch.get_autocast_dtype's defaults


@contextlib.contextmanager
def meta_autocast_queries(tracer, device: Device):
    """``torch.is_autocast_enabled("meta")`` and ``torch.get_autocast_dtype("meta")`` answered
    as the target ``device`` would be in the tracer's emulated region, and ``torch.autocast("meta",
    ...)`` regions emulated as the target's (restored on exit).

    Code that asks autocast about its tensors' own device gets ``"meta"`` in a trace, which
    torch's functions reject ("unknown device type for autocast"): TRL's fused LM head picks
    its tile dtype that way (trl 1.16, trl/kernels/chunked_logprob.py:329-331, the loss of
    every ``SFTTrainer`` step), and PEFT's LoRA on a parameter (``ParamWrapper``: the fused experts
    of Mixtral-style MoE layers) opens ``torch.autocast(device_type=W.device.type, enabled=False)``
    around its fold (peft 0.21, peft/tuners/lora/layer.py ``_LoraParameterProxy.forward``), which
    torch refuses for "meta" ("unsupported autocast device_type"). Other device types are torch's own.
    """
    enabled, get_dtype, available = torch.is_autocast_enabled, torch.get_autocast_dtype, torch.amp.is_autocast_available
    target = Device.parse(device)
    default = _DEFAULT_DTYPE[target.value]
    regions = UserAutocast(tracer, target)  # a "meta" region is the target's: enabled=False pauses the emulation
    cls = torch.amp.autocast_mode.autocast
    init, enter, exit_ = cls.__init__, cls.__enter__, cls.__exit__

    def initialised(self, device_type, dtype=None, enabled=True, cache_enabled=None):
        if device_type != "meta":
            return init(self, device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)
        init(self, "cpu", enabled=False)  # a region that does nothing for real; emulated on enter
        self._memcheck_meta = (dtype or default, enabled)
        self._memcheck_asked = ("meta", None, False)  # what a train_step's emulation (UserAutocast) reads: none

    def entered(self):
        out = enter(self)
        if getattr(self, "_memcheck_meta", None) is not None:
            self._memcheck_meta_undo = regions._enter(target.value, *self._memcheck_meta)
        return out

    def exited(self, *exc):
        undo = getattr(self, "_memcheck_meta_undo", None)
        if undo is not None:
            self._memcheck_meta_undo = None
            undo(*exc)
        return exit_(self, *exc)

    def is_autocast_enabled(*args, **kwargs):
        if (args[0] if args else kwargs.get("device_type")) == "meta":
            return tracer.autocast is not None and tracer.autocast.active
        return enabled(*args, **kwargs)

    def get_autocast_dtype(*args, **kwargs):
        if (args[0] if args else kwargs.get("device_type")) == "meta":
            return tracer.autocast.dtype if tracer.autocast is not None else default
        return get_dtype(*args, **kwargs)

    def is_autocast_available(device_type):
        return device_type == "meta" or available(device_type)

    torch.is_autocast_enabled, torch.get_autocast_dtype = is_autocast_enabled, get_autocast_dtype
    torch.amp.is_autocast_available = is_autocast_available
    cls.__init__, cls.__enter__, cls.__exit__ = initialised, entered, exited
    try:
        yield
    finally:
        torch.is_autocast_enabled, torch.get_autocast_dtype = enabled, get_dtype
        torch.amp.is_autocast_available = available
        cls.__init__, cls.__enter__, cls.__exit__ = init, enter, exit_


class UserAutocast:
    """The ``torch.autocast`` regions that user code opens itself (a model file's ``train_step``,
    a script under ``memcheck run``), emulated on meta tensors for the target ``device``.

    A real ``torch.autocast`` does nothing to meta tensors (module docstring), and on a build
    without CUDA ``torch.autocast("cuda")`` disables itself in ``__init__`` with a warning. So
    while ``patched()`` is active every region's settings are read as written (``device_type``,
    ``dtype``, ``enabled``) and a ``MetaAutocast`` of that dtype is made the tracer's for the
    region; ``enabled=False`` inside a region switches the emulation off until it exits.
    ``regions`` counts the enabled regions entered, ``dtype`` is the last one's.
    """

    def __init__(self, tracer, device: Device):
        self.tracer, self.device = tracer, Device.parse(device)
        self.regions = 0
        self.dtype: torch.dtype | None = None
        self._open: list = []  # the regions this emulation entered and has not left

    def patched(self):
        """A context in which ``torch.autocast`` regions are emulated (``torch.autocast``'s
        methods wrapped; restored on exit)."""
        import torch.utils.checkpoint as checkpoint_module

        cls = torch.amp.autocast_mode.autocast
        init, enter, exit_ = cls.__init__, cls.__enter__, cls.__exit__
        user = self

        def initialised(self, device_type, dtype=None, enabled=True, cache_enabled=None):
            self._memcheck_asked = (device_type, dtype or _DEFAULT_DTYPE.get(device_type), enabled)
            with warnings.catch_warnings():  # "CUDA is not available ... Disabling autocast": emulated instead
                warnings.filterwarnings("ignore", message=".*Disabling autocast", category=UserWarning)
                init(self, device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)

        def entered(self):
            out = enter(self)
            self._memcheck_undo = user._enter(*getattr(self, "_memcheck_asked", (self.device, self.fast_dtype,
                                                                                 self._enabled)))
            return out

        def exited(self, *exc):
            undo = getattr(self, "_memcheck_undo", None)
            if undo is not None:
                undo(*exc)
            return exit_(self, *exc)

        # torch.utils.checkpoint recomputes a forward inside backward under the autocast state it
        # read when the forward ran (_get_autocast_kwargs, checkpoint.py: "device_autocast_kwargs,
        # cpu_autocast_kwargs = _get_autocast_kwargs(...)"; recompute_fn enters them again). A real
        # autocast is not enabled here (meta inputs, no CUDA), so it reads the emulated region's: the
        # recomputation then casts as the forward did, instead of running in fp32 and failing
        # checkpoint's metadata check.
        read_kwargs = checkpoint_module._get_autocast_kwargs

        def autocast_kwargs(device_type="cuda"):
            device_kwargs, cpu_kwargs = read_kwargs(device_type)
            region = user.tracer.autocast
            if region is not None and region.active and any(region is r for r in user._open):
                cpu_kwargs = dict(cpu_kwargs, enabled=True, dtype=region.dtype)
            return device_kwargs, cpu_kwargs

        @contextlib.contextmanager
        def active():
            cls.__init__, cls.__enter__, cls.__exit__ = initialised, entered, exited
            checkpoint_module._get_autocast_kwargs = autocast_kwargs
            try:
                yield self
            finally:
                cls.__init__, cls.__enter__, cls.__exit__ = init, enter, exit_
                checkpoint_module._get_autocast_kwargs = read_kwargs

        return active()

    def _enter(self, device_type: str, dtype, enabled: bool):
        """Start emulating one region; return what undoes it on exit (None: nothing to undo)."""
        tracer, outer = self.tracer, self.tracer.autocast
        if device_type not in ("cuda", "cpu"):
            return None
        if not enabled:
            if outer is None:
                return None
            was, outer.active = outer.active, False
            outer.paused += 1

            def reenable(*exc):
                outer.paused -= 1
                outer.active = was
            return reenable
        region = outer if outer is not None and outer.dtype == dtype else MetaAutocast(self.device, dtype)
        tracer.autocast = region
        region.__enter__()
        self._open.append(region)
        self.regions += 1
        self.dtype = dtype

        def leave(*exc):
            region.__exit__(*exc)
            self._open.pop()
            tracer.autocast = outer
        return leave

    def precision(self, default):
        """The precision the user's regions amount to (``default`` when none was entered)."""
        if not self.regions:
            return default
        return Precision.AMP_BF16 if self.dtype == torch.bfloat16 else Precision.AMP_FP16
