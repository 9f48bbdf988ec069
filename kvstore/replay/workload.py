"""Workloads for the replay: trace windows, the synthetic fan-out trace, reuse bounds.

Loading reuses :mod:`kvstore.workloads.traces` (``load_mooncake``,
``synth_fanout``, ``hash_key``); this module only cuts windows, compresses
nothing (the driver divides times by ``--speedup``), writes the synthetic
trace in the Mooncake jsonl format, and computes what the oracle and the
report need from the future of the trace.

A Mooncake ``hash_id`` names the whole prefix up to its block (ids chain),
so "block ``h`` was seen before" means "this request's prefix up to ``h`` was
requested before": :func:`reusable_blocks` is the most any cache could serve.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from kvstore.workloads import resolve_path, shapes
from kvstore.workloads.traces import BLOCK_TOKENS, Request, cut_window, load_mooncake, scale_rate, synth_fanout

DEFAULT_TRACE = "conversation"  # the shipped Mooncake conversation trace (kvstore/workloads/data/README.md)


@dataclass(slots=True)
class Workload:
    """A named list of requests, times in seconds from the window start."""

    name: str
    requests: list[Request]
    source: dict[str, object] = field(default_factory=dict)

    @property
    def duration_s(self) -> float:
        return self.requests[-1].t if self.requests else 0.0

    def at_rate(self, factor: float) -> Workload:
        """This workload at ``factor`` times its arrival rate (:func:`~kvstore.workloads.traces.scale_rate`)."""
        if factor == 1.0:
            return self
        return Workload(self.name, scale_rate(self.requests, factor), {**self.source, "rate_scale": factor})

    def describe(self) -> dict[str, object]:
        blocks = sum(len(r.hash_ids) for r in self.requests)
        reuse = reusable_blocks(self.requests)
        return {"name": self.name, **self.source, "requests": len(self.requests),
                "duration_s": round(self.duration_s, 3), "blocks": blocks,
                "reusable_blocks": int(sum(reuse)),
                "reusable_ratio": (sum(reuse) / blocks) if blocks else 0.0}


def mooncake_workload(path: str | Path, start_s: float = 0.0, duration_s: float | None = None,
                      max_requests: int | None = None, name: str | None = None) -> Workload:
    """A window of a Mooncake-format jsonl trace."""
    p = resolve_path(path)
    reqs = cut_window(load_mooncake(p), start_s, duration_s, max_requests)
    if not reqs:
        raise ValueError(f"{p}: no requests in the window start={start_s}s duration={duration_s}s")
    return Workload(name or p.stem, reqs, {"kind": "mooncake", "path": str(p), "start_s": start_s,
                                           "window_s": duration_s, "max_requests": max_requests})


@dataclass(frozen=True, slots=True)
class SynthSpec:
    """Parameters of the synthetic same-prefix fan-out trace (token counts become 512-token blocks)."""

    bursts: int = 4
    requests: int = 32          # requests per burst
    prefix_tokens: int = 8192   # the shared prefix of a burst
    window_s: float = 8.0       # a burst's requests arrive within this window
    decoys: int = 4             # prefixes requested twice, never again
    background: float = 0.5     # unique single-use requests per second
    duration_s: float = 60.0
    suffix_tokens: int = 1024   # each request's own part after the prefix
    output_tokens: int = 512
    seed: int = 0

    @property
    def prefix_blocks(self) -> int:
        return max(1, math.ceil(self.prefix_tokens / BLOCK_TOKENS))

    @property
    def suffix_blocks(self) -> int:
        return max(1, math.ceil(self.suffix_tokens / BLOCK_TOKENS))


def synth_requests(spec: SynthSpec, burstiness: float = 1.0) -> list[Request]:
    """``kvstore.workloads.traces.synth_fanout`` with the spec's sizes; output lengths set to ``output_tokens``."""
    reqs = synth_fanout(bursts=spec.bursts, reqs_per_burst=spec.requests, prefix_blocks=spec.prefix_blocks,
                        window_s=spec.window_s, decoys=spec.decoys, background_rate=spec.background,
                        seed=spec.seed, duration_s=spec.duration_s, suffix_blocks=spec.suffix_blocks,
                        burstiness=burstiness)
    return [replace(r, output_length=spec.output_tokens) for r in reqs]


