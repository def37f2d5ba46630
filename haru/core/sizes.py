"""Byte sizes: the one reading of a size a person wrote, and the one way Haru prints one.

    parse_size("20GiB") == 21474836480      bytes from an int or a number with a unit
    format_size(1536) == "1.5 KiB"           bytes as a person reads them, the unit chosen to fit
    format_gib(15891378995) == "14.8 GiB"    VRAM, in the unit every Haru output uses for it

Units: B, KiB, MiB, GiB, TiB (powers of 1024) and KB, MB, GB, TB (powers of 1000), any case; a number
without a unit is bytes.
"""

from __future__ import annotations

import re

__all__ = ["KiB", "MiB", "GiB", "TiB", "SIZE_UNITS", "parse_size", "format_size", "format_gib"]

KiB = 1024
MiB = 1024**2
GiB = 1024**3
TiB = 1024**4

SIZE_UNITS: dict[str, int] = {
    "b": 1,
    "kib": KiB,
    "mib": MiB,
    "gib": GiB,
    "tib": TiB,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*")


def parse_size(value: object) -> int:
    """Bytes from an int or a string with a unit (`20GiB`, `44.2 GiB`, `512MiB`, `1.5GB`, `1073741824`).

    Raises ValueError with a message saying what is accepted.
    """
    if isinstance(value, bool):
        raise ValueError(f"size {value!r} is a boolean; give bytes or a string like '20GiB'")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"size {value} is negative")
        return value
    if isinstance(value, str):
        m = _SIZE.fullmatch(value)
        if m is not None:
            number, unit = m.group(1), m.group(2).lower() or "b"
            if unit in SIZE_UNITS:
                return round(float(number) * SIZE_UNITS[unit])
            raise ValueError(
                f"size {value!r} has unknown unit {m.group(2)!r}; use one of B, KiB, MiB, GiB, TiB, KB, MB, GB, TB"
            )
        raise ValueError(f"size {value!r} is not a number with a unit, like '20GiB', '44.2 GiB' or '512MiB'")
    raise ValueError(f"size {value!r} must be an integer number of bytes or a string like '20GiB'")


def format_size(n: float) -> str:
    """`512 B`, `1.5 KiB`, `14.8 GiB`, `2.0 TiB`: one decimal, in the largest unit the size reaches."""
    for unit, size in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def format_gib(n: int) -> str:
    """`14.8 GiB`: bytes as GiB with one decimal, the unit every Haru output uses for VRAM."""
    return f"{n / GiB:.1f} GiB"
