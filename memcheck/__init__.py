"""memcheck: will this PyTorch training job fit in memory? Traced on the meta device, no GPU needed."""

from memcheck.engine.compare import compare
from memcheck.engine.estimate import estimate
from memcheck.engine.plan import plan
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
    ModuleMemory,
    Plan,
    Verdict,
)
from memcheck.report.timeline import Timeline
from memcheck.rules.registry import register_op_rule

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
    "estimate",
    "plan",
    "plot_timeline",
    "preflight",
    "register_op_rule",
    "write_snapshot",
]
__version__ = "0.1.0"
