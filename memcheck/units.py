"""Byte units. memcheck counts integer bytes and prints binary units (GiB = 2**30).

Also the integer arithmetic every layer counts bytes with: ``ceil_div``, ``round_up``
and a tensor's ``nbytes``. torch is not imported here (``nbytes`` reads any object
with ``numel()`` and ``element_size()``), so the lowest layers can use them.
"""

from __future__ import annotations

import re
from fractions import Fraction

from memcheck.errors import UsageError

KiB = 2**10
MiB = 2**20
GiB = 2**30

_UNITS = {
    "b": 1,
    "kib": KiB, "mib": MiB, "gib": GiB, "tib": 2**40,
    "k": KiB, "m": MiB, "g": GiB, "t": 2**40,  # bare letters: binary, as nvidia-smi and torch print
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,  # SI units mean SI
}
# The largest size memcheck takes (a capacity, a budget): 1 PiB. The largest GPUs hold under 2**38
# bytes (288 GB) and the largest hosts (a CPU budget) a few TiB, so nothing real comes near it, and
# the byte counts the allocator simulation adds up stay far inside int64.
MAX_BYTES = 2**50
UNITS = tuple(_UNITS)  # the unit names parse_size takes, lower-cased
_SIZE = re.compile(r"^\s*(-?[0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")  # a sign, so "-1GiB" is told it is not > 0


def parse_size(text: str | int, *, what: str = "size") -> int:
    """Parse '24GiB', '24 GB', '512MiB' or a plain byte count into bytes.

    Raises:
        UsageError: naming the bad value and the accepted units.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        match = _SIZE.match(str(text))
        unit = match.group(2).lower() if match else None
        if not match or unit not in _UNITS and unit != "":
            raise UsageError(
                f"{what} {text!r} is not a size; use a number with a unit such as 24GiB, 80GB or 512MiB"
            )
        # exact: a float would round, and overflow to infinity for a number of 400 digits
        value = int(Fraction(match.group(1)) * _UNITS.get(unit, 1))
    if value <= 0:
        raise UsageError(f"{what} {text!r} must be greater than zero")
    if value > MAX_BYTES:
        raise UsageError(f"{what} {short_repr(text)} is too large: at most 1 PiB (2**50 bytes), far above any "
                         "GPU's or host's memory")
    return value


def short_repr(value) -> str:
    """``repr(value)``, a very long one cut in the middle (a 400-digit number stays one readable line)."""
    text = repr(value)
    if len(text) <= 40:
        return text
    return f"{text[:18]}…{text[-18:]} ({len(text)} {'digits' if isinstance(value, int) else 'characters'})"


def format_bytes(n: int) -> str:
    """Format a byte count with a binary unit label: '1.50 GiB', '12.0 MiB', '512 B'."""
    sign = "-" if n < 0 else ""
    n = abs(n)
    if n >= GiB:
        return f"{sign}{n / GiB:.2f} GiB"
    if n >= MiB:
        return f"{sign}{n / MiB:.1f} MiB"
    if n >= KiB:
        return f"{sign}{n / KiB:.1f} KiB"
    return f"{sign}{n} B"


def ceil_div(x: int, m: int) -> int:
    """``ceil(x / m)`` for integers, ``m > 0`` (CUDA's ``ceil_div``, ``(x + m - 1) / m``)."""
    return (x + m - 1) // m


def round_up(x: int, m: int) -> int:
    """``x`` rounded up to a multiple of ``m > 0`` (``round_up`` / ``align_up`` in the CUDA sources)."""
    return ceil_div(x, m) * m


def nbytes(t) -> int:
    """Bytes of a tensor's elements, ``numel() * element_size()``; 0 for None or anything
    that is not a tensor (no ``numel``/``element_size`` methods)."""
    numel, element_size = getattr(t, "numel", None), getattr(t, "element_size", None)
    if not (callable(numel) and callable(element_size)) or isinstance(t, type):
        return 0
    return numel() * element_size()
