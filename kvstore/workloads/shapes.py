"""Workload shapes users run, as :class:`~kvstore.workloads.traces.Request` lists.

Each is a pure function of its parameters and a seed; ``kvctl trace synth
--shape NAME`` writes any of them in the Mooncake jsonl format and the
replay takes ``--trace NAME``. Block ids are fresh integers (a prefix's ids
chain: equal leading ids = shared prefix); 512 tokens a block.

* ``agent-fanout``: bursts of 32-128 requests sharing a 16k-64k-token
  context, each burst's requests within 2-10 s (an agent fanning out tool
  calls or samples over one long context), plus unique background requests;
* ``recurring``: a few prefixes whose bursts return every 60-120 s with
  jitter (a scheduled job, a popular system prompt after a cache flush):
  forecastable before every burst after the first; with ``quiet_s`` the
  bursts come that far apart over a heavy background of long unique
  prompts, so between two bursts other traffic pushes a prefix out of a
  node's pool (into its tiers, or away);
* ``tenants``: many system prompts with Zipf popularity under a periodic
  rate (a day compressed): each request one tenant's prompt and its own
  question; the popular prompts stay hot, the tail's recur after other
  traffic evicted them, and the load rises and falls with the period;
* ``ramp``: one prefix whose request rate grows linearly over the window
  (a feature being rolled out), over a steady background;
* ``mixed``: a trace (the Mooncake conversation window) with fan-out bursts
  overlaid (``mixed_with``);
* ``tool-agent``: tool-and-agent traffic as Mooncake's tool-and-agent trace
  describes it (8.6k input tokens a request on average, 182 output, 59 % of
  the tokens cacheable): long system prompts of a few dozen tools and
  agents, fully repeated with Zipf popularity, each request one of them and
  a part of its own, Poisson arrivals.

Every shape's arrivals that are a random process take ``burstiness`` (gamma
inter-arrivals of that shape, 1.0 = Poisson, as ``vllm bench serve`` draws
them).
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import replace

from kvstore.workloads.traces import BLOCK_TOKENS, Request, arrival_gap

SHAPES = ("agent-fanout", "recurring", "ramp", "mixed", "tenants", "tool-agent")


def _ids(start: int = 1 << 40) -> Iterator[int]:
    return itertools.count(start)


def _req(t: float, prefix: Sequence[int], ids: Iterator[int], suffix_blocks: int, output: int) -> Request:
    hs = tuple(prefix) + tuple(next(ids) for _ in range(suffix_blocks))
    return Request(round(t, 6), len(hs) * BLOCK_TOKENS, output, hs)


def _background(rng: random.Random, ids: Iterator[int], rate: float, duration_s: float, blocks: tuple[int, int],
                output: int, burstiness: float = 1.0) -> list[Request]:
    """Unique requests (no shared prefix) at ``rate`` per second (Poisson at ``burstiness`` 1), each of
    ``blocks`` blocks."""
    out, t = [], 0.0
    while rate > 0:
        t += arrival_gap(rng, rate, burstiness)
        if t >= duration_s:
            break
        out.append(_req(t, (), ids, rng.randint(*blocks), output))
    return out


def agent_fanout(bursts: int = 4, duration_s: float = 60.0, requests: tuple[int, int] = (32, 128),
                 context_tokens: tuple[int, int] = (16384, 65536), window_s: tuple[float, float] = (2.0, 10.0),
                 suffix_blocks: int = 1, output_tokens: int = 256, background: float = 0.5,
                 seed: int = 0, burstiness: float = 1.0) -> list[Request]:
    """``bursts`` bursts spread over ``duration_s``, each a fresh shared context."""
    rng, ids = random.Random(seed), _ids()
    out = _background(rng, ids, background, duration_s, (2, 8), output_tokens, burstiness)
    gap = duration_s / max(1, bursts)
    for b in range(bursts):
        t0 = b * gap + rng.uniform(0.05, 0.35) * gap
        prefix = [next(ids) for _ in range(max(1, rng.randint(*context_tokens) // BLOCK_TOKENS))]
        width = rng.uniform(*window_s)
        for _ in range(rng.randint(*requests)):
            out.append(_req(t0 + rng.uniform(0, width), prefix, ids, suffix_blocks, output_tokens))
    return sorted(out, key=lambda r: r.t)


def recurring(prefixes: int = 2, duration_s: float = 360.0, period_s: tuple[float, float] = (60.0, 120.0),
              jitter_s: float = 5.0, requests: tuple[int, int] = (16, 48), context_tokens: int = 16384,
              window_s: float = 4.0, suffix_blocks: int = 1, output_tokens: int = 256, background: float = 0.5,
              quiet_s: float = 0.0, quiet_bursts: int = 5, quiet_background: float = 1.0,
              quiet_blocks: tuple[int, int] = (32, 96), seed: int = 0, burstiness: float = 1.0) -> list[Request]:
    """Each prefix bursts at a random phase, then every ``period`` (fixed per prefix) +- ``jitter_s``.

    ``quiet_s`` > 0: the periods are ``quiet_s`` to 1.2 x ``quiet_s``, the run lasts ``quiet_bursts``
    of them, and the background is ``quiet_background`` unique requests per second of ``quiet_blocks``
    blocks (16k-48k tokens): at the defaults 64 new blocks a second over the cluster, 8 a node, so a
    ``llama3-70b-tp8`` node's pool at ``--capacity preset`` (5,960 blocks) turns over in about 750 s:
    ``quiet_s`` 900 pushes a prefix out of the pools between its bursts, 600 does not."""
    rng, ids = random.Random(seed), _ids()
    blocks = (2, 8)
    if quiet_s > 0:
        period_s = (quiet_s, 1.2 * quiet_s)
        duration_s = quiet_bursts * 1.1 * quiet_s
        background, blocks = quiet_background, quiet_blocks
    out = _background(rng, ids, background, duration_s, blocks, output_tokens, burstiness)
    for _ in range(prefixes):
        prefix = [next(ids) for _ in range(max(1, context_tokens // BLOCK_TOKENS))]
        period = rng.uniform(*period_s)
        t = rng.uniform(0, min(period, duration_s) / 2)
        while t < duration_s:
            for _ in range(rng.randint(*requests)):
                out.append(_req(t + rng.uniform(0, window_s), prefix, ids, suffix_blocks, output_tokens))
            t += period + rng.uniform(-jitter_s, jitter_s)
    return sorted((r for r in out if r.t < duration_s + window_s), key=lambda r: r.t)


def ramp(duration_s: float = 180.0, start_rate: float = 0.2, end_rate: float = 6.0, context_tokens: int = 16384,
         suffix_blocks: int = 2, output_tokens: int = 256, background: float = 0.5, seed: int = 0,
         burstiness: float = 1.0) -> list[Request]:
    """One prefix whose Poisson rate grows linearly from ``start_rate`` to ``end_rate`` per second
    (``burstiness``: the candidates of the thinning are gamma, so the kept arrivals are burstier or more
    regular than Poisson in the same way)."""
    rng, ids = random.Random(seed), _ids()
    out = _background(rng, ids, background, duration_s, (2, 8), output_tokens, burstiness)
    prefix = [next(ids) for _ in range(max(1, context_tokens // BLOCK_TOKENS))]
    t, peak = 0.0, max(start_rate, end_rate)
    while True:  # thinning: candidates at the peak rate, kept with rate(t) / peak
        t += arrival_gap(rng, peak, burstiness)
        if t >= duration_s:
            break
        if rng.random() < (start_rate + (end_rate - start_rate) * t / duration_s) / peak:
            out.append(_req(t, prefix, ids, suffix_blocks, output_tokens))
    return sorted(out, key=lambda r: r.t)


def tenants(count: int = 2000, zipf: float = 1.1, rate: float = 8.0, period_s: float = 600.0,
            amplitude: float = 0.8, duration_s: float = 1800.0, prompt_tokens: tuple[int, int] = (8192, 32768),
            question_blocks: tuple[int, int] = (1, 8), output_tokens: int = 256, seed: int = 0,
            burstiness: float = 1.0) -> list[Request]:
    """``count`` system prompts (``prompt_tokens`` each, drawn once), tenant ``k`` (1-based) drawn with
    weight ``k ** -zipf``; requests arrive at ``rate x (1 + amplitude x sin(2 pi t / period_s))`` per
    second (a diurnal cycle compressed into ``period_s``), each a tenant's prompt and a question of its
    own (``question_blocks``). Defaults: 2,000 prompts of 16-64 blocks (80k blocks, 12.5 TiB of
    ``llama3-70b-tp8`` KV), Zipf 1.1, 8 requests/s on average between 1.6 and 14.4, a 600 s period,
    three periods."""
    rng, ids = random.Random(seed), _ids()
    prompts = [[next(ids) for _ in range(max(1, rng.randint(*prompt_tokens) // BLOCK_TOKENS))]
               for _ in range(count)]
    weights = list(itertools.accumulate(k ** -zipf for k in range(1, count + 1)))
    out, t, peak = [], 0.0, rate * (1 + abs(amplitude))
    while True:  # thinning: candidates at the peak rate, kept with rate(t) / peak
        t += arrival_gap(rng, peak, burstiness)
        if t >= duration_s:
            break
        if rng.random() * peak < rate * (1 + amplitude * math.sin(2 * math.pi * t / period_s)):
            prompt = rng.choices(prompts, cum_weights=weights)[0]
            out.append(_req(t, prompt, ids, rng.randint(*question_blocks), output_tokens))
    return out


def tool_agent(prompts: int = 48, zipf: float = 1.0, rate: float = 4.0, duration_s: float = 600.0,
               prompt_blocks: tuple[int, int] = (4, 16), own_blocks: tuple[int, int] = (4, 10),
               output_tokens: int = 182, seed: int = 0, burstiness: float = 1.0) -> list[Request]:
    """Tool-and-agent traffic: ``prompts`` system prompts of ``prompt_blocks`` blocks (drawn once; 10 on
    average, 5k tokens), prompt ``k`` (1-based) drawn with weight ``k ** -zipf``, each request that prompt
    whole and ``own_blocks`` blocks of its own (7 on average), at ``rate`` requests a second. At the
    defaults a request has 7.5k-9.0k input tokens on average and 51-59 % of the tokens are cacheable (seeds
    0-2; which prompts are popular differs by seed), as in Mooncake's tool-and-agent trace (8,596 input and
    182 output tokens on average, 59 % cacheable). The parameters were fixed before any replay ran on it."""
    rng, ids = random.Random(seed), _ids()
    heads = [[next(ids) for _ in range(rng.randint(*prompt_blocks))] for _ in range(prompts)]
    weights = list(itertools.accumulate(k ** -zipf for k in range(1, prompts + 1)))
    out, t = [], 0.0
    while True:
        t += arrival_gap(rng, rate, burstiness)
        if t >= duration_s:
            break
        head = rng.choices(heads, cum_weights=weights)[0]
        out.append(_req(t, head, ids, rng.randint(*own_blocks), output_tokens))
    return out


def mixed_with(base: Sequence[Request], bursts: int = 3, seed: int = 0, **fanout: object) -> list[Request]:
    """``base`` (e.g. a conversation window) with ``agent_fanout`` bursts over the same span overlaid."""
    duration = max((r.t for r in base), default=60.0)
    overlay = agent_fanout(bursts=bursts, duration_s=duration, background=0.0, seed=seed, **fanout)  # type: ignore[arg-type]
    top = max((h for r in base for h in r.hash_ids), default=0) + 1
    shift = max(0, top - (1 << 40)) if top > (1 << 40) else 0  # keep the overlay's ids apart from the base's
    overlay = [replace(r, hash_ids=tuple(h + shift for h in r.hash_ids)) for r in overlay]
    return sorted([*base, *overlay], key=lambda r: r.t)
