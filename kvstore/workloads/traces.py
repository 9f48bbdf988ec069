"""Request traces: the request type, the trace loaders and the fan-out generator.

Keys: a Mooncake ``hash_id`` (which names the whole prefix up to its block)
becomes the 8-byte little-endian encoding of the integer, ``hash_key(h)``.

Loaders: :func:`load_mooncake` (jsonl), :func:`load_azure` (arrival times
only; prompts synthesised from a Zipf pool) and :func:`synth_fanout`
(agent fan-out bursts with decoys and background). All return
:class:`Request` lists sorted by time, so the replay, the predictor's
training and the benchmarks can run any of them. :func:`load_trace` picks a
loader by a file's extension.
"""

from __future__ import annotations

import bisect
import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

BLOCK_TOKENS = 512
# KV bytes of one 512-token block of a Llama-3-8B-like model (32 layers,
# 8 KV heads, head_dim 128, fp16, K and V): 512 * 2 * 32 * 8 * 128 * 2.
PAGE_BYTES = 512 * 2 * 32 * 8 * 128 * 2


@dataclass(frozen=True, slots=True)
class Request:
    """One trace request: arrival ``t`` (seconds from the trace start) and its block ids."""

    t: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def arrival_gap(rng: random.Random, rate: float, burstiness: float = 1.0) -> float:
    """Seconds to the next arrival of a process at ``rate`` per second: gamma inter-arrivals of shape
    ``burstiness`` and the same mean (1.0 is Poisson; under 1 burstier, over 1 more regular), as
    ``vllm bench serve --burstiness`` draws them."""
    if burstiness == 1.0:
        return rng.expovariate(rate)
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    return rng.gammavariate(burstiness, 1.0 / (rate * burstiness))


def scale_rate(requests: Sequence[Request], factor: float) -> list[Request]:
    """The same requests ``factor`` times closer together: the arrival rate times ``factor``, each request's
    prompt, output and place in the order unchanged."""
    if not factor > 0:
        raise ValueError(f"rate scale must be > 0, got {factor}")
    if factor == 1.0:
        return list(requests)
    return [replace(r, t=round(r.t / factor, 6)) for r in requests]


def hash_key(h: int) -> bytes:
    """The store key of a trace block id: 8-byte little-endian."""
    return int(h).to_bytes(8, "little")


def key_hash(key: bytes) -> int:
    """Inverse of :func:`hash_key`."""
    return int.from_bytes(key, "little")


class TraceError(ValueError):
    """A trace file that cannot be read: the message names the file, the line and the field."""


def _field(path: str | Path, lineno: int, row: dict[str, object], name: str, default: object = None) -> object:
    if name not in row:
        if default is not None:
            return default
        raise TraceError(f"{path}:{lineno}: field {name!r} is missing")
    return row[name]


def _int(path: str | Path, lineno: int, name: str, value: object) -> int:
    # bool is an int to Python, and a float would be truncated silently: neither is a count of tokens
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    raise TraceError(f"{path}:{lineno}: field {name!r} must be an integer, got {value!r}")


def _number(path: str | Path, lineno: int, name: str, value: object) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    raise TraceError(f"{path}:{lineno}: field {name!r} must be a finite number, got {value!r}")


