"""Byte units. memcheck counts integer bytes and prints binary units (GiB = 2**30)."""

from __future__ import annotations

import re

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
        value = int(float(match.group(1)) * _UNITS.get(unit, 1))
    if value <= 0:
        raise UsageError(f"{what} {text!r} must be greater than zero")
    return value


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
