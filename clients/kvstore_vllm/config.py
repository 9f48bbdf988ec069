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
    """Lookup with ``record=True``: the coordinator learns the access stream,
    and (with ``claims``) which nodes a claim was shown to: its copy tree goes
    only to those (the ones that look again first)."""
    load: bool = True
    save: bool = True
    data_path: str = "auto"
    capacity: int = 0
    """Bytes for the namespace when this connector creates it (0 = node default)."""
    client_options: dict[str, Any] = field(default_factory=dict)
    """Passed to ``KvClient`` as keyword arguments (credentials go here once
    the node authenticates clients)."""

    # ---- in-flight prefill claims (docs/vllm.md "Prefill claims") -------------
    claims: bool = False
    """Claim prefills and wait for other engines' claims. Off by default: the
    wait rule compares a claimant's ready time with this engine's own prefill,
    so it needs ``prefill_tokens_per_s`` measured for this model and GPU
    (there is no throughput that is safe for every fleet: too high and the
    engine never waits, too low and it waits when computing was faster), and
    it pays only when every engine sharing the namespace claims (a follower can
    wait only for a claimant) and the traffic has bursts of new shared
    contexts (agent fan-out, a shared document); on conversation traffic
    claims change nothing but a few bytes per Lookup. Turn it on fleet-wide,
    with the throughput set, where such bursts are the workload."""
    prefill_tokens_per_s: float = 0.0
    """This engine's prefill throughput (tokens/s, at its usual batch): the
    claimant's ``claim_seconds`` (its queued prefill plus its own) and a
    follower's alternative to waiting. Required (> 0) with ``claims``. Set
    (with or without claims), it also decides what to load: a prefix only
    another node holds is pulled only where the pull (``link_bytes_per_s``,
    shared with the other pulls of it the coordinator counts in flight)
    beats computing it; unset, every held block is loaded."""
    link_bytes_per_s: float = 12.5e9
    """The node-to-node link the copy of a waited-for or pulled prefix takes
    (bytes/s; 12.5e9 = 100 Gb/s). The copy of ``n`` pages costs ``n *
    page_bytes / link_bytes_per_s`` per copy ahead of this one."""
    claim_margin: float = 1.0
    """Wait when ``ready_in + copy < m * own prefill`` (queued prefill
    included), at most ``m * own prefill``. 1.0: only when waiting is expected
    to be faster. Above 1 it accepts a longer wait to spare the GPU for the
    requests queued behind this one: ``m`` grows from 1 with nothing queued to
    ``claim_margin`` once a prefill's worth is queued (the replay's rule; its
    regime map measured 2.0 worse than 1.0 wherever they differed, with the
    engine serving a burst's followers from its own prefix cache). The same margin
    applies to a wait for a copy tree's copy on its way here; a pull of a
    prefix another node holds takes none (it is read only where it beats
    computing it)."""
    claim_max_wait_s: float = 10.0
    """The longest a request defers for a claim, whatever its own prefill
    estimate says; then it computes (a lost claim costs at most this)."""
    claim_poll_ms: float = 20.0
    """Shortest re-lookup interval of a deferred request (a non-recording
    Lookup, one in flight at a time); it looks again about 8 times over what
    it still expects to wait, and once when a copy on its way here is due,
    if that is sooner (``kvstore_client.claims.look_again_s``)."""
    max_claim_seconds: float = 600.0
    """Cap on ``claim_seconds``: at most the daemon's ``--max-claim-seconds``
    (a larger claim is refused, which the connector counts as a failed
    Lookup: a miss)."""

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
        for name in ("prefill_tokens_per_s", "link_bytes_per_s", "claim_max_wait_s", "claim_poll_ms"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if not self.claim_margin > 0 or not 0 < self.max_claim_seconds <= 86400:
            raise ValueError("claim_margin must be > 0 and max_claim_seconds in (0, 86400]")
        if self.claims and not self.prefill_tokens_per_s > 0:
            raise ValueError("claims needs prefill_tokens_per_s > 0 (this engine's prefill throughput)")

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
