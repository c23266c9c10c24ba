"""memcheck: will this PyTorch training job fit in memory? Traced on the meta device, no GPU needed."""

from memcheck.compare import compare
from memcheck.enums import Category, Device, Offload, Phase, Precision, Strategy, Task
from memcheck.errors import (
    MemcheckError,
    ModelLoadError,
    TraceError,
    UnsupportedOpError,
    UsageError,
)
from memcheck.estimate import estimate
from memcheck.op_rules import register_op_rule
from memcheck.report import Breakdown, Comparison, DeviceMemory, Estimate, ModuleMemory

__all__ = [
    "Breakdown",
    "Category",
    "Comparison",
    "Device",
    "DeviceMemory",
    "Estimate",
    "MemcheckError",
    "ModelLoadError",
    "ModuleMemory",
    "Offload",
    "Phase",
    "Precision",
    "Strategy",
    "Task",
    "TraceError",
    "UnsupportedOpError",
    "UsageError",
    "compare",
    "estimate",
    "register_op_rule",
]
__version__ = "0.1.0"
