"""The cross-trace suite, the shipped model and online retraining from it."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvstore.training import suite
from kvstore.training.evaluate import build_dataset
from kvstore.predict.features import FEATURE_NAMES, FeatureStore
from kvstore.predict.model import DEFAULT_MODEL_PATH, BurstModel
from kvstore.predict.online import Predictor
from kvstore.training.trace import Simulator
from kvstore.workloads.traces import synth_fanout
from kvstore.predict.types import PredictorConfig

from tests.unit.predict.test_predict_model import ONLINE, drive


def test_shipped_model_loads_with_todays_features() -> None:
    """A feature change without `kvctl train --out kvstore/data/burst_model.json` fails here."""
    assert DEFAULT_MODEL_PATH.is_file() and DEFAULT_MODEL_PATH.stat().st_size < 2 << 20
    m = BurstModel.load(DEFAULT_MODEL_PATH)
    assert m.feature_names == FEATURE_NAMES and m.iterations > 0
    assert set(m.meta["sources"]) >= {"conversation", "synth_fanout"} and "gate_ok" in m.meta
    # the replay's conversation window (0-120 s) + H and its generator seeds 0-2 were never trained on
    assert m.meta["train_from_s"] >= 120 + 300 and not set(m.meta["train_seeds"]) & {0, 1, 2}
    p = Predictor(PredictorConfig(), model_path=DEFAULT_MODEL_PATH)
    assert p.model is not None and p.stats()["base_model"]


def test_coordinator_loads_the_shipped_model_by_default() -> None:
    from kvstore.cluster.coordinator import Coordinator
    from kvstore.config import NodeConfig

    def make(model: str) -> Coordinator:
        cfg = NodeConfig(replication="predictive", predictor_model=model)
        return Coordinator(cfg, None, None, None, None, lambda ns: 1 << 20)  # type: ignore[arg-type]

    assert make("").predictor.model is not None          # type: ignore[union-attr]
    assert make("none").predictor.model is None          # type: ignore[union-attr]


def test_online_retrain_continues_from_the_offline_model() -> None:
    reqs = synth_fanout(bursts=40, reqs_per_burst=12, window_s=20, decoys=40, duration_s=240.0, seed=5)
    cfg = PredictorConfig(horizon_s=30.0)
    ds = build_dataset(reqs, cfg, sample_every_s=2.0, max_rows=300)
    base = BurstModel(ds.names, num_boost_round=20).train(ds.X, ds.y_remote)
    p = Predictor(ONLINE)
    p._base = base  # as load() does for a model file
    p.install(base)
    drive(p, 150.0)
    assert p.maybe_retrain(force=True) and p.wait_retrain(60.0)
    assert p.train_error is None and p.model_version == 2
    assert p.model is not None and p.model.meta["continued_from"] == base.iterations
    assert p.model.iterations >= base.iterations


def test_relative_features_are_bounded() -> None:
    cfg = PredictorConfig()
    fs = FeatureStore(cfg, None)
    sim = Simulator(nodes=4, router="round_robin", depths=cfg.depths)
    for r in synth_fanout(bursts=10, decoys=10, duration_s=120.0, seed=1):
        fs.observe(sim.step(r))
    _, _, X = fs.snapshot(120.0, active_within_s=300.0)
    for name in ("holders_frac", "fanout_frac", "rank_momentum", "rank_cnt_300s", "rank_recency"):
        col = X[:, fs.names.index(name)]
        assert np.all((col >= 0) & (col <= 1)), name
    assert abs(float(np.mean(X[:, fs.names.index("rank_recency")])) - 0.5) < 1e-3


def test_shape_tiling_keeps_instances_apart() -> None:
    names = suite.shape_names()
    if not names:
        pytest.skip("kvstore.workloads.shapes is not there")
    srcs = {s.name for s in suite.default_sources()}
    assert set(names) <= srcs | {"mixed"}  # every shape is a source (mixed needs the conversation trace)
    tiled = [n for n in names if "base" not in __import__("inspect").signature(suite._shape_fn(n)).parameters]
    reqs = suite.shape_requests(tiled[0], seed=3, min_duration_s=600.0)
    assert reqs == sorted(reqs, key=lambda r: r.t) and reqs[-1].t >= 300.0
    assert reqs == suite.shape_requests(tiled[0], seed=3, min_duration_s=600.0)  # deterministic
    assert reqs != suite.shape_requests(tiled[0], seed=4, min_duration_s=600.0)


def test_training_rows_balance_sources_and_weigh_recent_rows() -> None:
    cfg = PredictorConfig(horizon_s=30.0)

    def part(name: str, n_bursts: int, kind: str) -> suite.Parts:
        reqs = synth_fanout(bursts=n_bursts, reqs_per_burst=8, window_s=10, decoys=n_bursts, duration_s=200.0)
        ds = build_dataset(reqs, cfg, sample_every_s=2.0, max_rows=200)
        return suite.Parts(suite.Source(name, lambda s: reqs, kind), ds, ds, ds, {0: ds})

    a, b = part("a", 40, "window"), part("b", 5, "generator")
    X, y, w = suite.training_rows([a, b], "remote", recency_tau_s=60.0)
    assert X.shape[0] == y.size == w.size and 0 < y.sum() < y.size
    rows_a = X.shape[0] - suite.training_rows([b], "remote")[0].shape[0]  # a's rows come first
    assert math.isclose(w[:rows_a].sum(), w[rows_a:].sum(), rel_tol=1e-6)  # each source weighs the same
    _, y_a, w_flat = suite.training_rows([a], "remote")
    _, _, w_rec = suite.training_rows([a], "remote", recency_tau_s=60.0)
    pos = np.flatnonzero(y_a == 1)  # positives in time order: a late one weighs more once recency counts
    assert w_rec[pos[-1]] > w_rec[pos[0]] and math.isclose(w_flat[pos[-1]], w_flat[pos[0]])
