"""Burst predictor: metrics, the LightGBM model, the online predictor and the kvctl commands."""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from kvstore.predict import online
from kvstore.training.cli import eval_main, train_main
from kvstore.predict.evaluate import best_f1_threshold, gate, pr_auc, pr_curve, precision_recall_at, roc_auc
from kvstore.training.evaluate import Dataset, time_split
from kvstore.predict.features import FEATURE_NAMES, momentum_prob
from kvstore.predict.model import BurstModel, ModelError
from kvstore.predict.online import Predictor
from kvstore.training.trace import Simulator
from kvstore.workloads.traces import synth_fanout
from kvstore.predict.types import PredictorConfig
from tests.conftest import TESTS_DIR

SAMPLE = TESTS_DIR / "data" / "mooncake_sample.jsonl"
MOM = FEATURE_NAMES.index("momentum")
SMALL = ["--horizon", "60", "--sample-every", "10", "--max-rows", "300", "--train-from", "0"]


def test_auc_hand_computed() -> None:
    y, s = np.array([0, 0, 1, 1]), np.array([0.1, 0.4, 0.35, 0.8])
    assert roc_auc(y, s) == pytest.approx(0.75)
    assert pr_auc(y, s) == pytest.approx(0.5 * 1 + 0.5 * 2 / 3)
    assert precision_recall_at(y, s, 0.5) == (1.0, 0.5)
    assert precision_recall_at(y, s, 0.3) == pytest.approx((2 / 3, 1.0))
    assert precision_recall_at(y, s, 0.9) == (0.0, 0.0)
    # ties: a tied positive/negative pair counts one half; a tie group is one PR point
    y, s = np.array([1, 0, 1, 0]), np.array([0.5, 0.5, 0.9, 0.1])
    assert roc_auc(y, s) == pytest.approx(3.5 / 4)
    assert pr_auc(y, s) == pytest.approx(0.5 + 0.5 * 2 / 3)
    p, r = pr_curve(y, s)
    assert p.tolist() == pytest.approx([1.0, 2 / 3, 0.5]) and r.tolist() == [0.5, 1.0, 1.0]
    assert best_f1_threshold(y, s) == 0.5
    # perfect, inverted, constant, degenerate
    y = np.array([0, 1, 0, 1, 1])
    assert roc_auc(y, y * 2.0) == 1.0 and roc_auc(y, -y) == 0.0 and roc_auc(y, np.zeros(5)) == 0.5
    assert pr_auc(y, y.astype(float)) == 1.0 and pr_auc(y, np.zeros(5)) == pytest.approx(0.6)
    assert math.isnan(roc_auc(np.ones(3), np.arange(3))) and math.isnan(pr_auc(np.zeros(3), np.arange(3)))


def test_time_split_purges_label_windows_and_gate_rule() -> None:
    t = np.arange(0.0, 1000.0, 10.0)
    n = t.size
    ds = Dataset(np.zeros((n, len(FEATURE_NAMES)), np.float32), np.zeros(n, np.uint8), np.zeros(n, np.uint8), t,
                 np.ones(n, np.int32), FEATURE_NAMES, t_end=1000.0)
    tr, va, te = time_split(ds, 100.0)       # labelled span 0..900: boundaries at 540 and 720
    assert t[tr].max() == 440 and (t[va].min(), t[va].max()) == (550, 620) and (t[te].min(), t[te].max()) == (730, 900)
    assert gate(0.30, 0.305, 0.01) == "lightgbm" and gate(0.29, 0.305, 0.01) == "momentum"
    assert gate(float("nan"), 0.2, 0.01) == "momentum" and gate(0.2, float("nan"), 0.01) == "lightgbm"


