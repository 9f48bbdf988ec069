"""Page layout of a namespace and validation of names and keys.

Pure functions: no I/O, no gRPC; they raise :class:`InvalidArgument`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.errors import InvalidArgument, shown

MAX_KEY_BYTES = 64
_NAMESPACE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}$")

# proto DType value -> (name, bytes per element)
DTYPES: dict[int, tuple[str, int]] = {1: ("fp16", 2), 2: ("bf16", 2), 3: ("fp8_e4m3", 1), 4: ("fp8_e5m2", 1), 5: ("fp32", 4)}


@dataclass(frozen=True, slots=True)
class PageLayout:
    """Bytes of one page and, optionally, the engine shape that fills it."""

    page_bytes: int
    block_tokens: int = 0
    num_layers: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    dtype: int = 0

    def __post_init__(self) -> None:
        if self.page_bytes <= 0:
            raise InvalidArgument("layout.page_bytes must be > 0")
        if any(v < 0 for v in (self.block_tokens, self.num_layers, self.kv_heads, self.head_dim)):
            raise InvalidArgument("layout: shape fields must be >= 0")
        shape = (self.block_tokens, self.num_layers, self.kv_heads, self.head_dim)
        if any(shape) or self.dtype:
            if not all(v > 0 for v in shape) or self.dtype not in DTYPES:
                raise InvalidArgument(
                    "layout: give all of block_tokens, num_layers, kv_heads, head_dim and dtype, or none of them"
                )
            expected = self.num_layers * 2 * self.block_bytes
            if expected != self.page_bytes:
                raise InvalidArgument(
                    f"layout: num_layers*2*block_tokens*kv_heads*head_dim*dtype_bytes = {expected}, "
                    f"but page_bytes = {self.page_bytes}"
                )

    @property
    def block_bytes(self) -> int:
        """Bytes of one layer's K (or V) for one block."""
        elem = DTYPES[self.dtype][1] if self.dtype else 0
        return self.block_tokens * self.kv_heads * self.head_dim * elem


def check_namespace(name: str) -> str:
    """A namespace name: 1-128 of letters, digits and ``._:/@+-``."""
    if not isinstance(name, str) or not _NAMESPACE.fullmatch(name):
        raise InvalidArgument(f"bad namespace name {shown(name)}: 1-128 chars of letters, digits, '._:/@+-', "
                              f"starting with a letter or digit")
    return name


def check_keys(keys: Sequence[bytes], *, allow_duplicates: bool = False) -> None:
    """Keys are 1..64 bytes; a batch that writes must not repeat a key."""
    for i, key in enumerate(keys):
        if not 0 < len(key) <= MAX_KEY_BYTES:
            raise InvalidArgument(f"key #{i} has {len(key)} bytes; keys must be 1..{MAX_KEY_BYTES} bytes")
    if not allow_duplicates and len(set(keys)) != len(keys):
        seen: set[bytes] = set()
        dup = next(k for k in keys if k in seen or seen.add(k))
        raise InvalidArgument(f"duplicate key {dup.hex()} in one batch")
