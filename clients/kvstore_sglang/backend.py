"""``KvstoreHiCacheStorage``: SGLang's HiCache storage interface on a kvstore node.

SGLang names each page by a string hash and moves pages between its host KV
pool and the store. Each batch call here is one kvstore call: ``batch_get``
one Get, ``batch_set`` one Put, ``batch_exists`` one Lookup (the longest
stored prefix, which is what SGLang asks). Pages are sent straight from the
caller's CPU tensors; a Get lands in a reused staging buffer and is copied
once into the targets. A missing or late page (deadline-aware Get) is a
miss, never an error: SGLang recomputes it.

In-flight prefill claims (``"claims": true`` with ``"prefill_tokens_per_s"``
in the extra config; off by default, as in the vLLM connector): the Lookup
of ``batch_exists`` -- SGLang's prefetch asks it for the pages past its own
device and host cache, and computes and writes back what it does not find --
claims those pages (``claim_seconds``: the batch's pages at the configured
throughput), so other engines' lookups see this node computing them and,
under ``--replication predictive``, the coordinator copies them to the
nodes that asked once they land. The backend never waits for another
engine's claim: SGLang's storage interface has no point to wait at (one
prefetch thread serves every request's ``batch_exists`` in turn, and the
default ``best_effort`` prefetch policy schedules the request without it).
"""

from __future__ import annotations

import hashlib
import logging
import threading
from typing import Any

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig

from kvstore.errors import KvError
from kvstore_client import KvClient
from kvstore_client import claims as claiming

log = logging.getLogger("kvstore_sglang")

MAX_KEY = 64


def page_key(key: str) -> bytes:
    """SGLang's string hash as a kvstore key (1-64 bytes)."""
    raw = key.encode()
    return raw if 0 < len(raw) <= MAX_KEY else hashlib.blake2b(raw, digest_size=32).digest()


def _bytes_of(tensor: torch.Tensor) -> np.ndarray:
    """A CPU tensor's memory as flat uint8 numpy, without a copy."""
    if tensor.is_cuda or not tensor.is_contiguous():
        tensor = tensor.detach().contiguous().cpu()
    raw = tensor.view(torch.uint8) if tensor.dtype != torch.uint8 else tensor
    return raw.reshape(-1).numpy()