def synthetic(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows where since_last_s decides the label (10% noise) and momentum is noise."""
    rng = np.random.default_rng(seed)
    X = rng.random((n, len(FEATURE_NAMES)), dtype=np.float32)
    y = (X[:, FEATURE_NAMES.index("since_last_s")] < 0.3) ^ (rng.random(n) < 0.1)
    return X, y.astype(np.uint8)


def test_train_save_load_round_trip(tmp_path: Path) -> None:
    X, y = synthetic(4000, 0)
    Xv, yv = synthetic(1000, 1)
    Xt, yt = synthetic(2000, 2)
    m = BurstModel(num_threads=1, num_boost_round=60).train(X, y, valid=(Xv, yv), label="test")
    p = m.predict(Xt)
    assert p.dtype == np.float32 and p.shape == (2000,) and ((p >= 0) & (p <= 1)).all()
    ap_model, ap_mom = pr_auc(yt, p), pr_auc(yt, momentum_prob(Xt[:, MOM], 2))
    assert ap_model > 0.8 and ap_model > ap_mom + 0.3 and roc_auc(yt, p) > 0.85
    path = tmp_path / "m" / "model.json"
    m.save(path)
    back = BurstModel.load(path)
    np.testing.assert_array_equal(back.predict(Xt), p)
    assert back.meta["label"] == "test" and back.meta["rows"] == 4000
    with pytest.raises(ModelError, match="feature names differ"):
        BurstModel.load(path, feature_names=FEATURE_NAMES[:-1] + ("other",))
    (tmp_path / "junk.json").write_text("{}")
    with pytest.raises(ModelError):
        BurstModel.load(tmp_path / "junk.json")
    with pytest.raises(ValueError):
        m.predict(X[:, :5])


def drive(p: Predictor, seconds: float, step_s: float = 1.0, seed: int = 0, after: float = 0.0) -> float:
    """Replay a synthetic fan-out trace into ``p`` on trace time, scoring every ``step_s``."""
    reqs = synth_fanout(bursts=int(seconds / 6), reqs_per_burst=12, window_s=20, decoys=int(seconds / 6),
                        background_rate=1.0, duration_s=seconds, seed=seed)
    sim = Simulator(nodes=4, router="round_robin", depths=p.cfg.depths)
    p.fs.holders_count = sim.holders_count
    t = after
    for r in reqs:
        while r.t + after > t:
            p.score(t)
            t += step_s
        a = sim.step(replace(r, t=r.t + after))
        p.observe(a)
    return t


ONLINE = PredictorConfig(horizon_s=30.0, log_every_s=2.0, log_rows=200, min_train_rows=1500,
                         retrain_every_s=1e9, eval_rows=4000)


def test_momentum_fallback_without_model(tmp_path: Path) -> None:
    p = Predictor(ONLINE)
    drive(p, 60.0)
    s = p.score(61.0)
    assert s.source == "momentum" and len(s) > 0 and s.probs.dtype == np.float32
    _, _, X = p.fs.snapshot(61.0, active_within_s=ONLINE.active_within_s)
    np.testing.assert_array_equal(s.probs, momentum_prob(X[:, MOM], ONLINE.momentum_min))
    assert s.need_in_s.shape == s.probs.shape and (s.need_in_s >= ONLINE.need_in_floor_s).all()
    assert s.fanout.shape == s.probs.shape and s.depths.dtype.kind == "i"
    assert p.chain(s.ids[-1])[-1] == s.ids[-1][1]
    bad = tmp_path / "bad.json"
    bad.write_text("not json")
    q = Predictor(ONLINE, model_path=bad)
    assert q.model is None and "cannot read" in (q.load_error or "")
    assert q.score(0.0).source == "momentum" and q.stats()["load_error"]


def test_positions_find_prefixes_in_a_scoring_pass_without_an_index_of_every_id() -> None:
    p = Predictor(ONLINE)
    drive(p, 60.0)
    s = p.score(61.0)
    assert len(s.rows) == len(s) > 10
    some = [s.ids[i] for i in (0, len(s) // 2, len(s) - 1)]
    assert p.positions(s, some + [("nowhere", b"x" * 16)]) == [0, len(s) // 2, len(s) - 1, -1]
    later = p.score(10_000.0)  # all gone quiet: the earlier pass still knows its own rows
    assert len(later) == 0 and p.positions(later, some) == [-1, -1, -1]


def test_retrain_swaps_model_without_blocking_score(monkeypatch: pytest.MonkeyPatch) -> None:
    p = Predictor(ONLINE)
    t = drive(p, 240.0)
    assert p.labelled_rows >= ONLINE.min_train_rows
    assert p.maybe_retrain(t)  # due: never trained, enough rows
    assert p.wait_retrain(20.0) and p.model_version == 1
    release, started = threading.Event(), threading.Event()
    real_train = BurstModel.train

    def slow_train(self: BurstModel, *a: object, **k: object) -> BurstModel:
        started.set()
        assert release.wait(10.0)
        return real_train(self, *a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(BurstModel, "train", slow_train)
    assert p.maybe_retrain(t, force=True)
    assert started.wait(5.0) and p.training
    assert p.maybe_retrain(t, force=True) is False          # one retrain at a time
    worst = 0.0
    for i in range(5):                                      # the event loop keeps scoring meanwhile
        t0 = time.perf_counter()
        s = p.score(t + i)
        worst = max(worst, time.perf_counter() - t0)
        assert p.model_version == 1
    assert worst < 1.0
    release.set()
    assert p.wait_retrain(20.0)
    assert p.model_version == 2 and p.retrains == 2 and p.train_error is None
    st = p.stats()
    assert st["valid"]["rows"] > 0 and st["valid"]["pr_auc_model"] > 0.5
    s = p.score(t + 10)
    assert s.source == ("lightgbm" if st["gate_ok_valid"] else "momentum")
    monkeypatch.setattr(online, "_THREAD_ROWS", 0)            # inference in a worker thread
    s2 = asyncio.run(p.score_async(t + 10))
    assert s2.ids == s.ids and np.array_equal(s2.probs, s.probs) and s2.source == s.source
    p.close()
    assert p.maybe_retrain(t + 1e6, force=True) is False       # closed: no more retrains


class Inverted:
    """A model that ranks prefixes against momentum: the online gate must drop it."""

    def predict(self, X: np.ndarray) -> np.ndarray:
        return (1.0 - momentum_prob(X[:, MOM], 2)).astype(np.float32)


def test_online_gate_falls_back_to_momentum() -> None:
    p = Predictor(ONLINE)
    p.install(Inverted())  # type: ignore[arg-type]
    assert p.score(0.0).source == "lightgbm"           # until the online evaluation knows better
    drive(p, 150.0)
    st = p.stats()
    assert st["online"]["rows"] >= 200 and st["online"]["pr_auc_model"] < st["online"]["pr_auc_momentum"] - 0.01
    assert st["gate_ok_online"] is False and p.score(151.0).source == "momentum"


def test_kvctl_train_and_eval(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = tmp_path / "model.json"
    assert train_main(["--trace", str(SAMPLE), "--out", str(model), *SMALL]) == 0
    out = capsys.readouterr().out
    assert "| source (validation part) |" in out and "| mooncake_sample |" in out
    meta = json.loads((tmp_path / "model.json.metrics.json").read_text())
    assert meta["model"]["label"] == "remote" and meta["model"]["rows"] > 500 and "gate_ok" in meta["model"]
    p = Predictor(PredictorConfig(), model_path=model)
    assert p.model is not None and p.load_error is None
    assert eval_main(["--trace", str(SAMPLE), "--out", str(tmp_path / "ev"), *SMALL]) == 0
    out = capsys.readouterr().out
    assert out.count("| mooncake_sample | remote |") == 3 and out.count("| mooncake_sample | reuse |") == 3
    assert "gated (" in out and "Rate forecasts" in out
    doc = json.loads((tmp_path / "ev" / "eval.json").read_text())
    assert {r["label"] for r in doc["results"]} == {"remote", "reuse"}
    for r in doc["results"]:
        assert set(r) >= {"lightgbm", "momentum", "gated", "valid"} and r["lightgbm"]["rows"] > 0
    assert eval_main(["--trace", str(SAMPLE), "--model", str(model), "--labels", "remote", *SMALL]) == 0
    assert capsys.readouterr().out.count("| mooncake_sample | remote |") == 3
    assert (tmp_path / "ev" / "pr_curves.png").stat().st_size > 10_000
    assert eval_main(["--trace", str(tmp_path / "missing.jsonl")]) == 2
    assert train_main(["--trace", str(tmp_path / "missing.jsonl"), "--out", str(model)]) == 2
    assert eval_main(["--trace", str(SAMPLE), "--labels", "bogus"]) == 2


def test_calibration_puts_the_operating_point_at_one_half() -> None:
    from kvstore.predict.model import BurstModel

    model = BurstModel(("a", "b"))
    model.operating_threshold = 0.2
    p = np.array([0.0, 0.1, 0.2, 0.6, 1.0], dtype=np.float32)
    out = model.calibrate(p)
    assert np.allclose(out, [0.0, 0.25, 0.5, 0.75, 1.0])
    assert np.all(np.diff(out) > 0)  # ranking (and so ROC/PR-AUC) unchanged


def test_a_retrain_window_of_one_class_keeps_the_model_and_says_so_once(caplog: pytest.LogCaptureFixture) -> None:
    p = Predictor(ONLINE)
    t = drive(p, 240.0)
    assert p.maybe_retrain(t) and p.wait_retrain(20.0) and p.model_version == 1
    model, labels = p.model, p._y_remote.copy()
    p._y_remote[:] = 0                                  # a quiet window: no prefix came back on a node lacking it
    with caplog.at_level("WARNING", logger=online.__name__):
        for i in range(3):                              # due every time: one line, not one a tick
            assert p.maybe_retrain(t + i, force=True) is False
    said = [r for r in caplog.records if "single class" in r.getMessage()]
    assert len(said) == 1 and "keeping the current model" in said[0].getMessage()
    assert p.model is model and p.model_version == 1 and not p.training
    assert p.train_error is None and p.stats()["single_class"] is True
    p._y_remote[:] = labels                             # both classes again: it retrains, and says it anew later
    assert p.maybe_retrain(t + 10, force=True) and p.wait_retrain(20.0)
    assert p.model_version == 2 and p.stats()["single_class"] is False and p.train_error is None
    p._y_remote[:] = 1
    caplog.clear()
    with caplog.at_level("WARNING", logger=online.__name__):
        assert p.maybe_retrain(t + 20, force=True) is False
    assert len([r for r in caplog.records if "single class" in r.getMessage()]) == 1 and p.model_version == 2
    p.close()
