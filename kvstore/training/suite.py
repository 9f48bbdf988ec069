"""The cross-trace training and evaluation suite of the burst predictor.

One model is trained on the training parts of every *source* and scored on
each source's held-out part, against momentum:

* a **window** source is one recorded trace (the Mooncake conversation
  trace, the Azure code trace, ``mixed``: the conversation with fan-out
  bursts overlaid). It is split by time (train / validation / test, see
  :func:`~kvstore.training.evaluate.time_split`); rows before
  ``train_from_s`` are never trained on (for the shipped traces the replay's
  conversation window, 0-120 s, plus H; none of a trace a user brings);
* a **generator** source (``synth`` and every shape in
  :mod:`kvstore.workloads.shapes`) is trained on seeds ``train_seeds``,
  validated on ``valid_seed`` and tested on ``eval_seeds``: traces it never
  saw. Short shapes are tiled: instances with consecutive seeds, one after
  the other, ids kept apart, until ``min_duration_s`` is reached.

Shapes are found by name in :mod:`kvstore.workloads.shapes` (``SHAPES``; the
function is the name with ``-`` as ``_``, or that plus ``_with`` when it
overlays a base trace), so a new shape joins the suite without a change here.
Shapes run on a ``cache_aware`` simulated router (the replay's): with
round-robin every node holds a burst's prefix after four requests and the
label has almost no positives.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.predict.evaluate import best_f1_threshold, gate, metrics, pr_auc, pr_curve
from kvstore.predict.features import momentum_prob
from kvstore.predict.model import BurstModel
from kvstore.predict.types import PredictorConfig
from kvstore.training.evaluate import Dataset, build_dataset, time_split
from kvstore.workloads import data_path
from kvstore.workloads.traces import Request, load_azure, load_mooncake, synth_fanout

TRAIN_SEEDS = (100, 101)
VALID_SEED = 102
EVAL_SEEDS = (0, 1, 2)
RECENCY_TAU_S = 1800.0    # a trace's training rows weigh exp((t - t_last) / tau): drift (chosen on validation)
TRAIN_FROM_S = 420.0      # the replay's conversation window (0-120 s) plus H is never trained on


@dataclass(frozen=True)
class Source:
    """One trace family of the suite and how its cluster is simulated."""

    name: str
    load: Callable[[int], list[Request]]    # seed -> time-sorted requests
    kind: str                               # "window" (time split) | "generator" (disjoint seeds)
    router: str = "round_robin"
    sample_every_s: float = 30.0
    max_rows: int = 2000
    family: str = ""                        # sources sharing data are held out together
    seeded: bool = False                    # a window source whose overlay depends on the seed
    train_from_s: float = TRAIN_FROM_S      # a window source's seconds never trained on (0 for a user's trace)


def find_data(name: str) -> Path | None:
    """A shipped trace file by name (:func:`kvstore.workloads.data_path`), None when it is not installed."""
    try:
        return data_path(name)
    except FileNotFoundError:
        return None


def shape_names() -> tuple[str, ...]:
    """Every shape :mod:`kvstore.workloads.shapes` offers (none if it is absent)."""
    try:
        from kvstore.workloads import shapes
    except ImportError:
        return ()
    return tuple(getattr(shapes, "SHAPES", ()))


def _shape_fn(name: str) -> Callable[..., list[Request]]:
    from kvstore.workloads import shapes

    base = name.replace("-", "_")
    fn = getattr(shapes, base, None) or getattr(shapes, base + "_with", None)
    if fn is None:
        raise ValueError(f"shape {name!r}: no function {base} or {base}_with in kvstore.workloads.shapes")
    return fn


def _offset(reqs: Sequence[Request], t: float, ids: int) -> list[Request]:
    return [Request(r.t + t, r.input_length, r.output_length, tuple(h + ids for h in r.hash_ids)) for r in reqs]


def shape_requests(name: str, seed: int, base: Sequence[Request] | None = None,
                   min_duration_s: float = 1800.0) -> list[Request]:
    """A trace of shape ``name``: its generator's defaults, tiled to ``min_duration_s``.

    A shape that overlays a base trace (``mixed``) gets ``base`` and as many
    bursts per second as its defaults give over its default span (one per 40 s).
    """
    fn = _shape_fn(name)
    params = inspect.signature(fn).parameters
    if "base" in params:
        if base is None:
            raise ValueError(f"shape {name!r} overlays a base trace; none given")
        span = max((r.t for r in base), default=0.0)
        kw: dict[str, Any] = {"seed": seed}
        if "bursts" in params:
            kw["bursts"] = max(1, round(span / 40.0))
        return fn(base, **kw)
    out: list[Request] = []
    t_off, k = 0.0, 0
    while t_off < min_duration_s:
        reqs = fn(seed=seed * 1000 + k)
        dur = params["duration_s"].default if "duration_s" in params else max((r.t for r in reqs), default=1.0)
        out += _offset(reqs, t_off, k << 44)
        t_off += float(dur)
        k += 1
    out.sort(key=lambda r: r.t)
    return out


def default_sources(names: Sequence[str] | None = None) -> list[Source]:
    """The suite's sources (all by default): conversation, azure_code, synth, mixed and every shape."""
    conv_path, azure_path = find_data("mooncake_conversation.jsonl"), find_data("azure_code_2023.csv")
    conv: list[Request] = []

    def conversation(seed: int = 0) -> list[Request]:
        if not conv:
            if conv_path is None:
                raise FileNotFoundError("mooncake_conversation.jsonl is not in the installed package (kvstore/workloads/data)")
            conv.extend(load_mooncake(conv_path))
        return conv

    out: list[Source] = []
    if conv_path is not None:
        out.append(Source("conversation", conversation, "window", family="conversation"))
    if azure_path is not None:
        out.append(Source("azure_code", lambda seed: load_azure(azure_path, seed=0), "window", family="azure"))
    out.append(Source("synth_fanout", lambda seed: synth_fanout(seed=seed), "generator", family="synth"))
    for shape in shape_names():
        overlay = "base" in inspect.signature(_shape_fn(shape)).parameters
        if overlay and conv_path is None:
            continue
        load = (lambda seed, s=shape: shape_requests(s, seed, base=conversation())) if overlay \
            else (lambda seed, s=shape: shape_requests(s, seed))
        out.append(Source(shape, load, "window" if overlay else "generator", router="cache_aware",
                          sample_every_s=10.0 if overlay else 2.0, max_rows=1000,
                          family="conversation" if overlay else shape, seeded=overlay))
    if names:
        known = {s.name: s for s in out}
        alias = {"synth": "synth_fanout", "azure": "azure_code", "mooncake_conversation": "conversation"}
        missing = [n for n in names if alias.get(n, n) not in known]
        if missing:
            raise ValueError(f"unknown source(s) {missing}; choose from {', '.join(known)}")
        out = [known[alias.get(n, n)] for n in names]
    return out


