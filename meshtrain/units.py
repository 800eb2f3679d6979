"""Byte counts for people: the one byte formatter (standard library only, so a command that prints a size,
``meshtrain launch`` among them, loads no JAX for it)."""

from __future__ import annotations

import math
from typing import Optional

BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def fmt_bytes(n: float, spec: str = ".2f", unit: Optional[str] = None) -> str:
    """``n`` bytes in the largest binary unit it reaches (up to TiB), or in ``unit``, the number formatted
    with ``spec``; whole bytes print as an integer, infinity as ``unlimited``. The one byte formatter:
    ``fmt_bytes(3 * 2 ** 29)`` → ``'1.50 GiB'``, ``fmt_bytes(n, ".3g")`` → 3 significant digits."""
    if math.isinf(n):
        return "unlimited"
    if unit is None:
        power = next((p for p in range(len(BYTE_UNITS) - 1, 0, -1) if abs(n) >= 1024 ** p), 0)
    else:
        power = BYTE_UNITS.index(unit)
    if power == 0:
        return f"{n:.0f} B"
    return f"{n / 1024 ** power:{spec}} {BYTE_UNITS[power]}"
