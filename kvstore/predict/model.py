"""LightGBM burst model: train, predict, save and load with a feature-name check.

The file written by :meth:`BurstModel.save` is JSON: a format tag, the
feature names the model was trained on, training metadata and the LightGBM
text model. :meth:`BurstModel.load` refuses a model whose feature names differ
from the running code's, so a stale model file falls back to momentum instead
of scoring garbage.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightgbm as lgb
import numpy as np

from kvstore.predict.features import FEATURE_NAMES

FORMAT = "kvstore-burst-model/1"
# The model shipped as package data (``kvctl train --out`` this path rebuilds it; see docs/predictor.md).
DEFAULT_MODEL_PATH = Path(__file__).resolve().parents[1] / "data" / "burst_model.json"

# Modest, regularised defaults: the traces are small (1e4-1e5 rows) and drift,
# so shallow-ish trees, row/column subsampling and early stopping.
DEFAULT_PARAMS: dict[str, Any] = {
    "objective": "binary",
    "learning_rate": 0.05,
    "num_leaves": 15,
    "min_data_in_leaf": 40,
    "feature_fraction": 0.8,
    "bagging_fraction": 0.8,
    "bagging_freq": 1,
    "lambda_l2": 1.0,
    "max_bin": 127,
    "verbose": -1,
    "deterministic": True,
    "force_row_wise": True,
}


class ModelError(ValueError):
    """A model file that cannot be used (bad format or other features)."""


class BurstModel:
    """A binary LightGBM classifier over the predictor's feature rows."""

    def __init__(self, feature_names: Sequence[str] = FEATURE_NAMES, params: dict[str, Any] | None = None,
                 num_threads: int = 1, num_boost_round: int = 300, early_stopping_rounds: int = 30,
                 seed: int = 0) -> None:
        self.feature_names = tuple(feature_names)
        self.params = {**DEFAULT_PARAMS, **(params or {}), "num_threads": int(num_threads), "seed": int(seed)}
        self.num_boost_round = int(num_boost_round)
        self.early_stopping_rounds = int(early_stopping_rounds)
        self.booster: lgb.Booster | None = None
        self.meta: dict[str, Any] = {}

    @property
    def trained(self) -> bool:
        return self.booster is not None

    def _check(self, X: np.ndarray) -> np.ndarray:
        X = np.asarray(X, dtype=np.float32)
        if X.ndim != 2 or X.shape[1] != len(self.feature_names):
            raise ValueError(f"expected X[n, {len(self.feature_names)}], got shape {X.shape}")
        return X

    def train(self, X: np.ndarray, y: np.ndarray, valid: tuple[np.ndarray, np.ndarray] | None = None,
              weight: np.ndarray | None = None, valid_weight: np.ndarray | None = None,
              init_model: "BurstModel | None" = None, **meta: Any) -> "BurstModel":
        """Fit on (X, y); with ``valid`` = (Xv, yv), early-stop on its binary log-loss.

        ``weight`` weighs rows (recency, source balance); ``init_model``
        continues boosting from a trained model (online retraining starts
        from the offline model: its trees stay, new ones fit the residual of
        the recent rows). A continued model whose new trees do not help on
        validation keeps the initial trees only.
        """
        X = self._check(X)
        y = np.asarray(y, dtype=np.float32)
        ds_params = {"verbose": -1, "max_bin": self.params["max_bin"]}
        names = list(self.feature_names)
        init = init_model.booster if init_model is not None and init_model.trained else None
        if init is not None and tuple(init_model.feature_names) != self.feature_names:  # type: ignore[union-attr]
            raise ModelError("init_model has other features")
        dtrain = lgb.Dataset(X, label=y, weight=weight, feature_name=names, params=ds_params, free_raw_data=False)
        sets, callbacks = [], []
        if valid is not None and len(valid[1]) > 0:
            Xv = self._check(valid[0])
            dvalid = lgb.Dataset(Xv, label=np.asarray(valid[1], dtype=np.float32), weight=valid_weight,
                                 reference=dtrain, feature_name=names, params=ds_params)
            sets = [dvalid]
            callbacks = [lgb.early_stopping(self.early_stopping_rounds, first_metric_only=True, verbose=False)]
        params = {**self.params, "metric": "binary_logloss"}
        if init is not None:  # a continued model: its own (model-string) copy, so the old one is untouched
            init = lgb.Booster(model_str=init.model_to_string(num_iteration=init_model.iterations))  # type: ignore[union-attr]
        self.booster = lgb.train(params, dtrain, num_boost_round=self.num_boost_round, valid_sets=sets,
                                 callbacks=callbacks, init_model=init)
        self.meta = {"rows": int(len(y)), "positives": int(y.sum()), "best_iteration": self.iterations,
                     "continued_from": int(init.current_iteration()) if init is not None else 0, **meta}
        return self

    @property
    def iterations(self) -> int:
        """Trees used for prediction (the early-stopped best, else all)."""
        if self.booster is None:
            return 0
        best = int(self.booster.best_iteration or 0)
        return best if best > 0 else int(self.booster.current_iteration())

    def predict(self, X: np.ndarray, num_threads: int | None = None) -> np.ndarray:
        """P(label) per row as float32 (batched; LightGBM's own threads)."""
        if self.booster is None:
            raise RuntimeError("model is not trained")
        X = self._check(X)
        if X.shape[0] == 0:
            return np.zeros(0, dtype=np.float32)
        it = self.booster.best_iteration or None
        p = self.booster.predict(X, num_iteration=it, num_threads=num_threads or self.params["num_threads"])
        return np.asarray(p, dtype=np.float32)

    @property
    def operating_threshold(self) -> float:
        """The raw score chosen as the operating point (best F1 on validation)."""
        return float(self.meta.get("operating_threshold", 0.5))

    @operating_threshold.setter
    def operating_threshold(self, value: float) -> None:
        self.meta["operating_threshold"] = float(min(max(value, 1e-6), 1 - 1e-6))

    def calibrate(self, p: np.ndarray) -> np.ndarray:
        """Map raw scores so the operating point lands on 0.5 (piecewise
        linear, order kept): the planner's ``--spec-threshold 0.5`` then
        means "the model's best-F1 point", whatever the label's base rate."""
        t = self.operating_threshold
        p = np.asarray(p, dtype=np.float32)
        return np.where(p < t, 0.5 * p / t, 0.5 + 0.5 * (p - t) / (1.0 - t)).astype(np.float32)

    def feature_importance(self) -> dict[str, float]:
        """Gain importance per feature name (for reports)."""
        if self.booster is None:
            return {}
        gain = self.booster.feature_importance(importance_type="gain")
        return {n: float(g) for n, g in zip(self.feature_names, gain)}

    def save(self, path: str | Path) -> None:
        """Write the model atomically (temp file + rename)."""
        if self.booster is None:
            raise RuntimeError("model is not trained")
        doc = {"format": FORMAT, "feature_names": list(self.feature_names), "params": self.params,
               "meta": self.meta, "booster": self.booster.model_to_string()}
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
        os.chmod(tmp, 0o644)
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | Path, feature_names: Sequence[str] = FEATURE_NAMES,
             num_threads: int | None = None) -> "BurstModel":
        """Read a saved model; raise :class:`ModelError` if its features are not ``feature_names``."""
        try:
            doc = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ModelError(f"{path}: cannot read model: {exc}") from exc
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise ModelError(f"{path}: not a {FORMAT} file")
        names = tuple(doc["feature_names"])
        if names != tuple(feature_names):
            missing = sorted(set(feature_names) - set(names))
            extra = sorted(set(names) - set(feature_names))
            raise ModelError(f"{path}: feature names differ (missing {missing}, unexpected {extra}, "
                             f"or another order)")
        params = dict(doc.get("params", {}))
        if num_threads is not None:
            params["num_threads"] = int(num_threads)
        m = cls(names, params=params, num_threads=params.get("num_threads", 1), seed=params.get("seed", 0))
        m.booster = lgb.Booster(model_str=doc["booster"])
        m.meta = dict(doc.get("meta", {}))
        return m
