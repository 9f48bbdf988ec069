"""Page keys from token ids: a chained hash, stable across processes and hosts.

``key[i] = BLAKE2b(digest_size=16, key=b"", data = key[i-1] || tokens_i)``
where ``tokens_i`` are block ``i``'s token ids as little-endian uint32 and
``key[-1] = BLAKE2b-16(b"kvstore/v1/root" || salt)``. Equal leading keys
therefore mean an equal prefix (the convention of vLLM prefix caching and of
the Mooncake traces' ``hash_ids``). ``salt`` separates what must never share
pages although the tokens match (model, LoRA adapter, tenant): the namespace
already separates layouts. Only full blocks get keys; a trailing partial
block is not cacheable. Python's ``hash()`` is salted per process and is never
used.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

KEY_BYTES = 16
_ROOT = b"kvstore/v1/root"


def root_key(salt: bytes = b"") -> bytes:
    """The parent of block 0 for a given salt."""
    return hashlib.blake2b(_ROOT + salt, digest_size=KEY_BYTES).digest()


def chain_keys(token_ids: Sequence[int] | np.ndarray, block_tokens: int, *, salt: bytes = b"",
               parent: bytes | None = None) -> list[bytes]:
    """Keys of every full ``block_tokens`` block of ``token_ids``.

    ``parent`` continues a chain (the key of the block before ``token_ids``).
    """
    if block_tokens <= 0:
        raise ValueError("block_tokens must be > 0")
    try:
        tokens = np.asarray(token_ids)
        if tokens.dtype == object:
            tokens = tokens.astype(np.int64)
    except (OverflowError, TypeError, ValueError):
        raise ValueError("token ids must be integers that fit in uint32") from None
    if tokens.ndim != 1:
        raise ValueError("token_ids must be 1-D")
    if tokens.size and not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"token ids must be integers, got {tokens.dtype}")
    if tokens.size and (tokens.min() < 0 or tokens.max() > 0xFFFFFFFF):
        raise ValueError("token ids must fit in uint32")
    data = tokens.astype("<u4", copy=False).tobytes()
    step = block_tokens * 4
    key = root_key(salt) if parent is None else parent
    keys = []
    for start in range(0, len(data) - step + 1, step):
        key = hashlib.blake2b(key + data[start:start + step], digest_size=KEY_BYTES).digest()
        keys.append(key)
    return keys
