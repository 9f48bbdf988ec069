"""The connector's settings: one typed object, built once from vLLM's
``kv_connector_extra_config`` (or a plain dict) and validated there."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ConnectorConfig:
    """Settings of the kvstore connector (keys of ``kv_connector_extra_config``)."""

    address: str
    """gRPC address of the kvstore node on this host, ``HOST:PORT``."""
    namespace: str = ""
    """Namespace override; by default it is derived from model, KV layout and TP rank."""
    namespace_prefix: str = "vllm"
    layout_tag: str = ""
    """Extra tag in the derived namespace (e.g. the attention backend), so
    engines whose paged layouts differ never share pages."""
    lookup_wait_ms: float = 50.0
    """How long the scheduler's first call waits for the leasing Lookup before
    answering "not yet" (vLLM then asks again later). Measured with
    bench/engine_e2e.py: at 5 ms a peer-node lookup (it goes through the
    coordinator) often missed the wait, and vLLM's retry added 0.1-0.8 s of
    TTFT; at 100 ms peer TTFT was steady. A local lookup answers in ~1 ms."""
    lookup_timeout_s: float = 2.0
    """Deadline of the Lookup RPC; past it the request counts as a miss."""
    lease_ttl_s: float = 30.0
    """How long a Lookup pins the pages it reports on the local node."""
    load_timeout_s: float = 2.0
    """Deadline of a load (the deadline-aware Get): what has not arrived by
    then is reported as failed blocks, which vLLM recomputes."""
    record: bool = True
    """Lookup with ``record=True``: the coordinator learns the access stream."""
    load: bool = True
    save: bool = True
    data_path: str = "auto"
    capacity: int = 0
    """Bytes for the namespace when this connector creates it (0 = node default)."""
    client_options: dict[str, Any] = field(default_factory=dict)
    """Passed to ``KvClient`` as keyword arguments (credentials go here once
    the node authenticates clients)."""

    def __post_init__(self) -> None:
        if not self.address or ":" not in self.address:
            raise ValueError(f"kvstore address must be HOST:PORT, got {self.address!r}")
        for name in ("lookup_wait_ms", "lookup_timeout_s", "lease_ttl_s", "load_timeout_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if self.lease_ttl_s <= 0 or self.lookup_timeout_s <= 0 or self.load_timeout_s <= 0:
            raise ValueError("lease_ttl_s, lookup_timeout_s and load_timeout_s must be > 0")
        if self.data_path not in ("auto", "grpc", "tcp"):
            raise ValueError("data_path must be auto, grpc or tcp")

    @classmethod
    def from_dict(cls, extra: dict[str, Any]) -> "ConnectorConfig":
        """Build from a dict whose keys are named like the fields (with an
        optional ``kvstore_`` prefix); unknown keys are an error."""
        names = {f.name: f for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        for key, value in extra.items():
            name = key[len("kvstore_"):] if key.startswith("kvstore_") else key
            if name not in names:
                raise ValueError(f"unknown kvstore connector setting {key!r}; known: {sorted(names)}")
            kind = names[name].type
            if kind in ("float", float):
                value = float(value)
            elif kind in ("bool", bool) and isinstance(value, str):
                value = value.strip().lower() in ("1", "true", "yes", "on")
            elif kind in ("int", int):
                value = int(value)
            values[name] = value
        if "address" not in values:
            raise ValueError("kv_connector_extra_config needs 'address' (the kvstore node, HOST:PORT)")
        return cls(**values)
