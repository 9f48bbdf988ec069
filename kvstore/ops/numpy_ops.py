"""CPU page ops on numpy: the fallback every node can run.

All copies are vectorised (``np.take`` into a preallocated ``out``, fancy
assignment); the only Python loops run over layers and K/V, never bytes.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .base import EngineLayout, KernelArgumentError, PageOps

__all__ = ["NumpyPageOps"]

_ROW_LOOP_BYTES = 16 << 10


def _block_rows(tensor: np.ndarray, layout: EngineLayout) -> np.ndarray:
    """View a C-contiguous engine tensor as uint8 ``[num_blocks, block_bytes]``
    (no copy: writes through the view land in the tensor)."""
    return tensor.view(np.uint8).reshape(layout.num_blocks, layout.block_bytes)


def _page_segments(pool: np.ndarray, layout: EngineLayout) -> np.ndarray:
    """View the pool as ``[num_slots, num_layers, segments, block_bytes]`` (no copy)."""
    return pool.reshape(pool.shape[0], layout.num_layers, layout.segments, layout.block_bytes)


class NumpyPageOps(PageOps):
    """Page ops on host memory with numpy."""

    name = "numpy"
    device = "cpu"
    xp = np
    host_visible = True

    def _is_native(self, array: Any) -> bool:
        """Host arrays are numpy ndarrays."""
        return isinstance(array, np.ndarray)

    def _upload_ids(self, ids: np.ndarray) -> np.ndarray:
        """Ids already live on the host."""
        return ids

    def _data_ptr(self, array: Any) -> int:
        """Address of the first byte of a numpy array."""
        return int(array.__array_interface__["data"][0])

    def empty_pool(self, num_slots: int, page_bytes: int) -> np.ndarray:
        """Uninitialised pool (``np.empty``: pages are written before read)."""
        num_slots, page_bytes = self._check_empty_pool_args(num_slots, page_bytes)
        return np.empty((num_slots, page_bytes), dtype=np.uint8)

    def _pack(self, pool: np.ndarray, slots: np.ndarray, out: np.ndarray) -> None:
        """Row gather straight into ``out``. Rows of 16 KiB and more are
        copied one by one: ``np.take`` moves them at 2.4-3.3 GB/s on the CI
        kind of machine, a row loop at 6-11 GB/s (64 MiB of 16 KiB-1 MiB
        rows). Smaller rows go through ``np.take`` (ids are validated, so
        ``clip`` never clips, and it avoids the buffered ``raise`` mode)."""
        if pool.shape[1] >= _ROW_LOOP_BYTES:
            for i, slot in enumerate(slots.tolist()):
                out[i] = pool[slot]
            return
        np.take(pool, slots, axis=0, out=out, mode="clip")

    def _unpack(self, staging: np.ndarray, slots: np.ndarray, pool: np.ndarray) -> None:
        """Row scatter; slots are unique so the order of writes is moot."""
        pool[slots] = staging

    def _gather(self, layout: EngineLayout, kv_caches: list[tuple[Any, Any]],
                block_ids: np.ndarray, pool: np.ndarray, slots: np.ndarray) -> None:
        """Per layer and K/V: gather engine blocks into a scratch buffer, then
        scatter it into that segment of the target pages."""
        pages = _page_segments(pool, layout)
        scratch = np.empty((block_ids.shape[0], layout.block_bytes), dtype=np.uint8)
        for l, pair in enumerate(kv_caches):
            for t, tensor in enumerate(pair):
                np.take(_block_rows(tensor, layout), block_ids, axis=0, out=scratch,
                        mode="clip")
                pages[slots, l, t] = scratch

    def _scatter(self, layout: EngineLayout, pool: np.ndarray, slots: np.ndarray,
                 kv_caches: list[tuple[Any, Any]], block_ids: np.ndarray) -> None:
        """Per layer and K/V: gather that segment of the source pages, then
        scatter it into the engine blocks."""
        pages = _page_segments(pool, layout)
        for l, pair in enumerate(kv_caches):
            for t, tensor in enumerate(pair):
                _block_rows(tensor, layout)[block_ids] = pages[slots, l, t]

    def to_host(self, array: Any, out: np.ndarray | None = None) -> np.ndarray:
        """Identity (no copy) unless ``out`` is given, then copy into it."""
        self._check_array(array, "array")
        if out is None:
            return array
        self._check_array(out, "out")
        if tuple(out.shape) != tuple(array.shape) or out.dtype != array.dtype:
            raise KernelArgumentError(
                f"out is {out.dtype} {tuple(out.shape)}, expected "
                f"{array.dtype} {tuple(array.shape)}")
        self._check_writable(out, "out")
        np.copyto(out, array)
        return out

    def from_host(self, host: np.ndarray) -> np.ndarray:
        """Identity: host memory is this backend's memory."""
        self._check_array(host, "host")
        return host

    def synchronize(self) -> None:
        """Numpy ops are synchronous; nothing to wait for."""
