"""``kvctl train`` and ``kvctl eval-predictor``: offline training and evaluation from traces.

    kvctl train --out MODEL [--source NAME ...] [--trace FILE ...] [--nodes N --horizon S ...]
    kvctl eval-predictor [--source NAME ...] [--trace FILE ...] [--out DIR] [--model MODEL] [...]

Both work on the cross-trace suite (:mod:`kvstore.training.suite`): every
source by default (the conversation and Azure traces, ``synth`` and every
workload shape), ``--source`` picks some, ``--trace`` adds a Mooncake jsonl or
Azure csv as a window source. ``train`` writes the model and
``MODEL.metrics.json``; ``eval-predictor`` prints the classification table
(one model over all sources, plus models that never saw a held-out family)
and the rate-forecast table, and writes ``eval.json``, ``eval.md`` and
``pr_curves.png`` to ``--out``. Each returns a process exit code.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.training.evaluate import jsonable, markdown_table
from kvstore.training.forecast_eval import evaluate_forecasts
from kvstore.training.forecast_eval import markdown as forecast_markdown
from kvstore.predict.model import BurstModel
from kvstore.training.suite import (EVAL_SEEDS, RECENCY_TAU_S, TRAIN_FROM_S, TRAIN_SEEDS, VALID_SEED, Parts, Source,
                                   build_parts, default_sources, evaluate_suite, fit, score_part)
from kvstore.training.trace import ROUTERS
from kvstore.workloads import resolve_path
from kvstore.workloads.traces import cut_window, load_trace
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
    """Options shared by train and eval: sources, the simulated cluster, labels and sampling."""
    d = PredictorConfig()
    p.add_argument("--source", action="append", default=None,
                   help="suite source (repeatable; default all): conversation, azure_code, synth, or a shape")
    p.add_argument("--trace", action="append", default=None,
                   help="also a trace as a window source (a Mooncake jsonl or Azure csv file, or a shipped trace by "
                   "name: conversation), repeatable")
    p.add_argument("--start", type=float, default=0.0,
                   help="of each --trace, only requests from this trace second on (times rebased to 0)")
    p.add_argument("--window", type=float, default=None,
                   help="of each --trace, only this many trace seconds from --start: train on one half of a trace "
                   "and replay the other with the model (kvctl replay --start/--window)")
    p.add_argument("--nodes", type=int, default=4, help="simulated nodes (default 4)")
    p.add_argument("--router", choices=ROUTERS, default=None, help="simulated router for every source "
                   "(default: round_robin for traces, cache_aware for shapes)")
    p.add_argument("--capacity-blocks", type=int, default=16384, help="per-node LRU capacity in blocks")
    p.add_argument("--horizon", type=float, default=d.horizon_s, help="H: label window in seconds")
    p.add_argument("--min-future", type=int, default=d.min_future, help="K: requests needed within H")
    p.add_argument("--depths", type=_depths, default=d.depths, help="tracked depths in blocks, e.g. 1,2,4,8")
    p.add_argument("--momentum-window", type=float, default=d.momentum_window_s, help="W of the momentum rule")
    p.add_argument("--momentum-min", type=int, default=d.momentum_min, help="m of the momentum rule")
    p.add_argument("--sample-every", type=float, default=None, help="snapshot period in trace seconds "
                   "(default per source: 30 s traces, 2 s shapes)")
    p.add_argument("--max-rows", type=int, default=None, help="rows per snapshot (random subset)")
    p.add_argument("--train-seeds", type=_depths, default=TRAIN_SEEDS, help="generator seeds trained on")
    p.add_argument("--valid-seed", type=int, default=VALID_SEED, help="generator seed validated on")
    p.add_argument("--eval-seeds", type=_seeds, default=EVAL_SEEDS, help="generator seeds tested on")
    p.add_argument("--train-from", type=float, default=None,
                   help=f"trace seconds of a window source never trained on (default: {TRAIN_FROM_S:g}, the replay's "
                   "window + H, for the shipped traces; 0 for a --trace file)")
    p.add_argument("--recency-tau", type=float, default=RECENCY_TAU_S,
                   help="recency weighting of a trace's training rows: exp((t - t_last) / tau)")
    p.add_argument("--threads", type=int, default=1, help="LightGBM threads")
    p.add_argument("--limit", type=int, default=None, help="use only the first N requests of a --trace file")
    p.add_argument("--seed", type=int, default=0, help="model and row-sampling seed")


def _seeds(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"seeds must be comma-separated integers, got {text!r}") from None


def config_from_args(args: argparse.Namespace) -> PredictorConfig:
    return replace(PredictorConfig(), depths=args.depths, horizon_s=args.horizon, min_future=args.min_future,
                   momentum_window_s=args.momentum_window, momentum_min=args.momentum_min,
                   num_threads=args.threads)


def trace_name(path: str) -> str:
    return "synth_fanout" if path.startswith("synth") else Path(path).stem


def sources_from_args(args: argparse.Namespace, cfg: PredictorConfig | None = None) -> list[Source]:
    """The suite's sources named by ``--source`` (all when neither it nor ``--trace`` is given) plus
    ``--trace`` files, with the command's overrides of router and sampling. A trace file is read here:
    one too short to label raises ``ValueError``, and its snapshots come often enough for each part of
    its split to hold several (:func:`trace_sampling`)."""
    horizon = (cfg or PredictorConfig()).horizon_s
    out = default_sources(args.source) if args.source or not args.trace else []
    for path in args.trace or []:
        if path.startswith("synth"):
            out += default_sources(["synth"])
            continue
        reqs = load_trace(resolve_path(path), limit=args.limit, seed=0)
        if args.start or args.window is not None:
            reqs = cut_window(reqs, args.start, args.window)
        out.append(Source(trace_name(path), lambda seed, r=reqs: r, "window", family=trace_name(path),
                          sample_every_s=trace_sampling(path, reqs, horizon), train_from_s=0.0))
    over: dict[str, Any] = {}
    if args.router:
        over["router"] = args.router
    if args.sample_every:
        over["sample_every_s"] = args.sample_every
    if args.max_rows:
        over["max_rows"] = args.max_rows
    return [replace(s, **over) for s in out]


def trace_sampling(path: str, reqs: Sequence[Any], horizon_s: float, default_s: float = 30.0) -> float:
    """Seconds between snapshots of a user's trace: the suite's 30 s, or less where the trace is short, so
    the validation part (a fifth of the time left after the label horizon and the two gaps of ``H`` its
    split needs) holds at least five snapshots. Raises ``ValueError`` when no time is left."""
    span = (reqs[-1].t - reqs[0].t) if reqs else 0.0
    usable = span - 3 * horizon_s
    if usable <= 0:
        raise ValueError(f"{path}: {len(reqs)} requests over {span:.0f} s; labelling looks {horizon_s:g} s ahead "
                         f"(--horizon) and the train, validation and test parts need {horizon_s:g} s between them, "
                         f"so a trace must span over {3 * horizon_s:g} s: pass a smaller --horizon")
    return min(default_s, max(1.0, 0.2 * usable / 5))


def parts_from_args(args: argparse.Namespace, cfg: PredictorConfig) -> list[Parts]:
    """Build every source's train / validation / test rows with the command's options."""
    parts = []
    for src in sources_from_args(args, cfg):
        p = build_parts(src, cfg, nodes=args.nodes, capacity_blocks=args.capacity_blocks,
                        train_seeds=args.train_seeds, valid_seed=args.valid_seed, eval_seeds=args.eval_seeds,
                        train_from_s=args.train_from)
        if not len(p.train) or not len(p.test):
            raise ValueError(f"{src.name}: no labelled rows to train or test on ({len(p.train)} train, "
                             f"{len(p.test)} test rows; try a smaller --horizon or --sample-every)")
        parts.append(p)
    return parts


def seeds_note(args: argparse.Namespace) -> str:
    return (f"generators trained on seeds {','.join(map(str, args.train_seeds))}, validated on seed "
            f"{args.valid_seed}, tested on seeds {','.join(map(str, args.eval_seeds))}; traces: train the first "
            f"60 % of time (from {_train_from(args)}), validate the next 20 %, test the last 20 % (a trace too short "
            "for the gaps of H these leave: the same shares of the time left after them)")


def _train_from(args: argparse.Namespace) -> str:
    if args.train_from is not None:
        return f"{args.train_from:g} s"
    return f"{TRAIN_FROM_S:g} s of the shipped traces, 0 s of a --trace file"


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


def run_eval(parts: Sequence[Parts], cfg: PredictorConfig, args: argparse.Namespace, labels: Sequence[str],
             holdout: Sequence[str] = ("conversation",), model_path: str | None = None
             ) -> list[tuple[str, dict[str, Any]]]:
    """Every (source, label): one cross-trace LightGBM model vs momentum vs gated on the held-out parts.

    With ``model_path`` the saved model is scored instead (remote label; no
    "never seen" rows, since its training sources are fixed).
    """
    results: list[tuple[str, dict[str, Any]]] = []
    for label in labels:
        if model_path is not None:
            model = BurstModel.load(model_path, feature_names=parts[0].train.names)
            res = [(p.source.name, score_part(model, p, cfg, label)) for p in parts]
        else:
            _, res = evaluate_suite(parts, cfg, label, num_threads=args.threads, seed=args.seed, holdout=holdout,
                                    recency_tau_s=args.recency_tau)
        for name, r in res:
            r["label"] = label
            results.append((name, r))
    return results


TRAIN_DESCRIPTION = ("Train the burst predictor across traces and workload shapes (the model kvstored loads with "
                     "--predictor-model).")
EVAL_DESCRIPTION = "Evaluate the burst predictor."


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    """Add ``kvctl train``'s options to ``p``."""
    p.add_argument("--out", required=True, help="model file to write")
    p.add_argument("--label", choices=("remote", "reuse"), default="remote", help="target (planner uses remote)")
    add_common_args(p)


