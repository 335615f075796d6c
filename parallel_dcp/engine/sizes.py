"""Sizes in bytes read from what a user types (``"512MiB"``) and written as a person reads them
(``"1.5 KiB"``), for limits, messages and reports."""

from __future__ import annotations

import re

__all__ = ["format_at_least", "format_bytes", "format_rate", "parse_size"]

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | str, what: str = "a memory limit") -> int:
    """Bytes from an int or a string such as ``"512MiB"``, ``"32GiB"``, ``"16GB"``, ``"1.5G"``.

    Decimal units (kB, MB, GB, TB) are powers of 1000, binary ones (KiB, MiB, GiB, TiB) of 1024.
    ``what`` names the size in the error ("a memory limit", "the shard size", ...).

    Raises:
        ValueError: not a positive size, or an unknown unit.
    """
    if isinstance(value, bool):
        raise ValueError(f"not a size: {value!r}")
    if isinstance(value, int):
        size = value
    else:
        match = _SIZE.match(str(value))
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(f"not a size: {value!r} (use bytes or a unit: 512MiB, 32GiB, 16GB)")
        size = int(float(match.group(1)) * _UNITS[unit])
    if size <= 0:
        raise ValueError(f"{what} must be positive, got {value!r}")
    return size


def format_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def format_at_least(n: int) -> str:
    """``n`` bytes in the unit :func:`format_bytes` picks, rounded up, never to nearest: an advised
    minimum (``raise --memory-limit to at least 24.1 MiB``), which :func:`parse_size` reads back
    as no less than ``n``, so the figure a refusal advises is accepted when passed back."""
    if n < 1024:
        return f"{n} B"
    scale, unit = 1024, "KiB"
    for larger in ("MiB", "GiB", "TiB"):
        if n < scale * 1024:
            break
        scale, unit = scale * 1024, larger
    tenths = -(-n * 10 // scale)  # (an integer ceiling: no float rounding it down)
    return f"{tenths // 10}.{tenths % 10} {unit}"


def format_rate(nbytes: float, seconds: float) -> str:
    """``"750.0 MiB/s"``: a rate in the unit that shows it (a small job is not ``0.00 GiB/s``)."""
    return f"{format_bytes(nbytes / seconds)}/s" if seconds > 0 else "-"
