"""Per-request records and the per-policy aggregates written to results.json.

Time base: every reported time is in the **trace's** seconds.

* measured here: ``fetch_s`` (the engine's Lookup + Get round trips on this
  machine, real seconds, not rescaled: they are short and were not slowed
  down), ``route_s`` (the router's Lookup), and ``queue_s`` (waiting for an
  engine slot and for the engine's prefill unit; measured in real seconds,
  then multiplied by the speedup, because what it waits for -- other
  requests' modelled prefill -- was slept divided by the speedup).
* modelled: ``prefill_s``, ``decode_s`` (cost model, unscaled), ``link_s``
  (the remote blocks' unscaled bytes over the stated link) and
  ``local_load_s``.

``ttft_s = route_s + queue_s + fetch_s + local_load_s + prefill_s`` (the
headline: the measured fetch, whose peer transfers ran over the shaped
links, x speedup; the modelled load of local pages from the pool's medium). ``ttft_link_s = route_s + queue_s + link_s + local_load_s + prefill_s``
(the fetch modelled for the stated link and unscaled page sizes).

Hit accounting per request, over the request's blocks: ``local`` = leading
blocks the serving node held at its Lookup; ``remote`` = further leading
blocks its Get returned (pulled from peers by the node); ``miss`` = the rest
(recomputed). Ratios are over all blocks of all completed requests.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np


@dataclass(slots=True)
class RequestRecord:
    idx: int
    t: float                  # arrival, trace seconds from the window start
    node: str = ""
    route_reason: str = ""
    blocks: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    reusable: int = 0         # leading blocks an earlier request had (the ceiling)
    head: int = 0             # the trace id of its first block: requests sharing a prefix share it
    local: int = 0
    disk: int = 0             # of the local blocks, those only its node's disk tier held (read up first)
    remote: int = 0
    miss: int = 0
    engine_cached: int = 0    # of the missed blocks: in the engine's own prefix cache when its prefill began
    lag_s: float = 0.0        # measured, real: dispatch later than scheduled (harness overhead)
    route_s: float = 0.0      # measured, real
    queue_s: float = 0.0      # measured, rescaled to trace time
    fetch_s: float = 0.0      # measured: Lookup(record) + Get on the serving node, link waits included, x speedup
    fetch_real_s: float = 0.0  # the same, real seconds
    cluster_cached: int = 0   # leading blocks some node held at the serving node's Lookup
    recomputed_cached: int = 0  # blocks recomputed although a node held them (the waste a policy controls)
    cold_prefill_s: float = 0.0  # modelled prefill of the whole prompt (the SLO's yardstick)
    first_token_at: float = 0.0  # trace seconds from the start
    prefill_s: float = 0.0    # modelled
    decode_s: float = 0.0     # modelled
    link_s: float = 0.0       # modelled: remote blocks over the stated link
    local_load_s: float = 0.0  # modelled: local blocks from the pool on the GPU
    put_s: float = 0.0        # measured, real (after the first token: not in TTFT)
    corrupt: int = 0          # fetched pages whose bytes were not the key's
    kv_error: str = ""        # the node's Lookup/Get failed (e.g. killed): the engine recomputed the prompt
    claim_wait: bool = False  # +claims: it waited for another request's in-flight prefill of its prefix
    wait_real_s: float = 0.0  # measured, real: of fetch_real_s, the claim wait (its re-lookups included)
    get_real_s: float = 0.0   # measured, real: of fetch_real_s, the Get (pulls included)
    get_s: float = 0.0        # the same in trace seconds (its reads from the node's tiers included)
    wait_end: str = ""        # +claims: why the wait ended: came (landed), budget (spent), gone (claim vanished)
    wait_ready_s: float = 0.0  # +claims: the ready_in (trace s) the wait was decided on
    done: bool = False
    error: str = ""
    ready: tuple[float, ...] = ()  # the bound: when its first n reusable blocks can exist (not in rows)

    @classmethod
    def of(cls, idx: int, r: Any, reusable: int) -> RequestRecord:
        """The record of trace request ``r`` (a ``kvstore.workloads.traces.Request``) before it is served."""
        return cls(idx=idx, t=r.t, blocks=len(r.hash_ids), input_tokens=r.input_length,
                   output_tokens=r.output_length, reusable=reusable, head=r.hash_ids[0] if r.hash_ids else 0)

    @property
    def ttft_s(self) -> float:
        return self.route_s + self.queue_s + self.fetch_s + self.local_load_s + self.prefill_s

    @property
    def ttft_link_s(self) -> float:
        return self.route_s + self.queue_s + self.link_s + self.local_load_s + self.prefill_s

    def row(self) -> dict[str, object]:
        d = asdict(self)
        del d["ready"]
        d["ttft_s"] = self.ttft_s
        d["ttft_link_s"] = self.ttft_link_s
        return d


def floor_s(r: RequestRecord, block_tokens: int) -> float:
    """The least TTFT any placement gives ``r``: its cold prefill's share for the tokens past its reusable
    prefix (the last token is always computed)."""
    left = max(1, r.input_tokens - r.reusable * block_tokens)
    return r.cold_prefill_s * min(1.0, left / r.input_tokens) if r.input_tokens > 0 else 0.0


def meets_slo(r: RequestRecord, slo_factor: float, slo_ttft: float) -> bool:
    """The SLO: a TTFT of at most ``slo_ttft`` or ``slo_factor`` x the request's own cold prefill, whichever
    is larger (a short prompt's TTFT is mostly round trips, which no factor of its prefill covers)."""
    return r.ttft_s <= max(slo_ttft, slo_factor * max(r.cold_prefill_s, 1e-9))


def pct(values: Sequence[float] | np.ndarray, q: float) -> float:
    """The ``q``-th percentile (linear), 0.0 for no values."""
    a = np.asarray(values, dtype=float)
    return float(np.percentile(a, q)) if a.size else 0.0


def _dist(prefix: str, values: Sequence[float]) -> dict[str, float]:
    a = np.asarray(values, dtype=float)
    return {f"{prefix}_p50_s": pct(a, 50), f"{prefix}_p95_s": pct(a, 95), f"{prefix}_p99_s": pct(a, 99),
            f"{prefix}_mean_s": float(a.mean()) if a.size else 0.0}


def aggregate(records: Iterable[RequestRecord], cluster: dict[str, float] | None = None,
              slo_factor: float = 2.0, gpus: int = 1, block_tokens: int = 512,
              slo_ttft: float = 0.0) -> dict[str, object]:
    """One policy's summary: latency distributions, hit ratios, errors, and the cluster's byte counters.

    ``cluster`` carries what the nodes reported (``spec_bytes``,
    ``spec_wasted_bytes``, ...); it is merged in as it is.
    """
    recs = list(records)
    done = [r for r in recs if r.done and not r.error]
    blocks = sum(r.blocks for r in done)
    local, disk, remote, miss, engine = (sum(getattr(r, f) for r in done)
                                         for f in ("local", "disk", "remote", "miss", "engine_cached"))
    out: dict[str, object] = {
        "requests": len(recs), "completed": len(done), "errors": sum(1 for r in recs if r.error),
        "unfinished": sum(1 for r in recs if not r.done and not r.error),
        "blocks": blocks, "local_blocks": local, "remote_blocks": remote, "miss_blocks": miss,
        "engine_cached_blocks": engine,  # missed by the store, found by the engine's own prefix cache
        "disk_blocks": disk,  # of local_blocks: read up from the node's disk tier first
        "pool_hit_ratio": (local - disk) / blocks if blocks else 0.0,
        "disk_hit_ratio": disk / blocks if blocks else 0.0,
        "local_hit_ratio": local / blocks if blocks else 0.0,
        "remote_hit_ratio": remote / blocks if blocks else 0.0,
        "miss_ratio": miss / blocks if blocks else 0.0,
        "engine_cached_ratio": engine / blocks if blocks else 0.0,
        "reusable_ratio": sum(min(r.reusable, r.blocks) for r in done) / blocks if blocks else 0.0,
        "corrupt_pages": sum(r.corrupt for r in recs),
        "ttft_below_prefill": sum(1 for r in done if r.ttft_s < r.prefill_s),
        # requests whose Get read blocks from their node's disk (and pulled nothing) and took longer than
        # computing those blocks would have: a tier that made a request slower than its own prefill
        "disk_slower_than_compute": sum(1 for r in done if r.disk and not r.remote and r.get_s > r.cold_prefill_s
                                        * min(1.0, r.disk * block_tokens / max(1, r.input_tokens))),
        "kv_errors": sum(1 for r in recs if r.kv_error),
    }
    out.update(_dist("ttft", [r.ttft_s for r in done]))
    # what no router, copy, tier or capacity can beat: each request's prefill of the tokens no earlier
    # request had, with nothing queued and nothing to load (an order statistic of TTFTs that are each at or
    # above their floor is at or above the floors' same order statistic: a bound on every percentile)
    out.update(_dist("ttft_floor", [floor_s(r, block_tokens) for r in done]))
    out.update(_dist("ttft_link", [r.ttft_link_s for r in done]))
    out.update(_dist("queue", [r.queue_s for r in done]))
    out.update(_dist("kv_fetch", [r.fetch_s for r in done]))
    out.update(_dist("kv_fetch_link", [r.link_s for r in done]))
    out.update(_dist("prefill", [r.prefill_s for r in done]))
    out["prefill_gpu_s"] = float(sum(r.prefill_s for r in done)) * gpus
    out["local_load_p99_s"] = pct([r.local_load_s for r in done], 99)
    remote = [r for r in done if r.remote > 0]  # requests whose Get pulled pages from peers
    out["remote_requests"] = len(remote)
    out["kv_fetch_remote_p50_s"] = pct([r.fetch_s for r in remote], 50)
    out["kv_fetch_remote_p99_s"] = pct([r.fetch_s for r in remote], 99)
    out["kv_fetch_link_remote_p99_s"] = pct([r.link_s for r in remote], 99)
    out["route_p99_s"] = pct([r.route_s for r in done], 99)
    out["lag_p99_s"] = pct([r.lag_s for r in recs], 99)
    out["put_p99_s"] = pct([r.put_s for r in done], 99)
    cached = [r for r in done if r.cluster_cached > 0]  # the prefix was cached somewhere at its Lookup
    out.update(_dist("ttft_cached", [r.ttft_s for r in cached]))
    out["cached_requests"] = len(cached)
    out["fetch_critical_s"] = float(sum(r.fetch_s for r in done))
    out["recomputed_cached_blocks"] = int(sum(r.recomputed_cached for r in done))
    out["recomputed_cached_tokens"] = out["recomputed_cached_blocks"] * block_tokens
    slo = [r for r in done if meets_slo(r, slo_factor, slo_ttft)]
    out["slo_factor"] = slo_factor
    out["slo_ttft_s"] = slo_ttft
    out["slo_attainment"] = len(slo) / len(recs) if recs else 0.0
    if done:
        span = max(r.first_token_at for r in done) - min(r.t for r in done)
        out["throughput_rps"] = len(done) / span if span > 0 else 0.0
    else:
        out["throughput_rps"] = 0.0
    out.update(bursts_in_pool(done))
    out["route_reasons"] = dict(Counter(r.route_reason for r in done))
    out["requests_per_node"] = dict(sorted(Counter(r.node for r in done).items()))
    if cluster:
        out.update(cluster)
    return out


BURST_GAP_S = 60.0   # requests of one prefix more than this apart (trace s) belong to different bursts
BURST_MIN = 4        # a burst has at least this many requests


def bursts_in_pool(done: Sequence[RequestRecord], gap_s: float = BURST_GAP_S,
                   least: int = BURST_MIN) -> dict[str, int]:
    """Of the bursts of a shared prefix after its first (requests with the same first block and reusable
    blocks, split where ``gap_s`` passes without one, of at least ``least`` requests), how many found the
    prefix in the pool on every node that served them when each node's first request of the burst read it
    (``local - disk >= reusable``: nothing from a tier, a peer or the GPU): what promotion and copies ahead
    of a forecast burst are for. ``bursts_repeat``: the bursts counted, ``bursts_in_pool``: those found."""
    by_head: dict[int, list[RequestRecord]] = {}
    for r in done:
        if r.head and r.reusable > 0:
            by_head.setdefault(r.head, []).append(r)
    total = found = 0
    for recs in by_head.values():
        recs.sort(key=lambda r: r.t)
        bursts: list[list[RequestRecord]] = [[]]
        for r in recs:
            if bursts[-1] and r.t - bursts[-1][-1].t > gap_s:
                bursts.append([])
            bursts[-1].append(r)
        # the first burst computes the prefix (its reusable blocks are its own earlier requests')
        for burst in [b for b in bursts if len(b) >= least][1:]:
            first: dict[str, RequestRecord] = {}
            for r in burst:
                first.setdefault(r.node, r)
            total += 1
            found += all(r.local - r.disk >= r.reusable for r in first.values())
    return {"bursts_repeat": total, "bursts_in_pool": found}


def after_kill(records: Iterable[RequestRecord], node: str, t: float, span_s: float = 30.0) -> dict[str, object]:
    """TTFT of the requests arriving in the ``span_s`` trace seconds after ``node`` was killed at ``t``."""
    recs = [r for r in records if t <= r.t < t + span_s]
    done = [r for r in recs if r.done and not r.error]
    blocks = sum(r.blocks for r in done)
    out: dict[str, object] = {"node": node, "t": t, "span_s": span_s, "requests": len(recs),
                              "completed": len(done), "kv_errors": sum(1 for r in recs if r.kv_error),
                              "on_killed_node": sum(1 for r in recs if r.node == node),
                              "miss_ratio": sum(r.miss for r in done) / blocks if blocks else 0.0}
    out.update(_dist("ttft", [r.ttft_s for r in done]))
    return out


def after_join(records: Iterable[RequestRecord], node: str, t: float, span_s: float = 60.0) -> dict[str, object]:
    """The ``span_s`` trace seconds after ``node`` joined at ``t``: the requests it served against those the
    nodes already serving did, each with its hit ratio (blocks found in a store or its engine's cache, of
    the blocks served) and TTFT, and when it served its first request."""
    recs = [r for r in records if t <= r.t < t + span_s and r.done and not r.error]

    def side(rs: list[RequestRecord]) -> dict[str, object]:
        blocks = sum(r.blocks for r in rs)
        out: dict[str, object] = {"requests": len(rs),
                                  "hit_ratio": round(sum(r.blocks - r.miss for r in rs) / blocks, 4) if blocks else 0.0,
                                  "slower_than_cold_prefill": sum(1 for r in rs if r.ttft_s > r.cold_prefill_s)}
        out.update(_dist("ttft", [r.ttft_s for r in rs]))
        return out

    own = [r for r in recs if r.node == node]
    first = min((r.t for r in own), default=None)
    return {"node": node, "t": t, "span_s": span_s,
            "first_request_after_s": None if first is None else round(first - t, 3),
            "joined": side(own), "serving": side([r for r in recs if r.node != node])}


def check(summary: dict[str, Any]) -> list[str]:
    """Sanity problems of one policy's summary (empty when sound)."""
    problems = []
    if (summary["local_blocks"] + summary["remote_blocks"] + summary["miss_blocks"]
            + summary.get("engine_cached_blocks", 0) != summary["blocks"]):
        problems.append("local + remote + miss + engine-cached != blocks")
    for key in ("local_hit_ratio", "remote_hit_ratio", "miss_ratio"):
        if not 0.0 <= float(summary[key]) <= 1.0:
            problems.append(f"{key} outside [0, 1]")
    if summary["completed"] + summary["errors"] + summary["unfinished"] != summary["requests"]:
        problems.append("completed + errors + unfinished != requests")
    if summary["errors"] or summary["unfinished"]:
        problems.append(f"{summary['errors']} errors, {summary['unfinished']} unfinished")
    if summary["ttft_below_prefill"]:
        problems.append("TTFT below the modelled prefill")
    if summary.get("kv_errors") and not summary.get("failover"):
        problems.append(f"{summary['kv_errors']} failed KV calls without a --kill")
    if summary["corrupt_pages"]:
        problems.append(f"{summary['corrupt_pages']} corrupt pages")
    return problems


def record_hits(rec: RequestRecord, local: int, cached: int, cluster_max: int, cost: Any) -> int:
    """Fill a request's block accounting from what its KV step found: ``local`` blocks on its own node,
    ``cached`` blocks it got (local + fetched), ``cluster_max`` the longest prefix held anywhere.
    Returns the local blocks it used (no more than it got). Shared by the real and simulated replays."""
    local = min(local, cached)
    rec.local, rec.remote, rec.miss = local, cached - local, rec.blocks - cached
    rec.cluster_cached = cluster_max
    rec.recomputed_cached = max(0, min(cluster_max, rec.blocks) - cached)
    rec.cold_prefill_s = cost.prefill_s(rec.input_tokens)
    return local


def metric_sum(text: str, name: str, labels: dict[str, str] | None = None) -> float:
    """Sum of the samples of ``name`` (having all of ``labels``) in Prometheus exposition text."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        metric, _, rest = head.partition("{")
        if metric != name or (labels and not all(f'{k}="{v}"' in rest for k, v in labels.items())):
            continue
        try:
            total += float(value)
        except ValueError:
            pass
    return total


def cluster_summary(policy: str, node_stats: Sequence[object], coordinator_metrics: str, page_bytes: int,
                    byte_scale: int, oracle_copied_pages: int = 0, placed_used_pages: int = 0,
                    link_bytes: float = 0.0, link_bytes_s: float = 0.0) -> dict[str, object]:
    """Byte counters of one run from the nodes' Stats, the coordinator's metrics and the harness.

    * ``spec_bytes``: bytes copied ahead of need -- predictive: the
      coordinator's ``kvstore_replication_bytes{kind="speculative"}``; full:
      ``{kind="replica"}`` (its copy-everything traffic); oracle: the
      harness's own ``Replicate`` replies; none/reactive: 0 (their pulls are
      ``remote_fetch_bytes``). All measured, in the scaled bytes that moved;
      ``*_unscaled`` multiplies by ``--byte-scale``.
    * ``spec_wasted_bytes``: predictive/oracle: the nodes'
      ``speculative_wasted_bytes`` (expired or evicted unread) plus the
      speculative replicas still unread when the run ended; full: copied
      pages that no request on the receiving node read (harness accounting).
    """
    ns = [s.namespaces[0] for s in node_stats if getattr(s, "namespaces", None)]  # type: ignore[attr-defined]
    tiers = [t for s in node_stats for t in getattr(s, "tiers", ()) if t.tier.startswith("disk")]
    expired_unread = sum(int(n.speculative_wasted_bytes) for n in ns)
    unread_end = sum(int(n.speculative_slots) for n in ns) * page_bytes
    if policy == "predictive":
        spec_bytes = int(metric_sum(coordinator_metrics, "kvstore_replication_bytes_total", {"kind": "speculative"}))
    elif policy == "full":
        spec_bytes = int(metric_sum(coordinator_metrics, "kvstore_replication_bytes_total", {"kind": "replica"}))
    elif policy == "oracle":
        spec_bytes = oracle_copied_pages * page_bytes
    else:
        spec_bytes = 0
    if policy in ("predictive", "oracle"):
        wasted = expired_unread + unread_end
    elif policy == "full":
        wasted = max(0, spec_bytes // page_bytes - placed_used_pages) * page_bytes
    else:
        wasted = 0
    ahead = spec_bytes if policy in ("predictive", "oracle", "full") else 0
    saved = int(metric_sum(coordinator_metrics, "kvstore_coordinator", {"what": "egress_saved_bytes"}))
    return {
        # bytes that crossed a link (every node's peer ingress), by kind; scaled bytes, x byte_scale unscaled
        "link_bytes": int(link_bytes), "link_bytes_unscaled": int(link_bytes) * byte_scale,
        "link_bytes_reactive": int(max(0, link_bytes - ahead)),
        "link_bytes_speculative": int(min(link_bytes, ahead)) if policy in ("predictive", "oracle") else 0,
        "link_bytes_full": int(min(link_bytes, ahead)) if policy == "full" else 0,
        "byte_scale": byte_scale,
        "spec_bytes": spec_bytes, "spec_bytes_unscaled": spec_bytes * byte_scale,
        "spec_wasted_bytes": wasted, "spec_wasted_bytes_unscaled": wasted * byte_scale,
        "spec_waste_ratio": wasted / spec_bytes if spec_bytes else 0.0,
        "spec_expired_unread_bytes": expired_unread, "spec_unread_at_end_bytes": unread_end,
        "spec_hits_pages": (hits := sum(int(n.speculative_hits) for n in ns)),
        # of the bytes copied ahead, the share a request read while still a forecast copy (before it was dropped,
        # sank or the run ended)
        "spec_read_share": round(min(1.0, hits * page_bytes / spec_bytes), 4) if spec_bytes else 0.0,
        "placed_pages_used": placed_used_pages,
        "remote_fetch_bytes": sum(int(n.remote_hits) for n in ns) * page_bytes,
        "evictions": sum(sum(int(v) for v in n.evictions.values()) for n in ns),
        # the nodes' disk tiers (--tier-policies tiers-*): pages written down (each a write of a page's bytes,
        # page_bytes_unscaled modelled: the drive's wear) and read back up
        "disk_write_pages": sum(int(t.demotions) for t in tiers),
        "page_bytes_unscaled": page_bytes * byte_scale,
        "disk_read_pages": sum(int(t.promotions) for t in tiers),
        "disk_declined_pages": sum(int(t.declined) for t in tiers),  # evicted, not written (--tier-admit)
        "stored_bytes": sum(int(n.used_bytes) for n in ns),
        "planner_decisions": {k: int(metric_sum(coordinator_metrics, "kvstore_planner_decisions_total",
                                                {"kind": k}))
                              for k in ("replicate", "drop", "full", "claim_tree", "promote", "warm")},
        # holder egress its copy trees saved against copying every target from one source: scaled bytes,
        # and in trace seconds over the modelled link (``link_bytes_s``: unscaled bytes per trace second)
        "egress_saved_bytes": saved,
        "egress_saved_s": round(saved * byte_scale / link_bytes_s, 3) if link_bytes_s > 0 else 0.0,
    }


def replica_fields(timeline: dict[str, Any], page_bytes: int) -> dict[str, float]:
    """The summary's replica-seconds fields (:func:`replica_gib_s`), live and simulated alike."""
    held = replica_gib_s(timeline, page_bytes)
    return {"replica_gib_s_speculative": round(held["speculative"], 3), "replica_gib_s": round(held["replica"], 3),
            "replica_gib_s_sunk": round(held["sunk"], 3)}


def replica_gib_s(timeline: dict[str, Any], page_bytes: int) -> dict[str, float]:
    """Replica-seconds: GiB (unscaled ``page_bytes`` per slot) x trace seconds held, summed over nodes, of
    the speculative replicas, of the plain replicas (pages a node pulled or was copied and kept) and of
    the forecast copies that sank to the disk below the pool (the simulator's timeline only), from the
    timeline's per-node slot samples (trapezoids between samples)."""
    t = timeline.get("stats_t", [])
    out = {}
    for name, key in (("speculative", "spec_slots"), ("replica", "replica_slots"), ("sunk", "sunk_slots")):
        series = timeline.get(key, [])
        total = 0.0
        for (t0, a), (t1, b) in zip(zip(t, series), zip(t[1:], series[1:])):
            total += (sum(a) + sum(b)) / 2 * (t1 - t0)
        out[name] = total * page_bytes / (1 << 30)
    return out