def train_main(argv: Sequence[str] | None = None) -> int:
    """``kvctl train`` on an argument list (tests and scripts; kvctl itself calls :func:`run_train`)."""
    ap = argparse.ArgumentParser(prog="kvctl train", description=TRAIN_DESCRIPTION)
    add_train_arguments(ap)
    return run_train(ap.parse_args(argv))


def run_train(args: argparse.Namespace) -> int:
    """``kvctl train``: one model over the suite's training parts; writes it and ``MODEL.metrics.json``."""
    cfg = config_from_args(args)
    try:
        parts = parts_from_args(args, cfg)
    except (OSError, ValueError, KeyError) as exc:
        print(f"kvctl train: {exc}", file=sys.stderr)
        return 2
    model = fit(parts, cfg, args.label, args.threads, args.seed, args.recency_tau, config=asdict(cfg),
                train_seeds=list(args.train_seeds), valid_seed=args.valid_seed,
                train_from_s=TRAIN_FROM_S if args.train_from is None else args.train_from)  # of the shipped traces
    model.save(args.out)
    res = [(p.source.name, score_part(model, p, cfg, args.label)["valid"]) for p in parts]
    print(f"trained on {model.meta['rows']} rows ({model.meta['positives']} positive) of "
          f"{', '.join(p.source.name for p in parts)}; {model.meta['best_iteration']} trees, operating point "
          f"{model.operating_threshold:.3f} (served as 0.5), gate {'lightgbm' if model.meta['gate_ok'] else 'momentum'}"
          f" -> {args.out}\n{seeds_note(args)}\n")
    print("| source (validation part) | LightGBM PR-AUC | momentum PR-AUC | rows |\n|---|---|---|---|")
    for n, v in res:
        print(f"| {n} | {v['lightgbm']:.3f} | {v['momentum']:.3f} | {v['rows']} |")
    write_json(Path(str(args.out) + ".metrics.json"),
               {"config": asdict(cfg), "model": {k: v for k, v in model.meta.items() if k != "valid_gain_curve"},
                "valid": [{"name": n, **v} for n, v in res], "importance": model.feature_importance()})
    return 0


