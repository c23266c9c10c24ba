"""memcheck: will this PyTorch training job fit in memory? Traced on the meta device, no GPU needed.

The public names below are imported when first used (PEP 562 ``__getattr__``): the command
line imports ``memcheck.cli`` through this package, and a command loads torch, transformers
and the engine only as far as it needs them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from memcheck.engine.compare import compare
    from memcheck.engine.estimate import estimate
    from memcheck.engine.plan import plan
    from memcheck.engine.plan_layout import plan_layout
    from memcheck.engine.preflight import check, preflight
    from memcheck.engine.script import run_script
    from memcheck.enums import Category, Device, Offload, Phase, Precision, Strategy, Task
    from memcheck.errors import (
        MemcheckError,
        ModelLoadError,
        TraceError,
        UnsupportedOpError,
        UsageError,
        WillNotFit,
    )
    from memcheck.job import Job, SettingError
    from memcheck.pictures.plot import plot_timeline
    from memcheck.pictures.snapshot import write_snapshot
    from memcheck.report.results import (
        Breakdown,
        Comparison,
        DeviceMemory,
        Estimate,
        EvalFix,
        LayoutPlan,
        ModuleMemory,
        Plan,
        Verdict,
    )
    from memcheck.report.timeline import Timeline
    from memcheck.rules.registry import register_op_rule
    from memcheck.config_gate import deepspeed_job
    from memcheck.training.strategies.layout import Layout

# Each public name and the module that defines it.
_HOME = {
    "compare": "memcheck.engine.compare",
    "estimate": "memcheck.engine.estimate",
    "plan": "memcheck.engine.plan",
    "plan_layout": "memcheck.engine.plan_layout",
    "check": "memcheck.engine.preflight",
    "preflight": "memcheck.engine.preflight",
    "run_script": "memcheck.engine.script",
    "Category": "memcheck.enums",
    "Device": "memcheck.enums",
    "Offload": "memcheck.enums",
    "Phase": "memcheck.enums",
    "Precision": "memcheck.enums",
    "Strategy": "memcheck.enums",
    "Task": "memcheck.enums",
    "MemcheckError": "memcheck.errors",
    "ModelLoadError": "memcheck.errors",
    "TraceError": "memcheck.errors",
    "UnsupportedOpError": "memcheck.errors",
    "UsageError": "memcheck.errors",
    "WillNotFit": "memcheck.errors",
    "Job": "memcheck.job",
    "SettingError": "memcheck.job",
    "plot_timeline": "memcheck.pictures.plot",
    "write_snapshot": "memcheck.pictures.snapshot",
    "Breakdown": "memcheck.report.results",
    "Comparison": "memcheck.report.results",
    "DeviceMemory": "memcheck.report.results",
    "Estimate": "memcheck.report.results",
    "EvalFix": "memcheck.report.results",
    "LayoutPlan": "memcheck.report.results",
    "ModuleMemory": "memcheck.report.results",
    "Plan": "memcheck.report.results",
    "Verdict": "memcheck.report.results",
    "Timeline": "memcheck.report.timeline",
    "register_op_rule": "memcheck.rules.registry",
    "deepspeed_job": "memcheck.config_gate",
    "Layout": "memcheck.training.strategies.layout",
}

__all__ = [
    "run_script",
    "Breakdown",
    "Category",
    "Comparison",
    "Device",
    "DeviceMemory",
    "Estimate",
    "EvalFix",
    "Job",
    "Layout",
    "LayoutPlan",
    "MemcheckError",
    "ModelLoadError",
    "ModuleMemory",
    "Offload",
    "Phase",
    "Plan",
    "Precision",
    "SettingError",
    "Strategy",
    "Task",
    "Timeline",
    "TraceError",
    "UnsupportedOpError",
    "UsageError",
    "Verdict",
    "WillNotFit",
    "check",
    "compare",
    "deepspeed_job",
    "estimate",
    "plan",
    "plan_layout",
    "plot_timeline",
    "preflight",
    "register_op_rule",
    "write_snapshot",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    """A public name, imported from its module on first use (then kept as a module attribute)."""
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'memcheck' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
