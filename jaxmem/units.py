"""Byte counts for people."""

from __future__ import annotations


def human_bytes(n: int | float) -> str:
    """Format a byte count with a binary unit.

    Example:
        >>> human_bytes(1536), human_bytes(3 * 2**30)
        ('1.5 KiB', '3.0 GiB')
    """
    value = float(n)
    for unit in ("B", "KiB", "MiB"):
        if abs(value) < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"