def concat(parts: Sequence[Dataset]) -> Dataset:
    """Rows of several datasets as one (names must agree)."""
    parts = [p for p in parts if len(p)]
    if not parts:
        raise ValueError("no rows")
    first = parts[0]
    return replace(first, X=np.concatenate([p.X for p in parts]), y_reuse=np.concatenate([p.y_reuse for p in parts]),
                   y_remote=np.concatenate([p.y_remote for p in parts]), t=np.concatenate([p.t for p in parts]),
                   depth=np.concatenate([p.depth for p in parts]), t_end=max(p.t_end for p in parts))


@dataclass
class Parts:
    """A source's labelled rows: what may be trained on, validated on and tested on."""

    source: Source
    train: Dataset
    valid: Dataset
    test: Dataset
    test_by_seed: dict[int, Dataset]


def _uncensored(ds: Dataset, horizon_s: float) -> Dataset:
    return ds.take(np.flatnonzero(ds.t <= ds.t_end - horizon_s))


def build_parts(src: Source, cfg: PredictorConfig, nodes: int = 4, capacity_blocks: int = 16384,
                train_seeds: Sequence[int] = TRAIN_SEEDS, valid_seed: int = VALID_SEED,
                eval_seeds: Sequence[int] = EVAL_SEEDS, train_from_s: float | None = None,
                fractions: tuple[float, float] = (0.6, 0.2)) -> Parts:
    """Build and split one source's rows (window: by time; generator: by seed). ``train_from_s`` overrides
    the source's own (:attr:`Source.train_from_s`)."""
    def ds_of(seed: int) -> Dataset:
        return build_dataset(src.load(seed), cfg, nodes=nodes, router=src.router, capacity_blocks=capacity_blocks,
                             sample_every_s=src.sample_every_s, max_rows=src.max_rows, seed=seed)

    if src.kind == "window":
        tr_ds = ds_of(train_seeds[0])
        tr, va, _ = time_split(tr_ds, cfg.horizon_s, fractions)
        skip = src.train_from_s if train_from_s is None else train_from_s
        tr = tr[tr_ds.t[tr] >= tr_ds.t.min() + skip]
        ev_ds = ds_of(eval_seeds[0]) if src.seeded else tr_ds
        _, _, te = time_split(ev_ds, cfg.horizon_s, fractions)
        test = ev_ds.take(te)
        return Parts(src, tr_ds.take(tr), tr_ds.take(va), test, {eval_seeds[0]: test})
    train = concat([_uncensored(ds_of(s), cfg.horizon_s) for s in train_seeds])
    valid = _uncensored(ds_of(valid_seed), cfg.horizon_s)
    by_seed = {s: _uncensored(ds_of(s), cfg.horizon_s) for s in eval_seeds}
    return Parts(src, train, valid, concat(list(by_seed.values())), by_seed)


