"""Sizes for people to read."""

from __future__ import annotations


def fmt_bytes(n: float | None) -> str:
    """Human-readable size (B, KiB, MiB, …); '-' for None."""
    if n is None:
        return "-"
    x = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(x) < 1024 or unit == "TiB":
            return f"{x:.0f} {unit}" if unit == "B" else f"{x:.2f} {unit}"
        x /= 1024
    return str(n)