def synth_workload(spec: SynthSpec, name: str = "synth-fanout", burstiness: float = 1.0) -> Workload:
    from dataclasses import asdict

    extra = {"burstiness": burstiness} if burstiness != 1.0 else {}
    return Workload(name, synth_requests(spec, burstiness), {"kind": "synth", **asdict(spec), **extra})


def write_mooncake(requests: Sequence[Request], path: str | Path) -> int:
    """Write requests as Mooncake jsonl (``timestamp`` in ms); returns the count."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with open(p, "w") as f:
        for r in requests:
            f.write(json.dumps({"timestamp": int(round(r.t * 1000)), "input_length": r.input_length,
                                "output_length": r.output_length, "hash_ids": list(r.hash_ids)}) + "\n")
    return len(requests)


def reusable_blocks(requests: Sequence[Request]) -> list[int]:
    """Per request (in time order): leading blocks some earlier request also had.

    The most a perfect cluster-wide cache could serve; the oracle copies
    exactly this much ahead of each request. Ids chain, so a seen id means
    a seen prefix; the first unseen id ends the reusable part.
    """
    seen: set[int] = set()
    out = []
    for r in requests:
        n = 0
        for h in r.hash_ids:
            if h not in seen:
                break
            n += 1
        out.append(n)
        seen.update(r.hash_ids)
    return out


def reuse_ready(requests: Sequence[Request], reusable: Sequence[int],
                compute_s: Callable[[int], float]) -> list[tuple[float, ...]]:
    """Per request (in time order): for ``n`` = 1 .. its reusable blocks, the earliest trace time at which
    its first ``n`` blocks can be held anywhere (``ready[n - 1]``).

    A block exists once the first request that has it could have computed it: that request's arrival plus
    ``compute_s`` of the blocks from its own reusable prefix through that block (as if the prefix were at
    hand on an idle engine the moment it arrived), so no cluster can hold it sooner: the bound's clock.
    """
    first: dict[int, float] = {}
    out = []
    for r, n in zip(requests, reusable):
        ready, t = [], float("-inf")
        for h in r.hash_ids[:n]:
            t = max(t, first[h])
            ready.append(t)
        for j in range(n, len(r.hash_ids)):
            first.setdefault(r.hash_ids[j], r.t + compute_s(j + 1 - n))
        out.append(tuple(ready))
    return out


SHAPE_DEFAULTS: dict[str, dict[str, object]] = {
    # compact defaults; kvctl trace synth --shape NAME --shape-arg k=v overrides any of them
    "agent-fanout": {"bursts": 3, "duration_s": 45.0},
    "recurring": {"prefixes": 2, "duration_s": 360.0},
    "ramp": {"duration_s": 180.0},
    "mixed": {"bursts": 3},
}


def shape_requests(name: str, seed: int = 0, base: Sequence[Request] | None = None,
                   **overrides: object) -> list[Request]:
    """The requests of workload shape ``name`` (:mod:`kvstore.workloads.shapes`)."""
    kw = {**SHAPE_DEFAULTS.get(name, {}), **overrides, "seed": seed}
    if name == "agent-fanout":
        return shapes.agent_fanout(**kw)  # type: ignore[arg-type]
    if name == "recurring":
        return shapes.recurring(**kw)  # type: ignore[arg-type]
    if name == "ramp":
        return shapes.ramp(**kw)  # type: ignore[arg-type]
    if name == "tenants":
        return shapes.tenants(**kw)  # type: ignore[arg-type]
    if name == "tool-agent":
        return shapes.tool_agent(**kw)  # type: ignore[arg-type]
    if name == "mixed":
        if base is None:
            base = cut_window(load_mooncake(resolve_path(DEFAULT_TRACE)), 0.0, 120.0)
        return shapes.mixed_with(base, **kw)  # type: ignore[arg-type]
    raise ValueError(f"unknown shape {name!r}; choose from {', '.join(shapes.SHAPES)}")


def shape_workload(name: str, seed: int = 0, base: Sequence[Request] | None = None,
                   **overrides: object) -> Workload:
    return Workload(name, shape_requests(name, seed, base, **overrides),
                    {"kind": "shape", "shape": name, "seed": seed, **SHAPE_DEFAULTS.get(name, {}), **overrides})
