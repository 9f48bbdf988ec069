"""Burst predictor benchmark: speed of the feature store and the model, and offline accuracy.

Speed (synthetic stream, ~100k tracked prefixes at depths 1, 2, 4, 8):

* feature update: microseconds per request (all depths together), queueing
  plus the amortised vectorised fold, with a directory stub for holders;
* snapshot: milliseconds for every tracked row, and of it the copy of the rows
  (``take``: what the coordinator's loop runs) and the features computed from
  it (its worker thread); momentum scores likewise;
* model inference: microseconds per prefix for one batch of all rows;
* ``Predictor.score``: one full scoring pass;
* ``Predictor.score_async`` as the coordinator runs it, 2,000 new requests a
  tick: its longest stretch on the event loop and its total there.

Accuracy: the time-ordered evaluation (train / validation / test) of
LightGBM, the momentum rule and the gated policy on every trace given
(Mooncake conversation with two routers, Azure code with synthesised
prefixes, the synthetic fan-out trace), a momentum-window sensitivity check,
and an online replay of the conversation trace through :class:`Predictor`
(labels from its own log, retraining in its worker thread).

    python bench/predictor.py [--out kvstore-out/bench] [--threads 1]

Writes ``predictor.json``, ``predictor.md`` and ``predictor.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvstore.training.cli import eval_main, json_safe  # noqa: E402
from kvstore.training.evaluate import build_dataset, evaluate  # noqa: E402
from kvstore.predict.features import FeatureStore  # noqa: E402
from kvstore.predict.model import DEFAULT_MODEL_PATH, BurstModel  # noqa: E402
from kvstore.predict.online import Predictor  # noqa: E402
from kvstore.training.trace import Simulator  # noqa: E402
from kvstore.workloads.traces import load_mooncake  # noqa: E402
from kvstore.predict.types import Access, Outcome, PredictorConfig  # noqa: E402

DATA = ROOT / "kvstore" / "workloads" / "data"  # the traces kvstore ships


def synthetic_accesses(chains: int, n: int, seed: int = 0) -> list[Access]:
    """``n`` requests over ``chains`` 8-block chains (block 0 shared), 8 nodes, Zipf-ish reuse."""
    rng = random.Random(seed)
    z = (0).to_bytes(8, "little")
    pool = [(z,) + tuple(rng.getrandbits(64).to_bytes(8, "little") for _ in range(7)) for _ in range(chains)]
    out = []
    for i in range(n):
        j = i if i < chains else int(chains * rng.random() ** 2)
        out.append(Access(t=i * 0.0005, namespace="bench", node=f"n{i % 8}", keys=pool[j], outcome=Outcome.MISS,
                          block_tokens=512, page_bytes=1 << 20, total_blocks=12, local_blocks=1))
    return out


def bench_speed(model: BurstModel, threads: int) -> dict[str, Any]:
    """Feature update, snapshot, momentum, inference and score timings at ~100k tracked prefixes."""
    cfg = PredictorConfig(num_threads=threads)
    chains = 34_000                        # 1 + 3 * 34k = ~102k rows at depths 1, 2, 4, 8
    accs = synthetic_accesses(chains, chains + 200_000)
    fs = FeatureStore(cfg, lambda ns, key: 1)
    res: dict[str, Any] = {}
    t0 = time.perf_counter()
    for a in tqdm(accs[:chains], desc="features: new prefixes", leave=False):
        fs.observe(a)
    fs.snapshot(accs[chains - 1].t)
    res["update_us_new_prefixes"] = (time.perf_counter() - t0) / chains * 1e6
    t0 = time.perf_counter()
    for a in tqdm(accs[chains:], desc="features: steady state", leave=False):
        fs.observe(a)
    len(fs)  # fold what is queued
    res["update_us_per_request"] = (time.perf_counter() - t0) / (len(accs) - chains) * 1e6
    res["tracked_prefixes"] = len(fs)
    res["state_mib"] = fs.nbytes / 2**20
    now = accs[-1].t
    snaps = []
    for _ in range(5):
        t0 = time.perf_counter()
        ids, _, X = fs.snapshot(now)
        snaps.append(time.perf_counter() - t0)
    res["snapshot_ms"] = float(np.median(snaps)) * 1e3
    res["snapshot_rows"] = len(ids)
    # the part of a snapshot on the coordinator's loop (the copy of the rows), and the rest (its worker thread)
    takes, computes = [], []
    for _ in range(5):
        t0 = time.perf_counter()
        taken = fs.take(now)
        t1 = time.perf_counter()
        taken.features()
        takes.append(t1 - t0)
        computes.append(time.perf_counter() - t1)
    res["take_ms"] = float(np.median(takes)) * 1e3
    res["features_ms"] = float(np.median(computes)) * 1e3
    t0 = time.perf_counter()
    fs.momentum_scores(now)
    res["momentum_scores_ms"] = (time.perf_counter() - t0) * 1e3
    runs = []
    for _ in range(3):
        t0 = time.perf_counter()
        model.predict(X, num_threads=threads)
        runs.append(time.perf_counter() - t0)
    res["inference_us_per_prefix"] = float(np.median(runs)) / len(ids) * 1e6
    res["inference_trees"] = int(model.booster.current_iteration()) if model.booster else 0
    p = Predictor(replace(cfg, active_within_s=1e9))
    p.install(model)
    p.fs = fs
    t0 = time.perf_counter()
    s = p.score(now)
    res["score_ms"] = (time.perf_counter() - t0) * 1e3
    res["score_rows"] = len(s)
    # The coordinator's scoring pass on its loop: 2,000 more requests a tick (queued, as observe does),
    # then score_async. Its longest stretch on the loop (the folds of the queue, the row copy, the log)
    # is what a request arriving meanwhile waits; the features and the model run in the worker thread.
    stream = synthetic_accesses(chains, chains + 10 * 2000, seed=1)[chains:]
    longest, on_loop = [], []
    for tick in range(10):
        for a in stream[tick * 2000:(tick + 1) * 2000]:
            p.observe(replace(a, t=now + tick + a.t / 1e3))
        asyncio.run(p.score_async(now + tick + 1.0))
        longest.append(max(p.loop_stretches))
        on_loop.append(sum(p.loop_stretches))
    res["score_async_longest_stretch_ms"] = float(np.median(longest[2:])) * 1e3
    res["score_async_on_loop_ms"] = float(np.median(on_loop[2:])) * 1e3
    return res


def bench_online(path: Path, threads: int) -> dict[str, Any]:
    """Replay the conversation trace through Predictor on trace time: online labels, retraining, gate."""
    cfg = PredictorConfig(num_threads=threads)
    reqs = load_mooncake(path)
    sim = Simulator(nodes=4, router="round_robin", depths=cfg.depths)
    p = Predictor(cfg, holders_count=sim.holders_count)
    t, step = 0.0, 1.0
    score_ms, timeline = [], []
    for r in tqdm(reqs, desc="online replay", leave=False):
        while r.t > t:
            t0 = time.perf_counter()
            s = p.score(t)
            score_ms.append((time.perf_counter() - t0) * 1e3)
            if p.maybe_retrain(t):
                timeline.append({"t": t, "event": "retrain", "labelled_rows": p.labelled_rows})
            if int(t) % 300 == 0:
                st = p.stats()
                timeline.append({"t": t, "source": s.source, "model_version": st["model_version"], **st["online"]})
            t += step
        p.observe(sim.step(r))
    p.wait_retrain(60.0)
    st = p.stats()
    return {"stats": st, "timeline": timeline, "score_ms_p50": float(np.percentile(score_ms, 50)),
            "score_ms_p99": float(np.percentile(score_ms, 99)), "score_ms_max": float(np.max(score_ms))}


def momentum_sensitivity(path: Path) -> list[dict[str, Any]]:
    """PR-AUC on the test part for y_remote when momentum's W (and m) change, LightGBM alongside."""
    reqs = load_mooncake(path)
    rows = []
    for w, m in tqdm([(10.0, 2), (60.0, 2), (300.0, 2), (300.0, 3)], desc="momentum W sweep", leave=False):
        cfg = replace(PredictorConfig(), momentum_window_s=w, momentum_min=m)
        ds = build_dataset(reqs, cfg)
        r = evaluate(ds, cfg, label="remote")
        rows.append({"W": w, "m": m, "momentum_pr_auc": r["momentum"]["pr_auc"],
                     "lightgbm_pr_auc": r["lightgbm"]["pr_auc"], "gated": r["gated"]["choice"]})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "bench" / "out"))
    ap.add_argument("--conversation", default=str(DATA / "mooncake_conversation.jsonl"))
    ap.add_argument("--azure", default=str(DATA / "azure_code_2023.csv"))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--skip-online", action="store_true")
    ap.add_argument("--skip-eval", action="store_true", help="skip the cross-trace evaluation")
    ap.add_argument("--speed-only", action="store_true", help="only the speed runs")
    ap.add_argument("--runs", type=int, default=3, help="speed runs (min / median / max reported)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = PredictorConfig(num_threads=args.threads)
    conv = Path(args.conversation)

    if not args.skip_eval:  # the cross-trace evaluation, exactly as `kvctl eval-predictor` prints it
        eval_main(["--out", str(out / "eval"), "--threads", str(args.threads)])
    # speed with the shipped model (the one the daemon loads), over --runs runs
    model = BurstModel.load(DEFAULT_MODEL_PATH, num_threads=args.threads)
    runs = [bench_speed(model, args.threads) for _ in tqdm(range(args.runs), desc="speed runs")]
    speed = {k: [r[k] for r in runs] for k in runs[0]}
    print(f"\n## Speed ({args.runs} runs: min / median / max)\n")
    speed_md = "\n".join(["| metric | min | median | max |", "|---|---|---|---|"] +
                         [f"| {k} | {min(v):.3f} | {float(np.median(v)):.3f} | {max(v):.3f} |" for k, v in speed.items()])
    print(speed_md)
    if args.speed_only:
        (out / "predictor_speed.json").write_text(json.dumps(json_safe(speed), indent=2) + "\n")
        return 0
    results: list[tuple[str, dict[str, Any]]] = []
    sens = momentum_sensitivity(conv)
    sens_md = "\n".join(["| W (s) | m | momentum PR-AUC | LightGBM PR-AUC | gated |", "|---|---|---|---|---|"] +
                        [f"| {r['W']:g} | {r['m']} | {r['momentum_pr_auc']:.3f} | {r['lightgbm_pr_auc']:.3f} | "
                         f"{r['gated']} |" for r in sens])
    print("\n## Momentum window sensitivity (conversation, y_remote)\n")
    print(sens_md)
    onl: dict[str, Any] = {}
    onl_md = ""
    if not args.skip_online:
        onl = bench_online(conv, args.threads)
        o = onl["stats"]["online"]
        onl_md = (f"retrains {onl['stats']['retrains']}, final source {onl['stats']['source']}, labelled rows "
                  f"{onl['stats']['labelled_rows']}; last window: PR-AUC model {o.get('pr_auc_model', float('nan')):.3f}"
                  f" vs momentum {o.get('pr_auc_momentum', float('nan')):.3f} over {o.get('rows', 0)} rows; "
                  f"score p50 {onl['score_ms_p50']:.2f} ms, p99 {onl['score_ms_p99']:.2f} ms")
        print("\n## Online replay (conversation, round-robin)\n")
        print(onl_md)
        for row in onl["timeline"]:
            if "pr_auc_model" in row:
                print(f"  t={row['t']:6.0f}s source={row['source']:8s} v{row['model_version']} "
                      f"model {row['pr_auc_model']:.3f} momentum {row['pr_auc_momentum']:.3f} ({row['rows']} rows)")
    doc = {"host": {"python": platform.python_version(), "machine": platform.machine()},
           "config": asdict(cfg), "speed": speed, "evaluation": [{"name": n, **{k: v for k, v in r.items()
                                                                              if k != "curves"}} for n, r in results],
           "momentum_sensitivity": sens, "online": onl}
    (out / "predictor.json").write_text(json.dumps(json_safe(doc), indent=2) + "\n")
    (out / "predictor.md").write_text("# Burst predictor benchmark\n\n(offline evaluation: eval/eval.md)" +
                                      "\n\n## Speed\n\n" + speed_md + "\n\n## Momentum window sensitivity\n\n" +
                                      sens_md + ("\n\n## Online replay\n\n" + onl_md if onl_md else "") + "\n")
    print(f"\nwrote {out / 'predictor.json'}, {out / 'predictor.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
