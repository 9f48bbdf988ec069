"""Types of the burst predictor: the access stream and its knobs.

Pure data: no I/O. The coordinator turns node reports into :class:`Access`
events and the predictor turns them into scored prefixes; the planner's own
types (candidates, decisions) live beside it in
:mod:`kvstore.placement.planner_types`.

A *prefix* is identified by ``(namespace, key)`` where ``key`` is the chain
key of its last block (keys are chained hashes, so the last key names the
whole prefix); its ``depth`` is its length in blocks.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

PrefixId = tuple[str, bytes]  # (namespace, chain key of the prefix's last block)


class Outcome(enum.IntEnum):
    """How the request's deepest tracked prefix was served on its node."""

    LOCAL = 0
    REMOTE = 1
    MISS = 2


@dataclass(frozen=True, slots=True)
class Access:
    """One request as the coordinator sees it.

    ``keys`` are the request's chain keys for blocks 1..n, cut at the
    deepest tracked depth (n = min(total_blocks, max depth)); the prefix of
    depth d is named by ``keys[d - 1]``, so one request updates one prefix
    per tracked depth it reaches, and a planner can replicate any of them.
    """

    t: float                      # seconds; any monotonic clock (trace time offline)
    namespace: str
    node: str                     # node that served the request
    keys: tuple[bytes, ...]       # chain keys of blocks 1..n
    outcome: Outcome = Outcome.MISS
    block_tokens: int = 0         # tokens per block (0 = unknown)
    page_bytes: int = 0           # bytes per page (0 = unknown)
    total_blocks: int = 0         # the request's full prefix length in blocks
    local_blocks: int = -1        # leading blocks the serving node held before serving (-1 = unknown)


@dataclass(frozen=True, slots=True)
class PredictorConfig:
    """Knobs of features, labels and the model (see docs/predictor.md)."""

    depths: tuple[int, ...] = (1, 2, 4, 8)
    horizon_s: float = 300.0          # H: label window
    min_future: int = 1               # K: label is "at least K more requests within H"
    windows_s: tuple[float, ...] = (10.0, 60.0, 300.0)  # recent-count windows (decayed counters)
    momentum_window_s: float = 60.0   # W of the momentum baseline (--predictor-momentum-window)
    momentum_min: int = 2             # m of the momentum baseline
    max_prefixes: int = 200_000       # tracked prefixes; the stalest are dropped beyond this
    idle_drop_s: float = 1800.0       # prefixes unseen this long are dropped
    retrain_every_s: float = 600.0    # online retraining period
    min_train_rows: int = 2_000
    fanout_window_s: float = 60.0     # fan-out = distinct nodes in the last 1-2 such windows
    active_within_s: float = 300.0    # scored/labelled population: prefixes seen this recently
    threshold: float = 0.5            # operating threshold (the planner's default)
    gate_margin: float = 0.01         # fall back to momentum when model PR-AUC < momentum's - this
    log_every_s: float = 10.0         # online: record a labelled sample this often
    log_rows: int = 512               # online: rows per recorded sample (random subset)
    max_log_rows: int = 100_000       # online: labelled rows kept for retraining
    eval_rows: int = 20_000           # online: most recent labelled rows used for evaluation
    need_in_floor_s: float = 1.0      # floor of need_in_s (timestamps come in batches)
    num_threads: int = 1              # LightGBM threads (training and inference)
    recency_tau_s: float = 1800.0     # online retraining weighs a labelled row exp((t - t_newest) / tau)
    forecast_lead_s: float = 30.0     # rate forecast: copy a prefix whose next burst is due within this (s)
