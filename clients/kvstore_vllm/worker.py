"""Worker side of the connector, free of vLLM and torch imports.

It holds the engine's paged KV as arrays of a :class:`PageOps` backend (numpy
views of CPU tensors, CuPy views of CUDA tensors; no copies) and carries out
each step's :class:`StepPlan`:

- **load**: one deadline-aware Get for every page of the step into a reused
  staging buffer, started by :meth:`start_load` in a thread, then one
  ``scatter`` into the engine blocks at the first :meth:`wait_layer`. A page
  that is missing or did not arrive by the deadline is not written; its
  block is reported by :meth:`take_load_errors` and vLLM recomputes it.
- **save**: ``gather`` of the new full blocks and a Put, in a thread, so the
  forward pass never waits for the store. :meth:`finished_sending` reports a
  finished request once its saves are done, so vLLM frees its blocks only
  then.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvstore.errors import KvError, NotFound
from kvstore.ops import PageOps
from kvstore_client import KvClient

from .config import ConnectorConfig
from .scheduler import LoadSpec, SaveSpec
from .stats import ConnectorStats

log = logging.getLogger("kvstore_vllm")


class _Load:
    """One step's load in flight."""

    def __init__(self, specs: list[LoadSpec]) -> None:
        self.specs = specs
        self.keys = [k for s in specs for k in s.keys]
        self.block_ids = [b for s in specs for b in s.block_ids]
        self.future: cf.Future[np.ndarray] | None = None
        self.started = time.perf_counter()


