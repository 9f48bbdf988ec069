"""``kvctl train`` and ``kvctl eval-predictor``: offline training and evaluation from traces.

    kvctl train --trace FILE --out MODEL [--nodes N --horizon S --depths 1,2,4,8 ...]
    kvctl eval-predictor --trace FILE [--trace FILE ...] [--out DIR] [...]

``--trace`` takes a Mooncake jsonl, an Azure LLM csv (prefixes synthesised,
see :func:`~kvstore.predict.trace.load_azure`) or ``synth`` (the fan-out
generator). Both print a Markdown table; ``train`` writes the model and
``MODEL.metrics.json``, ``eval-predictor`` writes ``eval.json``, ``eval.md``
and ``pr_curves.png`` to ``--out``. Each returns a process exit code.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.predict.evaluate import (best_f1_threshold, build_dataset, evaluate, gate, jsonable, markdown_table,
                                      metrics, time_split)
from kvstore.predict.features import momentum_prob
from kvstore.predict.forecast_eval import evaluate_forecasts
from kvstore.predict.forecast_eval import markdown as forecast_markdown
from kvstore.predict.model import BurstModel
from kvstore.predict.trace import ROUTERS, load_trace
from kvstore.predict.types import PredictorConfig


def _depths(text: str) -> tuple[int, ...]:
    try:
        out = tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"depths must be comma-separated integers, got {text!r}") from None
    if not out or out[0] < 1:
        raise argparse.ArgumentTypeError("depths must be >= 1")
    return out


def add_common_args(p: argparse.ArgumentParser) -> None:
    """Options shared by train and eval: the simulated cluster, labels and sampling."""
    d = PredictorConfig()
    p.add_argument("--nodes", type=int, default=4, help="simulated nodes (default 4)")
    p.add_argument("--router", choices=ROUTERS, default="round_robin", help="simulated router")
    p.add_argument("--capacity-blocks", type=int, default=16384, help="per-node LRU capacity in blocks")
    p.add_argument("--horizon", type=float, default=d.horizon_s, help="H: label window in seconds")
    p.add_argument("--min-future", type=int, default=d.min_future, help="K: requests needed within H")
    p.add_argument("--depths", type=_depths, default=d.depths, help="tracked depths in blocks, e.g. 1,2,4,8")
    p.add_argument("--momentum-window", type=float, default=d.momentum_window_s, help="W of the momentum rule")
    p.add_argument("--momentum-min", type=int, default=d.momentum_min, help="m of the momentum rule")
    p.add_argument("--sample-every", type=float, default=30.0, help="snapshot period in trace seconds")
    p.add_argument("--max-rows", type=int, default=2000, help="rows per snapshot (random subset)")
    p.add_argument("--threads", type=int, default=1, help="LightGBM threads")
    p.add_argument("--limit", type=int, default=None, help="use only the first N requests")
    p.add_argument("--seed", type=int, default=0)


def config_from_args(args: argparse.Namespace) -> PredictorConfig:
    return replace(PredictorConfig(), depths=args.depths, horizon_s=args.horizon, min_future=args.min_future,
                   momentum_window_s=args.momentum_window, momentum_min=args.momentum_min,
                   num_threads=args.threads)


def trace_name(path: str) -> str:
    return "synth_fanout" if path.startswith("synth") else Path(path).stem


def dataset_for(path: str, cfg: PredictorConfig, args: argparse.Namespace) -> Any:
    """Load a trace and build its labelled dataset with the command's options."""
    reqs = load_trace(path, limit=args.limit, seed=args.seed)
    if not reqs:
        raise ValueError(f"{path}: no requests")
    return build_dataset(reqs, cfg, nodes=args.nodes, router=args.router, capacity_blocks=args.capacity_blocks,
                         sample_every_s=args.sample_every, max_rows=args.max_rows, seed=args.seed)


def json_safe(obj: Any) -> Any:
    """JSON-safe copy (NaN -> null, numpy -> Python)."""
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    if isinstance(obj, (np.floating, float)):
        return None if math.isnan(float(obj)) else float(obj)
    if isinstance(obj, np.integer):
        return int(obj)
    return obj


def write_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(json_safe(obj), indent=2) + "\n")