def parse_mooncake_line(path: str | Path, lineno: int, line: str) -> Request:
    """One Mooncake jsonl line as a :class:`Request`; :class:`TraceError` names the file, line and field."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise TraceError(f"{path}:{lineno}: not a JSON object ({e.msg} at column {e.colno})") from None
    if not isinstance(row, dict):
        raise TraceError(f"{path}:{lineno}: not a JSON object (a {type(row).__name__})")
    t = _number(path, lineno, "timestamp", _field(path, lineno, row, "timestamp"))
    if t < 0:
        raise TraceError(f"{path}:{lineno}: field 'timestamp' must not be negative, got {t:g}")
    lengths = [_int(path, lineno, name, _field(path, lineno, row, name, 0))
               for name in ("input_length", "output_length")]
    if min(lengths) < 0:
        raise TraceError(f"{path}:{lineno}: token lengths must not be negative, got {lengths}")
    ids = _field(path, lineno, row, "hash_ids")
    if not isinstance(ids, list):
        raise TraceError(f"{path}:{lineno}: field 'hash_ids' must be a list of integers, got {ids!r}")
    hash_ids = tuple(_int(path, lineno, f"hash_ids[{i}]", h) for i, h in enumerate(ids))
    if any(h < 0 for h in hash_ids):
        raise TraceError(f"{path}:{lineno}: field 'hash_ids' must hold non-negative integers")
    return Request(t / 1000.0, lengths[0], lengths[1], hash_ids)


def load_mooncake(path: str | Path, limit: int | None = None) -> list[Request]:
    """Load a Mooncake-format jsonl trace (``timestamp`` in ms, ``hash_ids``).

    A line that is not a JSON object, or a field of the wrong type, raises :class:`TraceError` naming the
    file, the line number and the field; nothing of a bad file is returned.
    """
    out: list[Request] = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            out.append(parse_mooncake_line(path, lineno, line))
            if limit is not None and len(out) >= limit:
                break
    out.sort(key=lambda r: r.t)
    return out


def _parse_azure_time(text: str) -> float:
    """Seconds since the epoch day of ``YYYY-MM-DD HH:MM:SS.fffffff`` (7 fraction digits)."""
    date, clock = text.strip().split(" ")
    y, mo, d = (int(x) for x in date.split("-"))
    h, mi, s = clock.split(":")
    days = (y * 372 + mo * 31 + d)  # monotone day index; only differences matter
    return days * 86400.0 + int(h) * 3600.0 + int(mi) * 60.0 + float(s)


def load_azure(path: str | Path, pool: int = 2000, zipf_s: float = 1.1, max_shared_blocks: int = 16,
               drift_s: float = 900.0, limit: int | None = None, seed: int = 0) -> list[Request]:
    """Load the Azure LLM trace (arrival times and lengths only) with synthesised prefixes.

    The trace has no prefix information, so each request draws a prompt from a
    pool of ``pool`` prompts with Zipf(``zipf_s``) popularity; prompt ``j`` is
    a shared system block (id 0) plus ``1..max_shared_blocks`` blocks of its own.
    The request's blocks beyond the prompt (from ``ContextTokens``) are unique.
    Every ``drift_s`` seconds the popularity ranking is reshuffled, so the hot
    set drifts (0 disables).
    """
    rng = random.Random(seed)
    shared_len = [rng.randint(1, max_shared_blocks) for _ in range(pool)]
    weights = [1.0 / (k + 1) ** zipf_s for k in range(pool)]
    cum = [0.0]
    for w in weights:
        cum.append(cum[-1] + w)
    ranks = list(range(pool))
    next_id = 1 + pool * max_shared_blocks
    rows: list[tuple[float, int, int]] = []
    with open(path) as f:
        header = f.readline()
        if "TIMESTAMP" not in header.upper():
            raise ValueError(f"{path}: not an Azure LLM trace (header {header.strip()!r})")
        for lineno, line in enumerate(f, 2):
            parts = line.strip().split(",")
            if len(parts) < 3:
                continue
            try:
                ts = _parse_azure_time(parts[0])
            except ValueError:
                raise TraceError(f"{path}:{lineno}: field 'TIMESTAMP' must be 'YYYY-MM-DD HH:MM:SS.f', "
                                 f"got {parts[0]!r}") from None
            rows.append((ts, _int(path, lineno, "ContextTokens", parts[1].strip()),
                         _int(path, lineno, "GeneratedTokens", parts[2].strip())))
            if limit is not None and len(rows) >= limit:
                break
    rows.sort()
    out: list[Request] = []
    t0 = rows[0][0] if rows else 0.0
    epoch = 0
    for ts, ctx, gen in rows:
        t = ts - t0
        if drift_s > 0 and int(t // drift_s) != epoch:
            epoch = int(t // drift_s)
            rng.shuffle(ranks)
        j = ranks[bisect.bisect_right(cum, rng.random() * cum[-1]) - 1]
        n = max(1, math.ceil(ctx / BLOCK_TOKENS))
        base = 1 + j * max_shared_blocks
        ids = [0] + [base + i for i in range(min(shared_len[j], n - 1))]
        while len(ids) < n:
            ids.append(next_id)
            next_id += 1
        out.append(Request(t, ctx, gen, tuple(ids)))
    return out


def synth_fanout(bursts: int = 200, reqs_per_burst: int = 16, prefix_blocks: int = 8, window_s: float = 60.0,
                 decoys: int = 200, background_rate: float = 1.0, seed: int = 0,
                 duration_s: float = 3600.0, suffix_blocks: int = 2, burstiness: float = 1.0) -> list[Request]:
    """A synthetic agent fan-out trace in the Mooncake request format.

    * ``bursts`` bursts at uniform random times: a new shared prefix of
      ``prefix_blocks`` blocks (after the common block 0) is requested
      ``reqs_per_burst`` times, the first at the burst start and the rest
      uniformly over ``window_s`` seconds, each with ``suffix_blocks`` unique
      blocks after the prefix.
    * ``decoys`` prefixes that look like the start of a burst (two requests
      0.5-5 s apart) and are never requested again.
    * background: unique single-use prompts (1..prefix_blocks+suffix_blocks
      blocks after block 0) at ``background_rate`` req/s (Poisson; gamma
      inter-arrivals of shape ``burstiness`` otherwise, :func:`arrival_gap`).

    Times are rounded to 1 ms; lengths are whole blocks.
    """
    rng = random.Random(seed)
    next_id = 1
    reqs: list[tuple[float, tuple[int, ...]]] = []

    def fresh(n: int) -> list[int]:
        nonlocal next_id
        ids = list(range(next_id, next_id + n))
        next_id += n
        return ids

    for _ in range(bursts):
        start = rng.uniform(0.0, max(duration_s - window_s, 1.0))
        prefix = [0] + fresh(prefix_blocks)
        offsets = [0.0] + [rng.uniform(0.0, window_s) for _ in range(reqs_per_burst - 1)]
        for off in offsets:
            reqs.append((start + off, tuple(prefix + fresh(suffix_blocks))))
    for _ in range(decoys):
        start = rng.uniform(0.0, duration_s)
        prefix = [0] + fresh(prefix_blocks)
        for k in range(2):
            reqs.append((start + k * rng.uniform(0.5, 5.0), tuple(prefix + fresh(suffix_blocks))))
    t = 0.0
    while background_rate > 0:
        t += arrival_gap(rng, background_rate, burstiness)
        if t >= duration_s:
            break
        reqs.append((t, tuple([0] + fresh(rng.randint(1, prefix_blocks + suffix_blocks)))))
    reqs.sort(key=lambda r: r[0])
    return [Request(round(t, 3), len(ids) * BLOCK_TOKENS, 128, ids) for t, ids in reqs]




def cut_window(requests: Sequence[Request], start_s: float = 0.0, duration_s: float | None = None,
               max_requests: int | None = None) -> list[Request]:
    """Requests in ``[start_s, start_s + duration_s)``, at most ``max_requests``, times rebased to 0."""
    end = math.inf if duration_s is None else start_s + duration_s
    out = [r for r in requests if start_s <= r.t < end]
    if max_requests is not None:
        out = out[:max_requests]
    if not out:
        return []
    t0 = start_s
    return [replace(r, t=round(r.t - t0, 6)) for r in out]


def load_trace(path: str | Path, limit: int | None = None, seed: int = 0) -> list[Request]:
    """Load a trace by extension: ``.jsonl`` Mooncake, ``.csv`` Azure; ``synth:`` the fan-out generator."""
    p = str(path)
    if p.startswith("synth"):
        return synth_fanout(seed=seed)
    if p.endswith(".csv"):
        return load_azure(p, limit=limit, seed=seed)
    return load_mooncake(p, limit=limit)