class WorkerCore:
    """The worker's connector: engine KV <-> kvstore pages (module docstring)."""

    def __init__(self, config: ConnectorConfig, namespace: str, block_size: int, ops: PageOps,
                 client_factory: Callable[[], KvClient] | None = None,
                 stats: ConnectorStats | None = None) -> None:
        self.config = config
        self.namespace = namespace
        self.block_size = block_size
        self.ops = ops
        self.stats = stats or ConnectorStats()
        factory = client_factory or (lambda: KvClient(config.address, data_path=config.data_path,
                                                      **config.client_options))
        # loads and saves on separate connections: a load never queues behind a save
        self._load_client = factory()
        self._save_client = factory()
        self._load_pool = cf.ThreadPoolExecutor(1, thread_name_prefix="kvstore-load")
        self._save_pool = cf.ThreadPoolExecutor(1, thread_name_prefix="kvstore-save")
        self.layers: list[Any] = []
        self.layer_names: list[str] = []
        self.layout = "blocks"
        self.page_bytes = 0
        self._staging: np.ndarray | None = None
        self._load: _Load | None = None
        self._load_errors: set[int] = set()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._pending_saves: dict[str, int] = {}
        self._saved_reqs: set[str] = set()
        self._finishing: set[str] = set()
        self.on_load_start: list[Callable[[list[LoadSpec]], None]] = []
        """Called with a step's loads before its Get is sent (tracing, tests)."""
        self.loaded: OrderedDict[str, LoadSpec] = OrderedDict()
        """The last load per request (what was asked; the latest 1024), for inspection."""
        self.saved: OrderedDict[str, list[SaveSpec]] = OrderedDict()
        """Saves per request (the latest 1024 requests), for inspection."""

    # ---- registration -------------------------------------------------------
    def register(self, names: Sequence[str], layers: Sequence[Any], layout: str, *,
                 describe: dict[str, int] | None = None) -> None:
        """Adopt the engine's per-layer KV arrays (``layout`` as in
        :mod:`kvstore.ops`) and create the namespace with the page size they
        imply (``exist_ok``: every engine of one model shares it)."""
        if layout not in ("blocks", "kv_first", "pairs"):
            raise ValueError(f"unknown engine layout {layout!r}")
        self.layer_names, self.layers, self.layout = list(names), list(layers), layout
        first = self.layers[0]
        per_layer = int(first[0].nbytes) if layout == "blocks" else int(first[0][0].nbytes) * 2
        self.page_bytes = per_layer * len(self.layers)
        info = self._save_client.create_namespace(self.namespace, self.page_bytes, exist_ok=True,
                                                  capacity=self.config.capacity, **(describe or {}))
        if info.layout.page_bytes != self.page_bytes:
            raise ValueError(f"namespace {self.namespace!r} holds {info.layout.page_bytes}-byte pages, but this "
                             f"engine's blocks are {self.page_bytes} bytes; set a distinct 'namespace'")

    def _staging_rows(self, n: int) -> np.ndarray:
        """A reused host buffer of at least ``n`` pages (grown by doubling)."""
        if self._staging is None or self._staging.shape[0] < n:
            rows = max(n, 2 * (0 if self._staging is None else self._staging.shape[0]), 8)
            self._staging = np.empty((rows, self.page_bytes), dtype=np.uint8)
        return self._staging[:n]

    # ---- load -----------------------------------------------------------------
    def start_load(self, specs: Sequence[LoadSpec]) -> None:
        """Send one Get for every page of this step's loads (in a thread)."""
        self._finish_load()  # a previous step's load that no layer waited for
        specs = [s for s in specs if s.keys]
        if not specs or not self.layers:
            return
        load = _Load(specs)
        for hook in self.on_load_start:
            hook(specs)
        out = self._staging_rows(len(load.keys))
        load.future = self._load_pool.submit(self._get, specs, out)
        self._load = load

    def _get(self, specs: list[LoadSpec], out: np.ndarray) -> np.ndarray:
        """The step's loads into ``out``: one Get for each run of loads without a deadline, one of its own
        for each load with one (pages only the node's tiers held, worth no more than computing them: the
        node reads what lands in time, vLLM recomputes the rest)."""
        found = np.zeros(len(out), dtype=bool)
        groups: list[tuple[list[bytes], float]] = []
        for spec in specs:
            if spec.deadline_s > 0 or not groups or groups[-1][1] > 0:
                groups.append(([], min(spec.deadline_s, self.config.load_timeout_s) if spec.deadline_s > 0
                               else 0.0))
            groups[-1][0].extend(spec.keys)
        at = 0
        for keys, deadline in groups:
            rows = slice(at, at + len(keys))
            at += len(keys)
            found[rows] = self._load_client.get(self.namespace, keys, out=out[rows],
                                                timeout=deadline or self.config.load_timeout_s).found
        return found

    def wait_layer(self, layer_name: str = "") -> None:
        """Block until this step's pages are in the engine's KV (all layers
        land at the first call: a page carries every layer)."""
        self._finish_load()

    def _finish_load(self) -> None:
        load, self._load = self._load, None
        if load is None or load.future is None:
            return
        try:
            found = load.future.result()
        except (KvError, OSError) as exc:
            log.warning("kvstore load of %d pages failed; vLLM recomputes them: %s", len(load.keys), exc)
            found = np.zeros(len(load.keys), dtype=bool)
            self.stats.add(load_errors=1)
        hit = np.flatnonzero(found)
        if hit.size:
            staging = self._staging
            assert staging is not None
            pages = self.ops.from_host(staging[:len(load.keys)]) if not self.ops.host_visible else staging
            blocks = np.asarray(load.block_ids, dtype=np.int64)[hit]
            self.ops.scatter(pages, hit, self.layers, blocks, layout=self.layout)
            self.ops.synchronize()
        failed = [b for b, ok in zip(load.block_ids, found) if not ok]
        self._load_errors.update(failed)
        for spec in load.specs:
            self.loaded[spec.req_id] = spec
            while len(self.loaded) > 1024:
                self.loaded.popitem(last=False)
            if spec.lease_id:
                self._save_pool.submit(self._unpin, spec.lease_id)
        self.stats.add(loads=1, loaded_tokens=int(hit.size) * self.block_size, load_failed_blocks=len(failed),
                       load_bytes=int(hit.size) * self.page_bytes,
                       load_seconds=time.perf_counter() - load.started)

    def _unpin(self, lease_id: str) -> None:
        try:
            self._save_client.unpin(self.namespace, lease_id)
        except NotFound:
            pass  # expired already
        except KvError as exc:
            log.debug("unpin %s: %s", lease_id, exc)

    def take_load_errors(self) -> set[int]:
        """Blocks whose pages failed to load since the last call."""
        self._finish_load()
        errors, self._load_errors = self._load_errors, set()
        return errors

    # ---- save -----------------------------------------------------------------
    def save(self, specs: Sequence[SaveSpec], ready: Callable[[], None] | None = None) -> None:
        """Queue this step's saves; ``ready`` (e.g. a CUDA event's wait) runs
        in the save thread before the blocks are read."""
        for spec in specs:
            if not spec.keys:
                continue
            with self._lock:
                self._pending_saves[spec.req_id] = self._pending_saves.get(spec.req_id, 0) + 1
                self._saved_reqs.add(spec.req_id)
            self.saved.setdefault(spec.req_id, []).append(spec)
            while len(self.saved) > 1024:
                self.saved.popitem(last=False)
            self._save_pool.submit(self._save_one, spec, ready)

    def _save_one(self, spec: SaveSpec, ready: Callable[[], None] | None) -> None:
        start = time.perf_counter()
        try:
            if ready is not None:
                ready()
            n = len(spec.keys)
            pages = self.ops.xp.empty((n, self.page_bytes), dtype=np.uint8)
            self.ops.gather(self.layers, spec.block_ids, pages, np.arange(n), layout=self.layout)
            host = self.ops.to_host(pages)
            self._save_client.put(self.namespace, spec.keys, host)
            self.stats.add(saves=1, saved_blocks=n, save_bytes=n * self.page_bytes,
                           save_seconds=time.perf_counter() - start)
        except Exception as exc:  # a failed save is a future miss, never an engine error
            log.warning("kvstore save of %d blocks failed: %s", len(spec.keys), exc)
            self.stats.add(save_errors=1)
        finally:
            with self._lock:
                self._pending_saves[spec.req_id] -= 1
                self._idle.notify_all()

    def finished_sending(self, finished_req_ids: set[str]) -> set[str]:
        """Requests vLLM finished whose saves are all done (only requests
        that had saves: those are the ones whose blocks vLLM kept)."""
        with self._lock:
            self._finishing.update(r for r in finished_req_ids if r in self._saved_reqs)
            done = {r for r in self._finishing if self._pending_saves.get(r, 0) == 0}
            for r in done:
                self._finishing.discard(r)
                self._saved_reqs.discard(r)
                self._pending_saves.pop(r, None)
        return done

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every queued save finished (True) or ``timeout`` passed."""
        with self._lock:
            return self._idle.wait_for(lambda: not any(self._pending_saves.values()), timeout)

    def close(self) -> None:
        """Finish queued saves, then close the connections."""
        self._finish_load()
        self._save_pool.shutdown(wait=True)
        self._load_pool.shutdown(wait=True)
        self._load_client.close()
        self._save_client.close()
