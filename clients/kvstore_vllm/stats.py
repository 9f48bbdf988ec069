"""Counters the connector keeps (thread-safe), read by tests, benchmarks and
``KvstoreConnector.stats()``."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields


@dataclass
class ConnectorStats:
    lookups: int = 0
    lookup_errors: int = 0
    lookup_hit_tokens: int = 0
    loads: int = 0
    loaded_tokens: int = 0
    load_failed_blocks: int = 0
    load_errors: int = 0
    load_bytes: int = 0
    load_seconds: float = 0.0
    saves: int = 0
    saved_blocks: int = 0
    save_bytes: int = 0
    save_errors: int = 0
    save_seconds: float = 0.0
    claims: int = 0               # Lookups that carried claim_seconds (a claim of what the cluster lacks)
    claim_waits: int = 0          # requests deferred for another request's prefill (or a copy on its way)
    claim_waits_landed: int = 0   # ... that ended with the prefix held (else: timed out, or the claim vanished)
    claim_wait_seconds: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **deltas: float) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self, name, getattr(self, name) + delta)

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}
