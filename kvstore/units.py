"""Human byte sizes ("4GiB", "512MiB", "1e9") for flags and config files."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "ki": 1024, "kib": 1024, "mi": 1024**2, "mib": 1024**2, "gi": 1024**3, "gib": 1024**3, "ti": 1024**4, "tib": 1024**4,
}
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?(?:[eE][+]?[0-9]+)?)\s*([A-Za-z]*)\s*")
_MAX_SIZE = 1 << 62


def parse_size(text: str | int) -> int:
    """Parse a byte size; raises ValueError with the accepted forms."""
    if isinstance(text, bool):
        raise ValueError(f"bad size {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"size must be >= 0, got {text}")
        return text
    match = _SIZE.fullmatch(str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"bad size {text!r}: use a number with an optional unit (B, KB, MB, GB, KiB, MiB, GiB, TiB)")
    try:
        value = Decimal(match.group(1)) * _UNITS[match.group(2).lower()]
    except InvalidOperation:
        raise ValueError(f"bad size {text!r}") from None
    if value > _MAX_SIZE:
        raise ValueError(f"size {text!r} is too large")
    return int(value)


def format_size(n: float) -> str:
    """Format bytes with a binary unit, e.g. 4.0 GiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
