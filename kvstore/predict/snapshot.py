"""The feature matrix of a snapshot, computed from the rows the feature store copied out.

:meth:`~kvstore.predict.features.FeatureStore.take` copies what a snapshot reads of the store's rows
(on the event loop, which owns the store: a few fancy-index reads); :meth:`RowsTaken.features` turns
those copies into X on any thread. So the coordinator scores 100k prefixes with the loop held only for
the copy, the features and the model running in a worker thread beside it (numpy and LightGBM release
the GIL for most of it). Columns: :func:`feature_names`; ``docs/predictor.md`` says what each means.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kvstore.predict.types import PredictorConfig, PrefixId


def feature_names(cfg: PredictorConfig) -> tuple[str, ...]:
    """Column names of ``snapshot``'s X for ``cfg`` (windows name some columns)."""
    w = [f"cnt_{x:g}s" for x in cfg.windows_s]
    r = [f"rate_{x:g}s" for x in cfg.windows_s]
    m = f"{cfg.momentum_window_s:g}s"
    return ("depth", "prefix_tokens", "prefix_bytes", "req_blocks", "depth_frac", "count", *w,
            f"seen_{m}", "age_s", "since_last_s", "since_prev_s", "gap_mean_s", "gap_std_s", "gap_nz_mean_s",
            "last_gap_s", "overdue", "fanout", "nodes_ever", "holders", "lacking_nodes", "last_outcome",
            "last_lacked", "parent_count", f"parent_cnt_{m}", "share_of_parent", "children_active", *r,
            "rate_trend", "active_keys_depth", "active_keys", "momentum",
            # scale-free: shares of the cluster, fractions of the nodes, ranks in this snapshot
            "holders_frac", "fanout_frac", *[f"share_{x:g}s" for x in cfg.windows_s[1:]], "burst_ratio",
            "rank_momentum", f"rank_cnt_{cfg.windows_s[-1]:g}s", "rank_recency")


def windows(cfg: PredictorConfig) -> np.ndarray:
    """The decayed counters' windows in seconds: ``cfg.windows_s``, then the momentum window."""
    return np.array([*cfg.windows_s, cfg.momentum_window_s], dtype=np.float64)


def momentum_seen(ring: np.ndarray, now: float, since: np.ndarray, window_s: float) -> tuple[np.ndarray, np.ndarray]:
    """(sightings within ``window_s``, momentum score) of rows with these rings of sighting times."""
    seen = (ring > now - window_s).sum(axis=1).astype(np.float64)
    return seen, seen + 0.5 * np.exp(-since / window_s)