def plot_pr(results: Sequence[tuple[str, dict[str, Any]]], path: Path) -> None:
    """One PR-curve panel per (trace, label): LightGBM vs momentum on the test part."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [(n, r) for n, r in results if "curves" in r]
    if not ok:
        return
    cols = min(len(ok), 3)
    rows = math.ceil(len(ok) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.8 * rows), squeeze=False)
    for ax, (name, r) in zip(axes.flat, ok):
        for pol, style in (("lightgbm", "-"), ("momentum", "--")):
            p, rc = r["curves"][pol]
            ax.step(np.r_[0.0, rc], np.r_[p[:1], p] if len(p) else [1.0], style, where="post",
                    label=f"{pol} (AP {r[pol]['pr_auc']:.3f})")
        ax.axhline(r["lightgbm"]["positives"] / max(r["lightgbm"]["rows"], 1), color="grey", lw=0.6,
                   label="base rate")
        ax.set_title(f"{name}: y_{r['label']}", fontsize=9)
        ax.set_xlabel("recall")
        ax.set_ylabel("precision")
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1.02)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(ok):]:
        ax.axis("off")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_eval(traces: Sequence[str], cfg: PredictorConfig, args: argparse.Namespace, labels: Sequence[str],
             progress: Any = None) -> list[tuple[str, dict[str, Any]]]:
    """Evaluate every (trace, label): LightGBM vs momentum vs gated on the held-out test part."""
    results: list[tuple[str, dict[str, Any]]] = []
    for path in traces:
        t0 = time.perf_counter()
        ds = dataset_for(path, cfg, args)
        build_s = time.perf_counter() - t0
        for label in labels:
            r = evaluate(ds, cfg, label=label, num_threads=args.threads, seed=args.seed)
            r.pop("model", None)
            r.update({"trace": path, "dataset_rows": len(ds), "build_s": build_s, "meta": ds.meta})
            results.append((trace_name(path), r))
            if progress is not None:
                progress(1)
    return results


def train_main(argv: Sequence[str] | None = None) -> int:
    """``kvctl train``: build the dataset from a trace, train, report validation, write the model."""
    ap = argparse.ArgumentParser(prog="kvctl train", description="Train the burst predictor from a trace.")
    ap.add_argument("--trace", required=True, help="Mooncake jsonl, Azure csv, or 'synth'")
    ap.add_argument("--out", required=True, help="model file to write")
    ap.add_argument("--label", choices=("remote", "reuse"), default="remote", help="target (planner uses remote)")
    ap.add_argument("--valid-frac", type=float, default=0.2, help="last share of time used for early stopping")
    add_common_args(ap)
    args = ap.parse_args(argv)
    cfg = config_from_args(args)
    try:
        ds = dataset_for(args.trace, cfg, args)
    except (OSError, ValueError, KeyError) as exc:
        print(f"kvctl train: {exc}", file=sys.stderr)
        return 2
    tr, va, _ = time_split(ds, cfg.horizon_s, (1.0 - args.valid_frac, args.valid_frac))
    y = ds.label(args.label)
    if tr.size == 0 or y[tr].min() == y[tr].max():
        print("kvctl train: not enough labelled rows (or a single class) in the trace", file=sys.stderr)
        return 1
    model = BurstModel(ds.names, num_threads=args.threads, seed=args.seed)
    model.train(ds.X[tr], y[tr], valid=(ds.X[va], y[va]) if va.size else None, label=args.label,
                trace=args.trace, config=asdict(cfg))
    mom = momentum_prob(ds.momentum, cfg.momentum_min)
    p_va = model.predict(ds.X[va])
    res = {"label": args.label, "lightgbm": metrics(y[va], p_va, cfg.threshold, best_f1_threshold(y[va], p_va)),
           "momentum": metrics(y[va], mom[va], cfg.threshold, best_f1_threshold(y[va], mom[va]))}
    choice = gate(res["lightgbm"]["pr_auc"], res["momentum"]["pr_auc"], cfg.gate_margin)
    res["gated"] = {**res[choice], "choice": choice}
    if va.size:
        model.operating_threshold = best_f1_threshold(y[va], p_va)
    model.save(args.out)
    print(f"trained on {tr.size} rows ({int(y[tr].sum())} positive), validated on {va.size}; "
          f"{model.meta['best_iteration']} trees, operating point {model.operating_threshold:.3f} "
          f"(served as 0.5) -> {args.out}")
    print(markdown_table([(trace_name(args.trace) + " (valid)", res)]))
    write_json(Path(str(args.out) + ".metrics.json"),
               {"trace": args.trace, "config": asdict(cfg), "meta": ds.meta, "train_rows": int(tr.size),
                "valid": res, "model": model.meta, "importance": model.feature_importance()})
    return 0


def eval_main(argv: Sequence[str] | None = None) -> int:
    """``kvctl eval-predictor``: time-ordered split, LightGBM vs momentum vs gated; table, JSON, PNG."""
    ap = argparse.ArgumentParser(prog="kvctl eval-predictor", description="Evaluate the burst predictor.")
    ap.add_argument("--trace", action="append", required=True, help="trace file (repeatable) or 'synth'")
    ap.add_argument("--out", default=None, help="directory for eval.json, eval.md, pr_curves.png")
    ap.add_argument("--labels", default="remote,reuse", help="labels to evaluate: remote, reuse")
    ap.add_argument("--forecast-horizon", type=float, default=10.0,
                    help="T of the rate-forecast table: forecast the next T seconds (default 10)")
    ap.add_argument("--forecast-bucket", type=float, default=10.0, help="seconds between forecasts (default 10)")
    add_common_args(ap)
    args = ap.parse_args(argv)
    labels = [x.strip() for x in args.labels.split(",") if x.strip()]
    if not labels or any(x not in ("remote", "reuse") for x in labels):
        print("kvctl eval-predictor: --labels takes remote and/or reuse", file=sys.stderr)
        return 2
    cfg = config_from_args(args)
    try:
        results = run_eval(args.trace, cfg, args, labels)
    except (OSError, ValueError, KeyError) as exc:
        print(f"kvctl eval-predictor: {exc}", file=sys.stderr)
        return 2
    forecasts = [(trace_name(path), evaluate_forecasts(load_trace(path, limit=args.limit, seed=args.seed),
                                                       max_depth=max(cfg.depths), bucket_s=args.forecast_bucket,
                                                       horizon_s=args.forecast_horizon))
                 for path in args.trace]
    table = markdown_table(results)
    rates = forecast_markdown(forecasts)
    print("Classification: P(requested on a node lacking it within H), time-held-out\n")
    print(table)
    print(f"\nRate forecasts (next {args.forecast_horizon:g} s, held-out last 40 % of each trace)\n")
    print(rates)
    if args.out:
        out = Path(args.out)
        write_json(out / "eval.json", {"config": asdict(cfg), "results": [{"name": n, **jsonable(r)}
                                                                          for n, r in results],
                                       "forecasts": [{"name": n, **r} for n, r in forecasts]})
        (out / "eval.md").write_text(table + "\n\n" + rates + "\n")
        plot_pr(results, out / "pr_curves.png")
        print(f"wrote {out / 'eval.json'}, {out / 'eval.md'}, {out / 'pr_curves.png'}")
    return 0