class KvstoreHiCacheStorage(HiCacheStorage):
    """HiCache storage backed by one kvstore node (see the module docstring)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None) -> None:
        extra = dict(storage_config.extra_config or {})
        self.address = extra.get("address")
        if not self.address:
            raise ValueError("kvstore backend needs 'address' (HOST:PORT) in the storage backend extra config")
        model = (storage_config.model_name or "model").replace("/", "-").strip("-.")[-48:] or "model"
        self.namespace = extra.get("namespace") or (
            f"sglang.{model}.tp{storage_config.tp_rank}of{storage_config.tp_size}"
            f".pp{storage_config.pp_rank}{'.mla' if storage_config.is_mla_model else ''}")
        self.timeout = float(extra.get("get_timeout_s", 2.0))
        self.page_bytes = int(extra.get("page_bytes", 0))
        self.capacity = int(extra.get("capacity", 0))
        claims = extra.get("claims", False)
        self.claims = claims.strip().lower() in ("1", "true", "yes", "on") if isinstance(claims, str) else bool(claims)
        self.prefill_tokens_per_s = float(extra.get("prefill_tokens_per_s", 0.0))
        self.max_claim_seconds = float(extra.get("max_claim_seconds", claiming.DEFAULT_MAX_CLAIM_S))
        self.page_tokens = int(extra.get("page_tokens", 0))  # else the host pool's page size
        if self.claims and not self.prefill_tokens_per_s > 0:
            raise ValueError("kvstore backend: claims needs prefill_tokens_per_s > 0 (the engine's prefill throughput)")
        self.client = KvClient(self.address, data_path=extra.get("data_path", "auto"),
                               **extra.get("client_options", {}))
        self._ready = False
        self._lock = threading.Lock()
        self._staging: np.ndarray | None = None
        if self.page_bytes:
            self._create(self.page_bytes)

    # ---- namespace -------------------------------------------------------------
    def _create(self, page_bytes: int) -> None:
        info = self.client.create_namespace(self.namespace, page_bytes, exist_ok=True, capacity=self.capacity)
        if info.layout.page_bytes != page_bytes:
            raise ValueError(f"namespace {self.namespace!r} holds {info.layout.page_bytes}-byte pages, not "
                             f"{page_bytes}; set a distinct 'namespace'")
        self.page_bytes, self._ready = page_bytes, True

    def _ensure(self, page_bytes: int) -> bool:
        if not self._ready:
            with self._lock:
                if not self._ready:
                    self._create(page_bytes)
        return page_bytes == self.page_bytes

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self.page_tokens = self.page_tokens or int(getattr(mem_pool_host, "page_size", 0) or 0)
        page = mem_pool_host.get_data_page(0, flat=True)
        if page.numel():
            self._ensure(page.numel() * page.element_size())

    def _rows(self, n: int) -> np.ndarray:
        if self._staging is None or self._staging.shape[0] < n:
            self._staging = np.empty((max(n, 8), self.page_bytes), dtype=np.uint8)
        return self._staging[:n]

    # ---- reads -------------------------------------------------------------------
    def _fetch(self, keys: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """(found mask, pages) with one deadline-aware Get; a failure is all-miss."""
        out = self._rows(len(keys))
        try:
            found = self.client.get(self.namespace, [page_key(k) for k in keys], out=out, timeout=self.timeout).found
        except KvError as exc:
            log.warning("kvstore get of %d pages failed: %s", len(keys), exc)
            found = np.zeros(len(keys), dtype=bool)
        return found, out

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        result = self.batch_get([key], None if target_location is None else [target_location])
        return result[0]

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        if not keys or not self._ready:
            return [None] * len(keys)
        with self._lock:
            found, pages = self._fetch(keys)
            results: list[torch.Tensor | None] = []
            for i, hit in enumerate(found):
                if not hit:
                    results.append(None)
                    continue
                if target_locations is not None:
                    target = target_locations[i]
                    dst = _bytes_of(target)
                    if dst.nbytes != self.page_bytes:
                        results.append(None)
                        continue
                    np.copyto(dst, pages[i])
                    results.append(target)
                else:
                    results.append(torch.from_numpy(pages[i].copy()))
        return results

    def exists(self, key: str) -> bool:
        return self._lookup([key], claim=False) == 1

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many leading keys are stored: one Lookup, which claims the rest with ``claims``."""
        return self._lookup(keys, claim=True)

    def claim_seconds(self, pages: int) -> float:
        """``claim_seconds`` for computing ``pages`` pages (0: no claim)."""
        if not (self.claims and self.page_tokens):
            return 0.0
        return claiming.claim_seconds(pages * self.page_tokens, self.prefill_tokens_per_s,
                                      max_s=self.max_claim_seconds)

    def _lookup(self, keys: list[str], claim: bool) -> int:
        if not keys or not self._ready:
            return 0
        try:
            # the hit is not known before the answer: claim the batch (the daemon claims only what the
            # cluster lacks and nobody else claims, so a hit claims nothing)
            return self.client.lookup_nodes(self.namespace, [page_key(k) for k in keys],
                                            claim_seconds=self.claim_seconds(len(keys)) if claim else 0.0
                                            ).prefix_length
        except KvError as exc:
            log.warning("kvstore lookup failed: %s", exc)
            return 0

    # ---- writes ------------------------------------------------------------------
    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value if value is not None else target_location])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        values = values if values is not None else target_locations
        if not keys:
            return True
        if values is None or len(values) != len(keys):
            return False
        pages = [_bytes_of(v) for v in values]
        if not self._ensure(pages[0].nbytes) or any(p.nbytes != self.page_bytes for p in pages):
            return False
        try:
            self.client.put(self.namespace, [page_key(k) for k in keys], pages)  # sent from the tensors
        except KvError as exc:
            log.warning("kvstore put of %d pages failed: %s", len(keys), exc)
            return False
        return True

    # ---- zero-copy variants on the host pool ---------------------------------------
    def _page_indices(self, keys: list[str], host_indices: torch.Tensor) -> list[int]:
        size = self.mem_pool_host.page_size
        return [int(host_indices[i * size]) for i in range(len(keys))]

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        """Pages into the host pool's slots for ``host_indices``: one Get."""
        if not keys or not self._ready:
            return [False] * len(keys)
        with self._lock:
            found, pages = self._fetch(keys)
            for i, index in enumerate(self._page_indices(keys, host_indices)):
                if found[i]:
                    self.mem_pool_host.set_from_flat_data_page(index, torch.from_numpy(pages[i]))
        return [bool(f) for f in found]

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        """Pages from the host pool's slots, sent without a copy: one Put."""
        values = [self.mem_pool_host.get_data_page(i, flat=True) for i in self._page_indices(keys, host_indices)]
        return [self.batch_set(keys, values)] * len(keys)

    def clear(self) -> None:
        """Drop this backend's namespace (SGLang's "clear storage")."""
        try:
            self.client.delete_namespace(self.namespace)
        except KvError:
            pass
        self._ready = False

    def get_stats(self) -> dict[str, Any]:
        ns = self.client.stats(self.namespace).namespaces[0] if self._ready else None
        return {} if ns is None else {"hits": ns.hits, "misses": ns.misses, "used_bytes": ns.used_bytes}

    def close(self) -> None:
        self.client.close()
