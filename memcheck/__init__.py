"""memcheck: will this PyTorch training job fit in memory? Traced on the meta device, no GPU needed."""

from memcheck.enums import Category, Device, Phase, Precision, Task
from memcheck.errors import (
    MemcheckError,
    ModelLoadError,
    TraceError,
    UnsupportedOpError,
    UsageError,
)
from memcheck.estimate import estimate
from memcheck.op_rules import register_op_rule
from memcheck.report import Breakdown, Estimate, ModuleMemory

__all__ = [
    "Breakdown",
    "Category",
    "Device",
    "Estimate",
    "MemcheckError",
    "ModelLoadError",
    "ModuleMemory",
    "Phase",
    "Precision",
    "Task",
    "TraceError",
    "UnsupportedOpError",
    "UsageError",
    "estimate",
    "register_op_rule",
]
__version__ = "0.1.0"
