"""GPU page ops on CuPy, running the raw CUDA kernels in ``kvstore/ops/kernels/``.

CuPy is imported lazily (in functions and the constructor), so this module
imports on machines without it. Kernels are compiled once per device and
cached at module level; the hot calls only validate arguments and launch.
"""

from __future__ import annotations

import math
import os
import threading
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from importlib.resources import as_file, files
from pathlib import Path
from typing import Any

import numpy as np

from .base import BackendUnavailableError, EngineLayout, KernelArgumentError, PageOps

__all__ = ["CupyPageOps", "kernel_dir", "load_kernels"]

THREADS = 256
"""Threads per block: 256 x 16 B = 4 KiB per block per loop iteration."""
BYTES_PER_BLOCK = 64 * 1024
"""Target bytes one thread block copies; sets how many blocks share a unit."""
MAX_BLOCKS = 1 << 16
"""Grid cap; the kernels grid-stride over whatever the grid does not cover."""

_KERNELS = {
    "pages.cu": ("pack_pages", "unpack_pages"),
    "engine.cu": ("gather_blocks", "scatter_blocks"),
}
_cache: dict[tuple[int, str], Any] = {}
_modules: list[Any] = []
_cache_lock = threading.Lock()


@contextmanager
def kernel_dir() -> Iterator[Path]:
    """The directory of the ``.cu``/``.cuh`` sources, as a real directory
    (NVRTC's include path needs one): ``$KVSTORE_KERNEL_DIR``, else the
    package data ``kvstore/ops/kernels`` of this install."""
    env = os.environ.get("KVSTORE_KERNEL_DIR")
    if env:
        yield Path(env)
        return
    with as_file(files("kvstore.ops") / "kernels") as directory:
        yield Path(directory)


def load_kernels(device_id: int) -> dict[str, Any]:
    """Compile every kernel for ``device_id`` once and return them by name.

    Cached per (device, kernel name), so later calls cost a dict lookup.
    """
    import cupy

    with _cache_lock:
        missing = [n for names in _KERNELS.values() for n in names
                   if (device_id, n) not in _cache]
        if missing:
            with kernel_dir() as directory, cupy.cuda.Device(device_id):
                for filename, names in _KERNELS.items():
                    path = directory / filename
                    try:
                        source = path.read_text()
                    except OSError as exc:
                        raise BackendUnavailableError(
                            f"cannot read CUDA kernel source {path}: {exc}") from exc
                    module = cupy.RawModule(code=source, options=(f"-I{directory}",))  # copy.cuh
                    _modules.append(module)  # keep every module alive with its functions
                    for name in names:
                        # get_function compiles (NVRTC) and loads on this device.
                        _cache[(device_id, name)] = module.get_function(name)
        return {n: _cache[(device_id, n)] for names in _KERNELS.values() for n in names}


def _h2d(cupy: Any, host: np.ndarray, dtype: Any = None) -> Any:
    """Host-to-device copy that has finished reading ``host`` on return.

    CuPy >= 14 copies asynchronously unless ``blocking=True``; callers reuse
    their host buffers (and ids are temporaries), so always block. Older
    CuPy has no ``blocking`` and is synchronous already.
    """
    try:
        return cupy.asarray(host, dtype=dtype, blocking=True)
    except TypeError:
        return cupy.asarray(host, dtype=dtype)


def _grid(units: int, unit_bytes: int) -> int:
    """Blocks for ``units`` equal copies of ``unit_bytes``: enough blocks per
    unit for ~BYTES_PER_BLOCK each, capped at MAX_BLOCKS."""
    per_unit = max(1, math.ceil(unit_bytes / BYTES_PER_BLOCK))
    return max(1, min(units * per_unit, MAX_BLOCKS))


