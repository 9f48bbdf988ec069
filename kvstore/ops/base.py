"""The page-op interface every backend implements, and its argument checks.

A node's page pool is one contiguous uint8 array ``[num_slots, page_bytes]``.
One page holds the KV of one prefix block for all layers. An engine's paged
KV cache comes in one of three layouts (``layout=`` of gather/scatter), any
dtype, moved as raw bytes:

- ``"pairs"``: per layer a ``(K, V)`` pair of C-contiguous ``[num_blocks,
  block_tokens, kv_heads, head_dim]`` tensors. Page: ``[num_layers][2 (K=0,
  V=1)][block_bytes]``.
- ``"kv_first"``: per layer one C-contiguous tensor ``[2, num_blocks, ...]``
  with K and V stacked in front (vLLM's FlashAttention layout). Its halves
  are used as the pair without a copy; page as for ``"pairs"``.
- ``"blocks"``: per layer one C-contiguous tensor ``[num_blocks, ...]`` whose
  block rows hold that layer's K and V together in the engine's own order
  (vLLM's CPU backend ``[num_blocks, kv_heads, block_size, 2 * head_size]``,
  FlashInfer's ``[num_blocks, 2, ...]``). Page: ``[num_layers][layer_block_bytes]``.
  The namespace must name the layout: pages of different layouts never mix.

Every layout reduces to a list of *segment* tensors of equal block size
(K0, V0, K1, V1, ... or L0, L1, ...), and page ``i`` is the concatenation of
segment block ``block_ids[i]`` of each, in that order.

:class:`PageOps` holds all validation, written once against the array API
shared by numpy and CuPy, and calls the backend's ``_pack``/``_unpack``/
``_gather``/``_scatter`` only after every check passed: a bad argument raises
:class:`KernelArgumentError` before any byte is written.
"""

from __future__ import annotations

import abc
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "ENGINE_LAYOUTS",
    "BackendUnavailableError",
    "EngineLayout",
    "KernelArgumentError",
    "PageOps",
]


ENGINE_LAYOUTS = ("pairs", "kv_first", "blocks")
"""Engine KV layouts gather/scatter accept (see the module docstring)."""


class KernelArgumentError(ValueError):
    """A page op was called with bad arguments; nothing was written."""


class BackendUnavailableError(RuntimeError):
    """The requested backend (e.g. CuPy on a GPU) cannot be used here."""


@dataclass(frozen=True)
class EngineLayout:
    """Validated geometry of an engine KV cache, shared by all its tensors."""

    num_layers: int
    num_blocks: int
    block_bytes: int
    """Bytes of one block of one segment tensor."""
    shape: tuple[int, ...]
    dtype: Any
    segments: int = 2
    """Segment tensors per layer: 2 (K, V) or 1 (a fused ``"blocks"`` layer)."""


def _int_arg(value: Any, what: str, minimum: int) -> int:
    """Return ``value`` as an int >= ``minimum`` (bools are rejected)."""
    if isinstance(value, (bool, np.bool_)):
        raise KernelArgumentError(f"{what} must be an integer, got {value!r}")
    try:
        result = operator.index(value)
    except TypeError:
        raise KernelArgumentError(f"{what} must be an integer, got {value!r}") from None
    if result < minimum:
        raise KernelArgumentError(f"{what} must be >= {minimum}, got {result}")
    return result