@dataclass(frozen=True, slots=True, eq=False)
class RowsTaken:
    """Copies of what a snapshot reads of the rows (``FeatureStore.take``), row by row unless named."""

    cfg: PredictorConfig
    now: float
    rows: np.ndarray                   # the store's row numbers, ascending
    id_array: np.ndarray               # their PrefixIds (object array: ``ids()`` makes the list off the loop)
    depth: np.ndarray
    block_tokens: np.ndarray
    page_bytes: np.ndarray
    req_blocks: np.ndarray
    last_t: np.ndarray
    first_t: np.ndarray
    count: np.ndarray
    dec: np.ndarray                    # [rows, windows + momentum] decayed counters at their last update
    ring: np.ndarray                   # [rows, ring] the last sighting times
    sum_gap2: np.ndarray
    n_nz: np.ndarray
    last_gap: np.ndarray
    mask_ep: np.ndarray
    mask_cur: np.ndarray
    mask_prev: np.ndarray
    mask_all: np.ndarray
    holders: np.ndarray
    outcome: np.ndarray
    lacked: np.ndarray
    n_nodes: float                     # nodes the store has seen
    parent_ok: np.ndarray              # the row's parent prefix is still the one it was
    parent_last_t: np.ndarray
    parent_count: np.ndarray
    parent_dec_mom: np.ndarray         # the parent's momentum-window counter at its last update
    children: np.ndarray               # active rows whose parent it is
    active_at_depth: np.ndarray        # active rows at its depth
    active: float                      # active rows
    g_dec: np.ndarray                  # the cluster's decayed request counters ...
    g_t: float                         # ... at this time

    def __len__(self) -> int:
        return len(self.id_array)

    def ids(self) -> list[PrefixId]:
        """The rows' PrefixIds, as a list."""
        return self.id_array.tolist()  # type: ignore[no-any-return]

    def features(self) -> np.ndarray:
        """X[n, F] float32 (column-major: the planner and the log read it by column)."""
        cfg, now = self.cfg, self.now
        win = windows(cfg)
        nan = np.nan
        cols: list[np.ndarray] = []
        depth = self.depth.astype(np.float64)
        last_t, first_t, count = self.last_t, self.first_t, self.count
        since = np.maximum(now - last_t, 0.0)
        req_blocks = self.req_blocks.astype(np.float64)
        cols += [depth, depth * self.block_tokens, depth * self.page_bytes, req_blocks,
                 depth / np.maximum(req_blocks, 1.0), count]
        decay = np.exp(-since[:, None] / win[None, :])
        dec = self.dec * decay
        cols += [dec[:, i] for i in range(len(cfg.windows_s))]
        seen, mom = momentum_seen(self.ring, now, since, cfg.momentum_window_s)
        prev_t = self.ring[:, 1]
        n_g = count - 1
        with np.errstate(divide="ignore", invalid="ignore"):
            span = last_t - first_t
            gap_mean = np.where(n_g > 0, span / n_g, nan)
            gap_std = np.sqrt(np.maximum(self.sum_gap2 / n_g - gap_mean * gap_mean, 0.0))
            gap_nz = np.where(self.n_nz > 0, span / self.n_nz, nan)
        cols += [seen, now - first_t, since, np.where(np.isfinite(prev_t), now - prev_t, nan), gap_mean,
                 np.where(n_g > 0, gap_std, nan), gap_nz, self.last_gap, since / np.maximum(gap_nz, 1.0)]
        # fan-out and holders
        ep_now = math.floor(now / cfg.fanout_window_s)
        ep = self.mask_ep
        zero = np.uint64(0)
        recent = np.where(ep == ep_now, self.mask_cur | self.mask_prev,
                          np.where(ep == ep_now - 1, self.mask_cur, zero))
        holders = self.holders.astype(np.float64)
        n_nodes = self.n_nodes
        fanout = np.bitwise_count(recent).astype(np.float64)
        cols += [fanout, np.bitwise_count(self.mask_all).astype(np.float64),
                 holders, np.maximum(n_nodes - holders, 0.0), self.outcome.astype(np.float64),
                 self.lacked.astype(np.float64)]
        # parent prefix (previous tracked depth of the last request) and children
        pvalid = self.parent_ok
        p_since = np.maximum(now - self.parent_last_t, 0.0)
        p_count = np.where(pvalid, self.parent_count, nan)
        p_mom = np.where(pvalid, self.parent_dec_mom * np.exp(-p_since / cfg.momentum_window_s), nan)
        cols += [p_count, p_mom, count / p_count, self.children.astype(np.float64)]
        # cluster-wide: request rate and trend, active keys
        g = self.g_dec * np.exp(-max(now - self.g_t, 0.0) / win) / win
        nw = len(cfg.windows_s)
        n = self.rows.size
        cols += [np.full(n, g[i]) for i in range(nw)]
        cols.append(np.full(n, g[0] / g[nw - 1] if g[nw - 1] > 0 else nan))
        cols += [self.active_at_depth.astype(np.float64), np.full(n, self.active), mom]
        cols += self._relative(n_nodes, holders, fanout, dec, g * win, mom, since)
        assert len(cols) == len(feature_names(cfg))
        X = np.empty((len(cols), n), dtype=np.float32).T  # column-major: each column one contiguous write
        for i, c in enumerate(cols):
            X[:, i] = c
        return X

    def _relative(self, n_nodes: float, holders: np.ndarray, fanout: np.ndarray, dec: np.ndarray,
                  cluster: np.ndarray, mom: np.ndarray, since: np.ndarray) -> list[np.ndarray]:
        """Features that mean the same on any trace: fractions of the nodes,
        the prefix's share of the cluster's requests per window, its own
        short/long trend, and percentile ranks among the rows scored now."""
        nn = max(n_nodes, 1.0)
        out = [holders / nn, fanout / nn]
        out += [dec[:, i] / max(float(cluster[i]), 1e-9) for i in range(1, len(self.cfg.windows_s))]
        out.append(dec[:, 0] / np.maximum(dec[:, len(self.cfg.windows_s) - 1], 1e-9))
        n = mom.size
        for v in (mom, dec[:, len(self.cfg.windows_s) - 1], -since):
            r = np.empty(n, dtype=np.float64)
            r[np.argsort(v.astype(np.float32), kind="stable")] = (np.arange(n) + 0.5) / max(n, 1)
            out.append(r)
        return out


__all__ = ["RowsTaken", "feature_names", "momentum_seen", "windows"]
