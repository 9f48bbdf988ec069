"""Byte sizes as people write them ("4GiB", "512MiB", "1e9") and read them ("4.0 GiB").

The units and the formatting are pydantic's :class:`~pydantic.ByteSize`; on top of it a size may be written
in scientific notation (``1e9``, ``1.5e3KiB``) and with the short binary units ``Ki``, ``Mi``, ``Gi``, ``Ti``.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

from pydantic import ByteSize

_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?(?:[eE][+]?[0-9]+)?)\s*([A-Za-z]*)\s*")
_MAX_SIZE = 1 << 62
_FORMS = "use a number with an optional unit (B, KB, MB, GB, KiB, MiB, GiB, TiB)"


def _unit(name: str) -> int | None:
    """Bytes in one ``name`` (any case; ``Gi`` is ``GiB``); None for anything but a byte unit."""
    name = name.lower() or "b"
    name = name + "b" if name.endswith("i") else name
    value = ByteSize.byte_sizes.get(name)
    return value if isinstance(value, int) and not name.endswith("bit") and name[0] not in "pe" else None


def parse_size(text: str | int) -> int:
    """Parse a byte size; raises ValueError with the accepted forms."""
    if isinstance(text, bool):
        raise ValueError(f"bad size {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"size must be >= 0, got {text}")
        return text
    match = _SIZE.fullmatch(str(text))
    unit = _unit(match.group(2)) if match else None
    if match is None or unit is None:
        raise ValueError(f"bad size {text!r}: {_FORMS}")
    try:
        value = Decimal(match.group(1)) * unit
    except InvalidOperation:
        raise ValueError(f"bad size {text!r}") from None
    if value > _MAX_SIZE:
        raise ValueError(f"size {text!r} is too large")
    return int(value)


def format_size(n: float) -> str:
    """Bytes with a binary unit, e.g. ``4.0 GiB`` (``1023 B`` below a KiB)."""
    return re.sub(r"^(-?[0-9.]+)", r"\1 ", ByteSize(int(n)).human_readable(), count=1)