def training_rows(parts: Sequence[Parts], label: str, max_rows: int = 60_000, neg_per_pos: float = 20.0,
                  recency_tau_s: float = math.inf, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(X, y, weight) for one model over several sources.

    Per source: every positive, at most ``neg_per_pos`` negatives per positive
    and ``max_rows`` rows in all (random; kept negatives are up-weighted by
    the inverse of their sampling rate). Each source then carries the same
    total weight, so a long trace does not drown a short one. With a finite
    ``recency_tau_s`` a window source's rows weigh ``exp((t - t_last) / tau)``
    (drift: recent behaviour counts more).
    """
    rng = np.random.default_rng(seed)
    xs, ys, ws = [], [], []
    for p in parts:
        ds = p.train
        y = ds.label(label)
        pos, neg = np.flatnonzero(y == 1), np.flatnonzero(y == 0)
        if pos.size > max_rows // 2:
            pos = np.sort(rng.choice(pos, max_rows // 2, replace=False))
        n_neg = int(min(neg.size, max(neg_per_pos * max(pos.size, 1), 1000), max_rows - pos.size))
        keep = np.sort(rng.choice(neg, n_neg, replace=False)) if n_neg < neg.size else neg
        idx = np.concatenate([pos, keep])
        w = np.where(y[idx] == 1, 1.0, neg.size / max(keep.size, 1))
        if p.source.kind == "window" and math.isfinite(recency_tau_s) and idx.size:
            w = w * np.exp((ds.t[idx] - ds.t[idx].max()) / recency_tau_s)
        if idx.size:
            xs.append(ds.X[idx])
            ys.append(y[idx])
            ws.append(w / w.sum())
    if not xs:
        raise ValueError("no training rows")
    w = np.concatenate(ws)
    return np.concatenate(xs), np.concatenate(ys), (w * (w.size / w.sum())).astype(np.float64)


def _pick_trees(model: BurstModel, parts: Sequence[Parts], cfg: PredictorConfig, label: str, seed: int,
                step: int = 10) -> tuple[int, list[float]]:
    """The tree count with the best mean over sources of (model - momentum) validation PR-AUC.

    The pooled log-loss bottoms out early (the easy synthetic sources are fit
    in a few dozen trees); the bound is per source, so the number of trees is
    chosen on the per-source validation gain instead (validation rows only).
    """
    names = parts[0].train.names
    cols = []
    for p in parts:
        Xv, yv, _ = training_rows([replace(p, train=p.valid)], label, max_rows=20_000, seed=seed + 1)
        if yv.size and 0 < yv.sum() < yv.size:
            cols.append((Xv, yv, pr_auc(yv, momentum_prob(Xv[:, names.index("momentum")], cfg.momentum_min))))
    booster = model.booster
    assert booster is not None
    total = booster.current_iteration()
    raw = [np.zeros(len(y)) for _, y, _ in cols]
    best_k, best_gain, curve = total, -np.inf, []
    for k in range(0, total, step):
        n = min(step, total - k)
        gains = []
        for i, (Xv, yv, ap_mom) in enumerate(cols):
            raw[i] += booster.predict(Xv, start_iteration=k, num_iteration=n, raw_score=True)
            gains.append(pr_auc(yv, raw[i]) - ap_mom)
        g = float(np.mean(gains)) if gains else 0.0
        curve.append(g)
        if g > best_gain + 1e-4:
            best_k, best_gain = k + n, g
    return best_k, curve


def fit(parts: Sequence[Parts], cfg: PredictorConfig, label: str = "remote", num_threads: int = 1, seed: int = 0,
        recency_tau_s: float = RECENCY_TAU_S, **meta: Any) -> BurstModel:
    """One LightGBM model over the training parts of ``parts``; trees chosen on their validation parts.

    The operating point (best F1 on the pooled validation rows) and the gate
    (model vs momentum PR-AUC on them) are stored in the model's meta.
    """
    X, y, w = training_rows(parts, label, recency_tau_s=recency_tau_s, seed=seed)
    Xv, yv, wv = training_rows([replace(p, train=p.valid) for p in parts if len(p.valid)], label, seed=seed + 1)
    names = parts[0].train.names
    model = BurstModel(names, num_threads=num_threads, seed=seed)
    model.train(X, y, weight=w, label=label, sources=[p.source.name for p in parts], **meta)
    k, curve = _pick_trees(model, parts, cfg, label, seed)
    model.booster = model.booster.__class__(model_str=model.booster.model_to_string(num_iteration=k))  # type: ignore[union-attr]
    model.meta.update({"best_iteration": k, "valid_gain_curve": curve})
    pv = model.predict(Xv)
    model.operating_threshold = best_f1_threshold(yv, pv, cfg.threshold)
    mom = momentum_prob(Xv[:, names.index("momentum")], cfg.momentum_min)
    model.meta.update({"valid_pr_auc": pr_auc(yv, pv), "valid_pr_auc_momentum": pr_auc(yv, mom),
                       "gate_ok": gate(pr_auc(yv, pv), pr_auc(yv, mom), cfg.gate_margin) == "lightgbm"})
    return model


def score_part(model: BurstModel, p: Parts, cfg: PredictorConfig, label: str = "remote") -> dict[str, Any]:
    """LightGBM, momentum and the gated policy on ``p``'s test rows (gate and thr* from its validation rows)."""
    y_va, y_te = p.valid.label(label), p.test.label(label)
    mom_va = momentum_prob(p.valid.momentum, cfg.momentum_min)
    mom_te = momentum_prob(p.test.momentum, cfg.momentum_min)
    p_va, p_te = model.predict(p.valid.X), model.predict(p.test.X)
    choice = gate(pr_auc(y_va, p_va), pr_auc(y_va, mom_va), cfg.gate_margin)
    thr_m, thr_b = best_f1_threshold(y_va, p_va, cfg.threshold), best_f1_threshold(y_va, mom_va, cfg.threshold)
    gated, thr_g = (p_te, thr_m) if choice == "lightgbm" else (mom_te, thr_b)
    per_seed = {}
    for s, ds in p.test_by_seed.items():
        ys = ds.label(label)
        per_seed[s] = {"lightgbm": pr_auc(ys, model.predict(ds.X)),
                       "momentum": pr_auc(ys, momentum_prob(ds.momentum, cfg.momentum_min)), "rows": len(ds)}
    return {"label": label, "kind": p.source.kind, "router": p.source.router,
            "lightgbm": metrics(y_te, p_te, cfg.threshold, thr_m),
            "momentum": metrics(y_te, mom_te, cfg.threshold, thr_b),
            "gated": {**metrics(y_te, gated, cfg.threshold, thr_g), "choice": choice},
            "valid": {"lightgbm": pr_auc(y_va, p_va), "momentum": pr_auc(y_va, mom_va), "rows": len(p.valid)},
            "per_seed": per_seed, "curves": {"lightgbm": pr_curve(y_te, p_te), "momentum": pr_curve(y_te, mom_te)}}


def evaluate_suite(parts: Sequence[Parts], cfg: PredictorConfig, label: str = "remote", num_threads: int = 1,
                   seed: int = 0, holdout: Sequence[str] = ("conversation",), recency_tau_s: float = RECENCY_TAU_S
                   ) -> tuple[BurstModel, list[tuple[str, dict[str, Any]]]]:
    """Train on every source's training part, score each source's test part.

    For each family in ``holdout`` a second model is trained without that
    family's sources at all (the trace "never seen") and scored on them.
    """
    model = fit(parts, cfg, label, num_threads, seed, recency_tau_s)
    results = [(p.source.name, score_part(model, p, cfg, label)) for p in parts]
    for fam in holdout:
        rest = [p for p in parts if p.source.family != fam]
        held = [p for p in parts if p.source.family == fam]
        if not rest or not held:
            continue
        m = fit(rest, cfg, label, num_threads, seed, recency_tau_s)
        results += [(f"{p.source.name} (never seen)", score_part(m, p, cfg, label)) for p in held]
    return model, results
