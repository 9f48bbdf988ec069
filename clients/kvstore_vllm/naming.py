"""Stable names: the namespace an engine's pages live in, and the keys of a
request's blocks. Both are the same in every process and on every host."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence

from kvstore_client import chain_keys

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def _tag(text: str, limit: int) -> str:
    """A readable, name-safe, bounded form of ``text`` plus a short digest."""
    digest = hashlib.blake2b(text.encode(), digest_size=4).hexdigest()
    readable = _UNSAFE.sub("-", text.rstrip("/").rsplit("/", 1)[-1]).strip("-.")[:limit] or "x"
    return f"{readable}-{digest}"


def namespace_for(prefix: str, model: str, dtype: str, num_layers: int, kv_heads: int, head_size: int,
                  block_size: int, device: str, tp_rank: int, tp_size: int, layout_tag: str = "") -> str:
    """``prefix.model-hash.dtype.L<layers>H<heads>D<dim>B<block>.<device>[.tag].tp<r>of<n>``.

    Everything that changes a page's bytes is in the name: pages of one
    namespace are interchangeable between engines, never across layouts.
    """
    layout = f"{dtype}.L{num_layers}H{kv_heads}D{head_size}B{block_size}.{device}"
    if layout_tag:
        layout += "." + _UNSAFE.sub("-", layout_tag)[:24]
    name = f"{prefix}.{_tag(model, 40)}.{layout}.tp{tp_rank}of{tp_size}"
    if len(name) > 128:
        raise ValueError(f"namespace {name!r} is longer than 128 characters; set 'namespace' explicitly")
    return name


def request_salt(cache_salt: str | None, lora_name: str | None = None) -> bytes:
    """What separates requests whose tokens match but whose KV must not be shared."""
    parts = []
    if cache_salt:
        parts.append(b"salt=" + cache_salt.encode())
    if lora_name:
        parts.append(b"lora=" + lora_name.encode())
    return b"\0".join(parts)


def block_keys(token_ids: Sequence[int], block_size: int, salt: bytes = b"") -> list[bytes]:
    """Keys of every full block (kvstore's BLAKE2b chain over token ids)."""
    return chain_keys(list(token_ids), block_size, salt=salt)