class PageOps(abc.ABC):
    """Moves pages between a page pool, staging buffers and engine KV caches.

    Subclasses set ``name``, ``device``, ``xp`` and ``host_visible``, and
    implement the hooks (``_is_native``, ``_upload_ids``, ``_data_ptr``) and
    the raw copies; the public methods here validate every argument first.
    """

    name: str
    device: str
    xp: Any
    host_visible: bool
    """True when pool memory is host memory that callers may read and write
    directly (numpy); False when it lives on a device (CuPy)."""

    # ------------------------------------------------------------------ hooks
    @abc.abstractmethod
    def _is_native(self, array: Any) -> bool:
        """Whether ``array`` is an array of this backend on this device."""

    @abc.abstractmethod
    def _upload_ids(self, ids: np.ndarray) -> Any:
        """Move validated host int64 ids to this backend's device."""

    @abc.abstractmethod
    def _data_ptr(self, array: Any) -> int:
        """Address of ``array``'s first byte (to detect aliasing tensors)."""

    @abc.abstractmethod
    def _pack(self, pool: Any, slots: Any, out: Any) -> None:
        """Copy ``pool[slots[i]]`` to ``out[i]``; arguments are validated."""

    @abc.abstractmethod
    def _unpack(self, staging: Any, slots: Any, pool: Any) -> None:
        """Copy ``staging[i]`` to ``pool[slots[i]]``; arguments are validated."""

    @abc.abstractmethod
    def _gather(self, layout: EngineLayout, kv_caches: list[tuple[Any, Any]],
                block_ids: Any, pool: Any, slots: Any) -> None:
        """Engine blocks to pages; arguments are validated."""

    @abc.abstractmethod
    def _scatter(self, layout: EngineLayout, pool: Any, slots: Any,
                 kv_caches: list[tuple[Any, Any]], block_ids: Any) -> None:
        """Pages to engine blocks; arguments are validated."""

    @abc.abstractmethod
    def empty_pool(self, num_slots: int, page_bytes: int) -> Any:
        """Allocate an uninitialised uint8 pool ``[num_slots, page_bytes]``."""

    @abc.abstractmethod
    def to_host(self, array: Any, out: np.ndarray | None = None) -> np.ndarray:
        """Return ``array`` as a host numpy array (into ``out`` if given)."""

    @abc.abstractmethod
    def from_host(self, host: np.ndarray) -> Any:
        """Return a host numpy array as an array of this backend."""

    @abc.abstractmethod
    def synchronize(self) -> None:
        """Wait until every op issued so far has finished."""

    def host_empty(self, shape: int | tuple[int, ...]) -> np.ndarray:
        """Uninitialised host bytes that downloads and uploads go to and from: page-locked (pinned) memory
        on a GPU, so copies run at the link's speed; plain memory here."""
        return np.empty(shape, dtype=np.uint8)

    # ------------------------------------------------------------ public ops
    def pack(self, pool: Any, slots: Any, out: Any = None) -> Any:
        """Gather ``pool[slots[i]]`` into ``out[i]`` (allocated when None).

        Duplicate slots are allowed. Returns the staging array ``out``.
        """
        self._check_pool(pool)
        ids = self._ids(slots, "slots", pool.shape[0], unique=False)
        n, page_bytes = int(ids.shape[0]), int(pool.shape[1])
        if out is None:
            out = self.xp.empty((n, page_bytes), dtype=self.xp.uint8)
        else:
            self._check_staging(out, n, page_bytes, "out", writable=True)
        if n:
            self._pack(pool, ids, out)
        return out

    def unpack(self, staging: Any, slots: Any, pool: Any) -> None:
        """Scatter ``staging[i]`` into ``pool[slots[i]]``; slots must be unique."""
        self._check_pool(pool, writable=True)
        ids = self._ids(slots, "slots", pool.shape[0], unique=True)
        n = int(ids.shape[0])
        self._check_staging(staging, n, int(pool.shape[1]), "staging", writable=False)
        if n:
            self._unpack(staging, ids, pool)

    def gather(self, kv_caches: Sequence[Any], block_ids: Any,
               pool: Any, slots: Any, *, layout: str = "pairs") -> None:
        """Engine -> pages: page ``pool[slots[i]]`` = all layers' K/V bytes of
        engine block ``block_ids[i]``. Target slots must be unique.
        ``layout`` is one of :data:`ENGINE_LAYOUTS`."""
        self._check_pool(pool, writable=True)
        caches = self._segment_list(kv_caches, layout)
        layout = self._check_engine(caches, int(pool.shape[1]), writable=False,
                                    strict_rank=layout == "pairs")
        blocks = self._ids(block_ids, "block_ids", layout.num_blocks, unique=False)
        ids = self._ids(slots, "slots", pool.shape[0], unique=True)
        self._check_paired(blocks, ids)
        if ids.shape[0]:
            self._gather(layout, caches, blocks, pool, ids)

    def scatter(self, pool: Any, slots: Any, kv_caches: Sequence[Any],
                block_ids: Any, *, layout: str = "pairs") -> None:
        """Pages -> engine: the inverse of :meth:`gather`. Target block ids
        must be unique."""
        self._check_pool(pool)
        caches = self._segment_list(kv_caches, layout)
        layout = self._check_engine(caches, int(pool.shape[1]), writable=True,
                                    strict_rank=layout == "pairs")
        ids = self._ids(slots, "slots", pool.shape[0], unique=False)
        blocks = self._ids(block_ids, "block_ids", layout.num_blocks, unique=True)
        self._check_paired(blocks, ids)
        if ids.shape[0]:
            self._scatter(layout, pool, ids, caches, blocks)

    # ----------------------------------------------------------- validation
    def _check_array(self, array: Any, what: str) -> None:
        """Reject anything that is not an array of this backend and device."""
        if not self._is_native(array):
            raise KernelArgumentError(
                f"{what} must be a {self.name} array on {self.device}, "
                f"got {type(array).__module__}.{type(array).__qualname__}"
                + (f" on {array.device}" if hasattr(array, "device") else ""))

    @staticmethod
    def _check_writable(array: Any, what: str) -> None:
        """Reject read-only arrays before anything is written."""
        flags = getattr(array, "flags", None)
        if flags is not None and not getattr(flags, "writeable", True):
            raise KernelArgumentError(f"{what} is read-only")

    def _check_pool(self, pool: Any, writable: bool = False) -> None:
        """A pool is a uint8, 2-D, C-contiguous array of this backend."""
        self._check_array(pool, "pool")
        if pool.dtype != np.uint8 or pool.ndim != 2:
            raise KernelArgumentError(
                f"pool must be uint8 [num_slots, page_bytes], got {pool.dtype} "
                f"shape {tuple(pool.shape)}")
        if not pool.flags.c_contiguous:
            raise KernelArgumentError("pool must be C-contiguous")
        if writable:
            self._check_writable(pool, "pool")

    def _check_staging(self, staging: Any, n: int, page_bytes: int, what: str,
                       writable: bool) -> None:
        """Staging is uint8 ``[n, page_bytes]``, C-contiguous, this backend."""
        self._check_array(staging, what)
        if staging.dtype != np.uint8 or tuple(staging.shape) != (n, page_bytes):
            raise KernelArgumentError(
                f"{what} must be uint8 shape {(n, page_bytes)}, got {staging.dtype} "
                f"shape {tuple(staging.shape)}")
        if not staging.flags.c_contiguous:
            raise KernelArgumentError(f"{what} must be C-contiguous")
        if writable:
            self._check_writable(staging, what)

    def _ids(self, ids: Any, what: str, upper: int, unique: bool) -> Any:
        """Validate ids (1-D integers in ``[0, upper)``, unique if asked) and
        return them as an int64 array on this backend's device.

        Host inputs (lists, numpy) are checked on the host before uploading;
        device inputs are checked where they live.
        """
        if self._is_native(ids):
            arr, xp = ids, self.xp
        else:
            try:
                arr = np.asarray(ids)
            except (TypeError, ValueError) as exc:
                raise KernelArgumentError(
                    f"{what} must be a 1-D sequence of integers: {exc}") from None
            xp = np
        if arr.ndim != 1:
            raise KernelArgumentError(f"{what} must be 1-D, got shape {tuple(arr.shape)}")
        if arr.size == 0:
            arr = xp.empty((0,), dtype=xp.int64)
        elif arr.dtype.kind not in "iu":
            raise KernelArgumentError(f"{what} must hold integers, got dtype {arr.dtype}")
        else:
            lo, hi = int(arr.min()), int(arr.max())
            if lo < 0 or hi >= upper:
                bad = lo if lo < 0 else hi
                raise KernelArgumentError(
                    f"{what} out of range: {bad} not in [0, {upper})")
            arr = arr.astype(xp.int64, copy=False)
            if unique and arr.size > 1:
                ordered = xp.sort(arr)
                dups = ordered[1:][ordered[1:] == ordered[:-1]]
                if dups.size:
                    raise KernelArgumentError(
                        f"{what} must be unique (they are write targets); "
                        f"{int(dups[0])} appears more than once")
        if not arr.flags.c_contiguous:
            arr = xp.ascontiguousarray(arr)
        return arr if xp is self.xp else self._upload_ids(arr)

    @staticmethod
    def _check_paired(block_ids: Any, slots: Any) -> None:
        """block_ids and slots pair up one to one."""
        if block_ids.shape[0] != slots.shape[0]:
            raise KernelArgumentError(
                f"block_ids and slots differ in length: {block_ids.shape[0]} != "
                f"{slots.shape[0]}")

    @staticmethod
    def _kv_list(kv_caches: Any) -> list[tuple[Any, Any]]:
        """Normalise ``kv_caches`` to a list of (K, V) pairs."""
        try:
            layers = list(kv_caches)
        except TypeError:
            raise KernelArgumentError(
                "kv_caches must be a sequence of (K, V) pairs") from None
        caches = []
        for l, pair in enumerate(layers):
            try:
                k, v = pair
            except (TypeError, ValueError):
                raise KernelArgumentError(
                    f"kv_caches[{l}] must be a (K, V) pair") from None
            caches.append((k, v))
        return caches

    def _segment_list(self, kv_caches: Any, layout: str) -> list[tuple[Any, ...]]:
        """Per layer, the tuple of its segment tensors for ``layout``."""
        if layout == "pairs":
            return self._kv_list(kv_caches)
        if layout not in ENGINE_LAYOUTS:
            raise KernelArgumentError(f"layout must be one of {ENGINE_LAYOUTS}, got {layout!r}")
        try:
            layers = list(kv_caches)
        except TypeError:
            raise KernelArgumentError("kv_caches must be a sequence of one tensor per layer") from None
        out: list[tuple[Any, ...]] = []
        for l, tensor in enumerate(layers):
            what = f"kv_caches[{l}]"
            self._check_array(tensor, what)
            if not tensor.flags.c_contiguous:
                raise KernelArgumentError(f"{what} must be C-contiguous")
            if layout == "blocks":
                if tensor.ndim < 2:
                    raise KernelArgumentError(f"{what} must be [num_blocks, ...], got shape {tuple(tensor.shape)}")
                out.append((tensor,))
            else:
                if tensor.ndim < 3 or tensor.shape[0] != 2:
                    raise KernelArgumentError(
                        f"{what} must be [2 (K, V), num_blocks, ...], got shape {tuple(tensor.shape)}")
                out.append((tensor[0], tensor[1]))  # C-contiguous halves, no copy
        return out

    def _check_engine(self, caches: list[tuple[Any, ...]], page_bytes: int,
                      writable: bool, strict_rank: bool = True) -> EngineLayout:
        """All segment tensors share one C-contiguous shape and dtype (4-D
        for (K, V) pairs), every layer has as many, and
        ``num_layers * segments * block_bytes == page_bytes``."""
        if not caches:
            raise KernelArgumentError("kv_caches must hold at least one layer")
        first = caches[0][0]
        self._check_array(first, "kv_caches[0][0]")
        shape, dtype = tuple(first.shape), first.dtype
        segments = len(caches[0])
        if any(len(pair) != segments for pair in caches):
            raise KernelArgumentError("every layer must have the same number of segment tensors")
        if segments == 1 and len(shape) < 2:
            raise KernelArgumentError(f"engine tensors must be [num_blocks, ...], got shape {shape}")
        if segments == 2 and (len(shape) != 4 if strict_rank else len(shape) < 2):
            raise KernelArgumentError(
                f"engine tensors must be 4-D [num_blocks, block_tokens, kv_heads, "
                f"head_dim], got shape {shape}")
        if dtype.hasobject or dtype.itemsize == 0:
            raise KernelArgumentError(f"engine dtype {dtype} is not a plain data type")
        ptrs: dict[int, str] = {}
        for l, pair in enumerate(caches):
            for t, tensor in enumerate(pair):
                what = f"kv_caches[{l}][{t}]"
                self._check_array(tensor, what)
                if tuple(tensor.shape) != shape or tensor.dtype != dtype:
                    raise KernelArgumentError(
                        f"{what} is {tensor.dtype} {tuple(tensor.shape)}, but "
                        f"kv_caches[0][0] is {dtype} {shape}; all must match")
                if not tensor.flags.c_contiguous:
                    raise KernelArgumentError(f"{what} must be C-contiguous")
                if writable:
                    self._check_writable(tensor, what)
                    ptr = self._data_ptr(tensor)
                    if ptr in ptrs and tensor.size:
                        raise KernelArgumentError(
                            f"{what} aliases {ptrs[ptr]}; scatter targets must be distinct")
                    ptrs[ptr] = what
        block_bytes = int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize
        num_layers = len(caches)
        if num_layers * segments * block_bytes != page_bytes:
            raise KernelArgumentError(
                f"page_bytes mismatch: pool pages are {page_bytes} bytes but "
                f"{num_layers} layers x {segments} x {block_bytes} block bytes = "
                f"{num_layers * segments * block_bytes} (engine shape {shape}, {dtype})")
        return EngineLayout(num_layers, int(shape[0]), block_bytes, shape, dtype, segments)


    def _check_empty_pool_args(self, num_slots: int, page_bytes: int) -> tuple[int, int]:
        """Validate :meth:`empty_pool` arguments."""
        return (_int_arg(num_slots, "num_slots", 0), _int_arg(page_bytes, "page_bytes", 1))

    def __repr__(self) -> str:
        return f"<{type(self).__name__} name={self.name!r} device={self.device!r}>"
