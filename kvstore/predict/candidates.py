"""Candidate selection: the few hundred rows of the predictor's score vector worth planning.

Vectorised and pure (numpy only): the coordinator calls :func:`select_candidates` every tick over the
scores of 100k+ prefixes and builds :class:`~kvstore.predict.planner_types.Candidate` objects only for
the rows it returns (rule 1 of :mod:`kvstore.predict.planner`).
"""

from __future__ import annotations

import numpy as np


def select_candidates(probs: np.ndarray, threshold: float, limit: int) -> np.ndarray:
    """Row indices of the ``limit`` highest scores ``>= threshold``, best first.

    This is what keeps a tick cheap with 100k active prefixes: one
    vectorised pass and an ``argpartition`` instead of a Python object per
    prefix; only the rows returned become :class:`Candidate` objects.

    Deterministic under ties: equal scores are ordered by row index, and at
    the ``limit`` boundary the lowest indices win. NaN scores never qualify.
    Returns an ``intp`` array (empty when nothing qualifies or ``limit <= 0``).
    """
    probs = np.asarray(probs)
    if probs.ndim != 1:
        raise ValueError(f"probs must be 1-D, got shape {probs.shape}")
    if limit <= 0 or probs.size == 0:
        return np.empty(0, dtype=np.intp)
    idx = np.flatnonzero(probs >= threshold)  # NaN >= x is False
    vals = probs[idx]
    if idx.size > limit:
        # kth largest value; everything above it is in, ties at it fill up by index.
        kth = vals[np.argpartition(vals, idx.size - limit)[idx.size - limit]]
        above = vals > kth
        n_tied = limit - int(np.count_nonzero(above))
        tied = np.flatnonzero(vals == kth)[:n_tied]  # idx is ascending, so lowest rows
        keep = np.flatnonzero(above)
        keep = np.concatenate((keep, tied))
        idx, vals = idx[keep], vals[keep]
    order = np.lexsort((idx, -vals))  # prob descending, then row ascending
    return idx[order].astype(np.intp, copy=False)


__all__ = ["select_candidates"]
