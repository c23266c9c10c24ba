"""Optimizer choices, built the way torch builds them on the target device.

torch picks the ``foreach`` (whole-parameter-list) implementation by default only
when every parameter is on CUDA (``torch.optim.optimizer._default_to_fused_or_foreach``);
on CPU, and on meta, it runs the per-parameter loop. Tracing on meta therefore
needs ``foreach`` set explicitly for a CUDA target, or the list-wide temporaries
of ``step()`` would be missed.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch

from memcheck.enums import Device
from memcheck.errors import UsageError, closest

OptimizerFactory = Callable[[Any], torch.optim.Optimizer]

OPTIMIZERS: dict[str, tuple[type, dict]] = {
    "adamw": (torch.optim.AdamW, {}),
    "adam": (torch.optim.Adam, {}),
    "sgd": (torch.optim.SGD, {"lr": 1e-3}),
    "sgd-momentum": (torch.optim.SGD, {"lr": 1e-3, "momentum": 0.9}),
}


def _for_target(cls: type, kwargs: dict, device: Device) -> dict:
    """Set ``foreach`` as torch's default would on ``device``."""
    params = inspect.signature(cls.__init__).parameters
    if "foreach" in params and kwargs.get("foreach") is None and not kwargs.get("fused"):
        kwargs = {**kwargs, "foreach": device is Device.CUDA}
    return kwargs


def resolve_optimizer(optimizer, device: Device) -> tuple[str, OptimizerFactory]:
    """Turn a name, a factory ``params -> Optimizer`` or an Optimizer instance into ``(label, factory)``."""
    if isinstance(optimizer, str):
        key = optimizer.strip().lower()
        if key not in OPTIMIZERS:
            raise UsageError(
                f"unknown optimizer {optimizer!r}{closest(key, OPTIMIZERS)}; allowed: {', '.join(OPTIMIZERS)}"
            )
        cls, kwargs = OPTIMIZERS[key]
        kwargs = _for_target(cls, kwargs, device)
        return key, lambda params: cls(params, **kwargs)
    if isinstance(optimizer, torch.optim.Optimizer):
        cls, kwargs = type(optimizer), _for_target(type(optimizer), dict(optimizer.defaults), device)
        return cls.__name__, lambda params: cls(params, **kwargs)
    if callable(optimizer):
        label = getattr(optimizer, "__name__", type(optimizer).__name__)
        return label, optimizer
    raise UsageError(
        f"optimizer must be a name ({', '.join(OPTIMIZERS)}), a function of the parameters, "
        f"or an Optimizer, not {type(optimizer).__name__}"
    )