class CupyPageOps(PageOps):
    """Page ops on one CUDA device with CuPy and the raw kernels."""

    name = "cupy"
    host_visible = False

    def __init__(self, device_id: int = 0) -> None:
        """Bind to ``cuda:device_id`` and compile (or fetch cached) kernels.

        Raises BackendUnavailableError when CuPy or the device is unusable.
        """
        try:
            import cupy
        except Exception as exc:  # ImportError, or CUDA libraries failing to load
            raise BackendUnavailableError(f"CuPy cannot be imported: {exc}") from exc
        try:
            available = bool(cupy.is_available())
            count = cupy.cuda.runtime.getDeviceCount() if available else 0
        except Exception as exc:
            raise BackendUnavailableError(f"CUDA is not usable: {exc}") from exc
        if not available:
            raise BackendUnavailableError("CuPy is installed but no CUDA device is available")
        if not 0 <= device_id < count:
            raise BackendUnavailableError(
                f"cuda:{device_id} does not exist ({count} device(s) visible)")
        self.xp = cupy
        self.device_id = device_id
        self.device = f"cuda:{device_id}"
        self._device = cupy.cuda.Device(device_id)
        self._kernels = load_kernels(device_id)
        self._ptr_tables: OrderedDict[tuple[int, ...], Any] = OrderedDict()
        self._ptr_lock = threading.Lock()

    # ----------------------------------------------------------------- hooks
    def _is_native(self, array: Any) -> bool:
        """CuPy arrays on this object's device."""
        return isinstance(array, self.xp.ndarray) and array.device.id == self.device_id

    def _upload_ids(self, ids: np.ndarray) -> Any:
        """Copy validated host ids to this device."""
        with self._device:
            return _h2d(self.xp, ids, self.xp.int64)

    def _data_ptr(self, array: Any) -> int:
        """Device address of the array's first byte."""
        return int(array.data.ptr)

    def _layer_table(self, kv_caches: list[tuple[Any, Any]]) -> Any:
        """Device uint64 array of K0, V0, K1, V1, ... base pointers.

        Cached by the pointer values (an engine's caches are long-lived), so
        steady-state calls skip the host-to-device copy. Content depends only
        on the key, so a reused address can never make an entry stale.
        """
        key = tuple(int(t.data.ptr) for pair in kv_caches for t in pair)  # every segment, in page order
        with self._ptr_lock:
            table = self._ptr_tables.get(key)
            if table is None:
                with self._device:
                    table = _h2d(self.xp, np.asarray(key, dtype=np.uint64))
                self._ptr_tables[key] = table
                while len(self._ptr_tables) > 16:
                    self._ptr_tables.popitem(last=False)
            else:
                self._ptr_tables.move_to_end(key)
            return table

    # ------------------------------------------------------------- launches
    def _pack(self, pool: Any, slots: Any, out: Any) -> None:
        """Launch ``pack_pages``."""
        n, page_bytes = int(slots.shape[0]), int(pool.shape[1])
        with self._device:
            self._kernels["pack_pages"](
                (_grid(n, page_bytes),), (THREADS,),
                (pool, slots, np.int64(n), np.int64(page_bytes), out))

    def _unpack(self, staging: Any, slots: Any, pool: Any) -> None:
        """Launch ``unpack_pages``."""
        n, page_bytes = int(slots.shape[0]), int(pool.shape[1])
        with self._device:
            self._kernels["unpack_pages"](
                (_grid(n, page_bytes),), (THREADS,),
                (staging, slots, np.int64(n), np.int64(page_bytes), pool))

    def _engine_launch(self, kernel: str, layout: EngineLayout,
                       kv_caches: list[tuple[Any, Any]], block_ids: Any, pool: Any,
                       slots: Any) -> None:
        """Launch ``gather_blocks``/``scatter_blocks`` (same signature).

        The kernels copy ``2 * num_layers`` equal segments per page from a
        pointer table, so any even segment count runs on them as it is (a
        fused ``"blocks"`` layer is one segment); an odd one takes
        :meth:`_segment_copy`.
        """
        n = int(slots.shape[0])
        total = layout.segments * layout.num_layers
        if total % 2:
            self._segment_copy(kernel == "gather_blocks", layout, kv_caches, block_ids, pool, slots)
            return
        units = n * total
        table = self._layer_table(kv_caches)
        with self._device:
            self._kernels[kernel](
                (_grid(units, layout.block_bytes),), (THREADS,),
                (table, block_ids, slots, np.int64(n), np.int64(total // 2),
                 np.int64(layout.block_bytes), pool, np.int64(pool.shape[1])))

    def _segment_copy(self, gather: bool, layout: EngineLayout, kv_caches: list[tuple[Any, ...]],
                      block_ids: Any, pool: Any, slots: Any) -> None:
        """Odd segment counts: one CuPy fancy-index copy per segment."""
        pages = pool.reshape(pool.shape[0], layout.num_layers, layout.segments, layout.block_bytes)
        with self._device:
            for l, pair in enumerate(kv_caches):
                for t, tensor in enumerate(pair):
                    rows = tensor.view(self.xp.uint8).reshape(layout.num_blocks, layout.block_bytes)
                    if gather:
                        pages[slots, l, t] = rows[block_ids]
                    else:
                        rows[block_ids] = pages[slots, l, t]

    def _gather(self, layout: EngineLayout, kv_caches: list[tuple[Any, Any]],
                block_ids: Any, pool: Any, slots: Any) -> None:
        """Engine blocks to pages with ``gather_blocks``."""
        self._engine_launch("gather_blocks", layout, kv_caches, block_ids, pool, slots)

    def _scatter(self, layout: EngineLayout, pool: Any, slots: Any,
                 kv_caches: list[tuple[Any, Any]], block_ids: Any) -> None:
        """Pages to engine blocks with ``scatter_blocks``."""
        self._engine_launch("scatter_blocks", layout, kv_caches, block_ids, pool, slots)

    # ---------------------------------------------------------- allocation
    def empty_pool(self, num_slots: int, page_bytes: int) -> Any:
        """Uninitialised device pool (``cupy.empty``: no memset)."""
        num_slots, page_bytes = self._check_empty_pool_args(num_slots, page_bytes)
        with self._device:
            return self.xp.empty((num_slots, page_bytes), dtype=self.xp.uint8)

    def host_empty(self, shape: int | tuple[int, ...]) -> np.ndarray:
        """Pinned host memory (CuPy's pinned memory pool reuses freed blocks, so this is cheap once warm)."""
        import cupyx

        with self._device:
            return cupyx.empty_pinned(shape, dtype=np.uint8)

    def to_host(self, array: Any, out: np.ndarray | None = None) -> np.ndarray:
        """Device-to-host copy, into ``out`` (C-contiguous, same shape and
        dtype) when given."""
        self._check_array(array, "array")
        with self._device:
            if out is None:
                return self.xp.asnumpy(array)
            if not isinstance(out, np.ndarray):
                raise KernelArgumentError("out must be a numpy array")
            if (tuple(out.shape) != tuple(array.shape) or out.dtype != array.dtype
                    or not out.flags.c_contiguous):
                raise KernelArgumentError(
                    f"out must be C-contiguous {array.dtype} {tuple(array.shape)}, "
                    f"got {out.dtype} {tuple(out.shape)}")
            self._check_writable(out, "out")
            return array.get(out=out)

    def from_host(self, host: np.ndarray) -> Any:
        """Host-to-device copy onto this object's device."""
        if not isinstance(host, np.ndarray):
            raise KernelArgumentError(
                f"host must be a numpy array, got {type(host).__qualname__}")
        with self._device:
            return _h2d(self.xp, host)

    def synchronize(self) -> None:
        """Wait for all work queued on this device."""
        self._device.synchronize()