def add_eval_predictor_arguments(p: argparse.ArgumentParser) -> None:
    """Add ``kvctl eval-predictor``'s options to ``p``."""
    p.add_argument("--out", default=None, help="directory for eval.json, eval.md, pr_curves.png")
    p.add_argument("--labels", default="remote,reuse", help="labels to evaluate: remote, reuse")
    p.add_argument("--holdout", default="conversation",
                   help="source families also scored by a model trained without them ('' = none)")
    p.add_argument("--model", default=None, help="score this saved model instead of training one")
    p.add_argument("--forecast-horizon", type=float, default=10.0,
                   help="T of the rate-forecast table: forecast the next T seconds (default 10)")
    p.add_argument("--forecast-bucket", type=float, default=10.0, help="seconds between forecasts (default 10)")
    add_common_args(p)


def eval_main(argv: Sequence[str] | None = None) -> int:
    """``kvctl eval-predictor`` on an argument list (tests and scripts; kvctl itself calls
    :func:`run_eval_predictor`)."""
    ap = argparse.ArgumentParser(prog="kvctl eval-predictor", description=EVAL_DESCRIPTION)
    add_eval_predictor_arguments(ap)
    return run_eval_predictor(ap.parse_args(argv))


def run_eval_predictor(args: argparse.Namespace) -> int:
    """``kvctl eval-predictor``: cross-trace model vs momentum vs gated (held out), and the rate forecasts."""
    labels = [x.strip() for x in args.labels.split(",") if x.strip()]
    if not labels or any(x not in ("remote", "reuse") for x in labels):
        print("kvctl eval-predictor: --labels takes remote and/or reuse", file=sys.stderr)
        return 2
    cfg = config_from_args(args)
    try:
        parts = parts_from_args(args, cfg)
        results = run_eval(parts, cfg, args, labels, [h for h in args.holdout.split(",") if h], args.model)
    except (OSError, ValueError, KeyError) as exc:
        print(f"kvctl eval-predictor: {exc}", file=sys.stderr)
        return 2
    forecasts = [(p.source.name, evaluate_forecasts(p.source.load(args.eval_seeds[0]), max_depth=max(cfg.depths),
                                                    bucket_s=args.forecast_bucket, horizon_s=args.forecast_horizon))
                 for p in parts]
    table = markdown_table(results)
    rates = forecast_markdown(forecasts)
    print("Classification: P(requested on a node lacking it within H), held out; one LightGBM model over all "
          f"sources ({seeds_note(args)})\n")
    print(table)
    print(f"\nRate forecasts (next {args.forecast_horizon:g} s, held-out last 40 % of each trace; generators: "
          f"seed {args.eval_seeds[0]})\n")
    print(rates)
    if args.out:
        out = Path(args.out)
        write_json(out / "eval.json", {"config": asdict(cfg), "protocol": seeds_note(args),
                                       "results": [{"name": n, **jsonable(r)} for n, r in results],
                                       "forecasts": [{"name": n, **r} for n, r in forecasts]})
        (out / "eval.md").write_text(table + "\n\n" + rates + "\n")
        plot_pr(results, out / "pr_curves.png")
        print(f"wrote {out / 'eval.json'}, {out / 'eval.md'}, {out / 'pr_curves.png'}")
    return 0
