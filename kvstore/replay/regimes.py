"""The regime map: where prediction pays, where it costs, over a grid of fan-out workloads and clusters.

``kvctl replay --regimes`` runs the synthetic fan-out workload (``--trace synth``: bursts of requests on
a fresh shared context) over a grid of five axes, each cell one ordinary replay (simulated with
``--sim``, real daemons without) of every policy under every router the other flags name:

* ``context``: the shared context's tokens (``--synth-prefix-tokens``);
* ``link``: the link preset (``--link``);
* ``nodes``: the cluster's size (``--nodes``);
* ``burst``: requests per burst (``--synth-requests``);
* ``window``: seconds a burst's requests span (``--synth-window``).

``--regimes-axis NAME=V1,V2`` replaces an axis's values (thinning the grid, or one cell). Each cell is
written to ``DIR/cells/<id>/`` as soon as it ends, and a cell already there is not run again, so an
interrupted map resumes where it stopped. Every cell runs ``--regimes-seeds`` seeds (3): one seed says
neither which side of 1.0 a cell is on nor how far (a cell at 0.69x on one seed was 0.92x over three), and
a cell is judged on the median of its seeds. The map is ``DIR/regimes.json``, ``DIR/regimes.md``
(a table per link) and ``DIR/regimes.png`` (per link, two heatmaps: best predictive / best baseline and
oracle / best baseline).

What a cell reports (:func:`cell_summary`): the best baseline (the lowest median p99 TTFT of ``none``,
``reactive`` and ``reactive+claims`` under every router), the best predictive configuration
(``predictive`` or ``predictive+claims``, the lowest median ratio to it), the oracle's ratio, and the
best p99 of each policy. The targets (:func:`misses`): best predictive <= 1.0x in every cell, and <= 0.6x
wherever the oracle is <= 0.5x.

**At load** (``--regimes --search capacity``, simulated): each cell instead searches every configuration's
capacity (kvstore/replay/capacity.py: the highest rate scale at which ``--slo-attainment`` of the requests
meet the SLO), then runs one replay of every configuration at each share of ``--regimes-loads`` (0.5, 0.8
and 1.0) of ``engine-only``'s capacity in that cell: the load axis. A cell then reports (:func:`capacity_cell`)
the best predictive configuration's capacity, the oracle's and the bound's as ratios to the best
baseline's, and at each load the p99 TTFT and attainment of the best baseline and the best predictive
configuration. The targets at load (:func:`capacity_misses`): best predictive >= 1.0x the best baseline's
capacity in every cell (prediction never costs capacity), and >= 1.15x wherever the oracle's is >= 1.3x.

The grid logic here is pure (cells, ids, summaries, tables); :func:`run_map` runs the cells.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvstore.replay.claiming import split_policy
from kvstore.replay.sweep import spread

# axis name -> (ReplayConfig field, the grid values)
AXES: dict[str, tuple[str, tuple[Any, ...]]] = {
    "context": ("synth_prefix_tokens", (4096, 8192, 16384, 32768, 65536)),
    "link": ("link", ("eth-100g", "rdma-400g", "rdma-8x400g")),
    "nodes": ("nodes", (4, 8, 16)),
    "burst": ("synth_requests", (16, 48, 128)),
    "window": ("synth_window", (2.0, 5.0, 10.0)),
}
ORDER = ("link", "nodes", "burst", "window", "context")  # cell ids and table rows; context: the columns
POLICIES = "none,reactive,reactive+claims,predictive,predictive+claims,oracle"
ROUTERS = "round-robin,least-load,cache-aware"
SEEDS = 3
ORACLE_PAYS = 0.5   # where the oracle is at or under this ratio, best predictive must be at or under ...
PREDICTIVE_MUST = 0.6
LOADS = (0.5, 0.8, 1.0)  # at load: each cell's replays at these shares of engine-only's capacity there
CAPACITY_ORACLE_PAYS = 1.3  # at load: where the oracle's capacity is at least this ratio, best predictive's ...
CAPACITY_MUST = 1.15        # ... must be at least this one (and at least 1.0 everywhere)


# ---- the grid (pure) -------------------------------------------------------------------
def parse_axes(specs: Iterable[str]) -> dict[str, tuple[Any, ...]]:
    """The grid: every axis at its default values, but those ``NAME=V1,V2`` replaces."""
    grid = {name: values for name, (_, values) in AXES.items()}
    for spec in specs:
        name, sep, text = spec.partition("=")
        name = name.strip()
        if not sep or name not in AXES:
            raise ValueError(f"--regimes-axis {spec!r}: expected NAME=V1,V2 with NAME one of {', '.join(AXES)}")
        kind = type(AXES[name][1][0])
        try:
            values = tuple(kind(v.strip()) for v in text.split(",") if v.strip())
        except ValueError:
            raise ValueError(f"--regimes-axis {spec!r}: values of {name} are {kind.__name__}s") from None
        if not values:
            raise ValueError(f"--regimes-axis {spec!r}: no values")
        grid[name] = values
    return grid


def cells(grid: dict[str, Sequence[Any]]) -> list[dict[str, Any]]:
    """Every combination of the grid's values, in :data:`ORDER`."""
    return [dict(zip(ORDER, combo)) for combo in itertools.product(*(grid[a] for a in ORDER))]


def cell_id(cell: dict[str, Any]) -> str:
    """``eth-100g_n4_b16_w2_c4096``: a folder name that says the cell."""
    return (f"{cell['link']}_n{cell['nodes']}_b{cell['burst']}_w{cell['window']:g}_c{cell['context']}")


def rows_of(grid: dict[str, Sequence[Any]]) -> list[tuple[Any, Any, Any]]:
    """The (nodes, burst, window) rows of the map's tables and heatmaps; context is their columns."""
    return list(itertools.product(grid["nodes"], grid["burst"], grid["window"]))


def at(by_id: dict[str, dict[str, Any]], link: str, row: tuple[Any, Any, Any], context: int) -> dict[str, Any]:
    """The summary of the cell at (``link``, ``row``, ``context``) in ``by_id``; empty when it did not run."""
    nodes, burst, window = row
    return by_id.get(cell_id({"link": link, "nodes": nodes, "burst": burst, "window": window,
                              "context": context}), {})


def overrides(cell: dict[str, Any]) -> dict[str, Any]:
    """The ReplayConfig fields one cell sets."""
    return {AXES[a][0]: v for a, v in cell.items()}


# ---- a cell's result (pure) ----------------------------------------------------------------
def cell_summary(workload: dict[str, Any]) -> dict[str, Any]:
    """What the map keeps of one cell's ``results.json`` workload entry (see the module doc)."""
    runs: dict[str, list[dict[str, Any]]] = workload.get("runs", {})
    p99 = {k: spread([s["ttft_p99_s"] for s in v]) for k, v in runs.items() if v}
    best_by_policy: dict[str, dict[str, Any]] = {}
    for k, s in p99.items():
        policy = k.split("|")[0]
        if policy not in best_by_policy or s["median"] < best_by_policy[policy]["p99"]:
            best_by_policy[policy] = {"config": k, "p99": s["median"], "min": s["min"], "max": s["max"]}
    out: dict[str, Any] = {"by_policy": best_by_policy, "seeds": max((s["n"] for s in p99.values()), default=0)}
    base = workload.get("best_baseline") or {}
    if not base:
        return out
    out["best_baseline"] = {"config": base["config"], "p99": base["ttft_p99_s"]["median"],
                            **_attainment(runs.get(base["config"], []))}
    best_pred: tuple[float, str, dict[str, Any]] | None = None
    for k, r in workload.get("vs_best", {}).items():
        policy = k.split("|")[0]
        ratio = r["ttft_p99_s"]
        if split_policy(policy)[0] == "predictive" and (best_pred is None or ratio["median"] < best_pred[0]):
            best_pred = (ratio["median"], k, ratio)
        if policy == "oracle":
            out["oracle"] = {"ratio": ratio["median"], "min": ratio["min"], "max": ratio["max"]}
    if best_pred is not None:
        _, k, ratio = best_pred
        out["predictive"] = {"config": k, "ratio": ratio["median"], "min": ratio["min"], "max": ratio["max"],
                             **_attainment(runs.get(k, []))}
    return out


def _attainment(runs: Sequence[dict[str, Any]]) -> dict[str, float]:
    """``{"attainment": median share of requests within the SLO}`` over a configuration's seeds; empty where
    the runs do not say."""
    got = [r["slo_attainment"] for r in runs if "slo_attainment" in r]
    return {"attainment": spread(got)["median"]} if got else {}


def capacity_cell(cap: dict[str, Any]) -> dict[str, Any]:
    """What the map at load keeps of a cell's capacity search (:func:`kvstore.replay.capacity.summarize`'s
    output): engine-only's and the best baseline's capacity (median rate scale), and the best predictive
    configuration's, the oracle's and the bound's capacity as ratios to the best baseline's (median of the
    per-seed ratios, with their range)."""
    configs: dict[str, dict[str, Any]] = cap.get("configs", {})
    out: dict[str, Any] = {}
    for name, label in (("engine_only", cap.get("reference")), ("best_baseline", cap.get("best_baseline"))):
        if label is not None:
            out[name] = {"config": label, "rate_scale": configs[label]["rate_scale"]["median"]}
    for name, wanted in (("predictive", "predictive"), ("oracle", "oracle"), ("bound", "bound")):
        best: tuple[float, str, dict[str, float]] | None = None
        for label, c in configs.items():
            ratio = c.get("vs_best_baseline")
            if ratio is None or split_policy(label.split("|")[0])[0] != wanted:
                continue
            if best is None or ratio["median"] > best[0]:
                best = (ratio["median"], label, ratio)
        if best is not None:
            out[name] = {"config": best[1], "ratio": best[2]["median"], "min": best[2]["min"], "max": best[2]["max"]}
    return out


def misses(rows: Sequence[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The cells that miss a target: best predictive over 1.0x the best baseline (``over``); the oracle at
    or under 0.5x and best predictive over 0.6x (``short``)."""
    over, short = [], []
    for row in rows:
        pred, oracle = row.get("predictive"), row.get("oracle")
        if pred is None:
            continue
        if pred["ratio"] > 1.0:
            over.append(row)
        if oracle is not None and oracle["ratio"] <= ORACLE_PAYS and pred["ratio"] > PREDICTIVE_MUST:
            short.append(row)
    return {"over": over, "short": short}


def table(rows: Sequence[dict[str, Any]], grid: dict[str, Sequence[Any]]) -> str:
    """A Markdown table per link: a row per (nodes, burst, window), a column per context length, each
    cell ``best predictive / best baseline`` (and the oracle's ratio), bold where predictive is over 1.0x."""
    by = {cell_id(r["cell"]): r for r in rows}
    out: list[str] = []
    for link in grid["link"]:
        out += [f"### {link}", "",
                "Each cell: best predictive / best baseline (oracle / best baseline), p99 TTFT, median over "
                "its seeds; **bold**: predictive over 1.0x; `*`: 3 seeds.", "",
                *_grid_table(by, grid, link, _cell_text), ""]
    return "\n".join(out)


def _grid_table(by: dict[str, dict[str, Any]], grid: dict[str, Sequence[Any]], link: str,
                text: Callable[[dict[str, Any]], str]) -> list[str]:
    """The Markdown lines of one link's table: a row per (nodes, burst, window), a column per context,
    each cell ``text`` of that cell's row of the map."""
    lines = ["| nodes | burst | window s | " + " | ".join(f"{c // 1024}k" for c in grid["context"]) + " |",
             "|---|---|---|" + "---|" * len(grid["context"])]
    for row in rows_of(grid):
        texts = [text(at(by, link, row, context)) for context in grid["context"]]
        lines.append(f"| {row[0]} | {row[1]} | {row[2]:g} | " + " | ".join(texts) + " |")
    return lines


def _cell_text(row: dict[str, Any]) -> str:
    if "predictive" not in row:
        return "-"
    pred = row["predictive"]["ratio"]
    text = f"{pred:.2f}"
    if pred > 1.0:
        text = f"**{text}**"
    if "oracle" in row:
        text += f" ({row['oracle']['ratio']:.2f})"
    return text + ("`*`" if row.get("seeds", 1) >= 2 else "")


def summary_lines(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The map's headline: how many cells meet each target, and the cells that miss."""
    miss = misses(rows)
    scored = [r for r in rows if "predictive" in r]
    pays = [r for r in scored if r.get("oracle", {}).get("ratio", 9) <= ORACLE_PAYS]
    lines = [f"- cells: {len(rows)} ({len(scored)} with a predictive and a baseline result)",
             f"- best predictive <= 1.0x the best baseline: {len(scored) - len(miss['over'])} of {len(scored)}",
             f"- where the oracle is <= {ORACLE_PAYS}x: best predictive <= {PREDICTIVE_MUST}x in "
             f"{len(pays) - len(miss['short'])} of {len(pays)}"]
    for name, what in (("over", "over 1.0x"), ("short", f"over {PREDICTIVE_MUST}x where the oracle is "
                                                        f"<= {ORACLE_PAYS}x")):
        if miss[name]:
            lines += ["", f"Cells with best predictive {what} (ratio; oracle; best baseline; best predictive):", ""]
            for r in sorted(miss[name], key=lambda r: -r["predictive"]["ratio"]):
                lines.append(f"- `{r['id']}`: {r['predictive']['ratio']:.2f}x "
                             f"({r['predictive']['min']:.2f}-{r['predictive']['max']:.2f}, {r['seeds']} seed(s)); "
                             f"oracle {r.get('oracle', {}).get('ratio', float('nan')):.2f}x; "
                             f"`{r['best_baseline']['config']}` {r['best_baseline']['p99']:.3f} s; "
                             f"`{r['predictive']['config']}`")
    return lines


def capacity_misses(rows: Sequence[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """At load, the cells that miss a target: best predictive's capacity under the best baseline's
    (``under``); the oracle's at least 1.3x and best predictive's under 1.15x (``short``)."""
    under, short = [], []
    for row in rows:
        cap = row.get("capacity", {})
        pred, oracle = cap.get("predictive"), cap.get("oracle")
        if pred is None:
            continue
        if pred["ratio"] < 1.0:
            under.append(row)
        if oracle is not None and oracle["ratio"] >= CAPACITY_ORACLE_PAYS and pred["ratio"] < CAPACITY_MUST:
            short.append(row)
    return {"under": under, "short": short}


def capacity_table(rows: Sequence[dict[str, Any]], grid: dict[str, Sequence[Any]], loads: Sequence[float]) -> str:
    """At load, two Markdown tables per link (a row per (nodes, burst, window), a column per context): the
    capacities (best predictive / best baseline, with the oracle's and the bound's ratio), bold where
    predictive's is over 1.0x; and best predictive's p99 TTFT over the best baseline's at each load."""
    by = {cell_id(r["cell"]): r for r in rows}
    out: list[str] = []
    for link in grid["link"]:
        out += [f"### {link}: capacity", "",
                "Each cell: best predictive's capacity / the best baseline's (oracle's; bound's), median of the "
                "per-seed ratios; **bold**: predictive over 1.0x.", "", *_grid_table(by, grid, link, _capacity_text),
                "", f"### {link}: p99 TTFT at " + ", ".join(f"{x:g}" for x in loads) + " of engine-only's capacity",
                "", "Each cell: best predictive's p99 TTFT / the best baseline's at each load, median over its "
                "seeds.", "", *_grid_table(by, grid, link, lambda r: _loads_text(r, loads)), ""]
    return "\n".join(out)


def _capacity_text(row: dict[str, Any]) -> str:
    cap = row.get("capacity", {})
    if "predictive" not in cap:
        return "-"
    pred = cap["predictive"]["ratio"]
    text = f"**{pred:.2f}**" if pred > 1.0 else f"{pred:.2f}"
    rest = [f"{cap[k]['ratio']:.2f}" for k in ("oracle", "bound") if k in cap]
    return text + (f" ({'; '.join(rest)})" if rest else "")


def _loads_text(row: dict[str, Any], loads: Sequence[float]) -> str:
    got = row.get("loads", {})
    texts = [f"{got[f'{x:g}']['predictive']['ratio']:.2f}" if "predictive" in got.get(f"{x:g}", {}) else "-"
             for x in loads]
    return "/".join(texts) if any(t != "-" for t in texts) else "-"


def capacity_summary_lines(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The map at load's headline: how many cells meet each target, where predictive beats the best
    baseline and by how much, and the cells that miss."""
    miss = capacity_misses(rows)
    scored = [r for r in rows if "predictive" in r.get("capacity", {})]
    pays = [r for r in scored if r["capacity"].get("oracle", {}).get("ratio", 0.0) >= CAPACITY_ORACLE_PAYS]
    wins = sorted((r for r in scored if r["capacity"]["predictive"]["ratio"] > 1.0),
                  key=lambda r: -r["capacity"]["predictive"]["ratio"])
    lines = [f"- cells: {len(rows)} ({len(scored)} with a predictive and a baseline capacity)",
             f"- best predictive's capacity >= the best baseline's: {len(scored) - len(miss['under'])} of "
             f"{len(scored)}; over it: {len(wins)}",
             f"- where the oracle's is >= {CAPACITY_ORACLE_PAYS}x: best predictive's >= {CAPACITY_MUST}x in "
             f"{len(pays) - len(miss['short'])} of {len(pays)}"]
    for name, what in (("wins", "over 1.0x the best baseline's capacity"), ("under", "under 1.0x"),
                       ("short", f"under {CAPACITY_MUST}x where the oracle's is >= {CAPACITY_ORACLE_PAYS}x")):
        chosen = wins if name == "wins" else sorted(miss[name], key=lambda r: r["capacity"]["predictive"]["ratio"])
        if chosen:
            lines += ["", f"Cells with best predictive {what} (ratio and range; oracle; bound; best baseline and its "
                          "capacity; best predictive):", ""]
            for r in chosen:
                cap = r["capacity"]
                lines.append(f"- `{r['id']}`: {cap['predictive']['ratio']:.2f}x "
                             f"({cap['predictive']['min']:.2f}-{cap['predictive']['max']:.2f}, {r['seeds']} seed(s)); "
                             f"oracle {cap.get('oracle', {}).get('ratio', float('nan')):.2f}x; "
                             f"bound {cap.get('bound', {}).get('ratio', float('nan')):.2f}x; "
                             f"`{cap['best_baseline']['config']}` x{cap['best_baseline']['rate_scale']:.3g}; "
                             f"`{cap['predictive']['config']}`")
    return lines


# ---- running it ------------------------------------------------------------------------
Replay = Callable[[Any], int]
"""Runs one replay (a ReplayConfig) into its ``out`` folder; returns its exit code (``kvctl replay``'s)."""


def _run_cell(replay: Replay, config: Any, out: Path, loads: Sequence[float] = ()) -> dict[str, Any]:
    """(worker) One cell's replay into ``out``; its workload entry, or ``{"error": ...}``. At load
    (``config.search == "capacity"``), the capacity search, then a replay at each of ``loads`` x engine-only's
    capacity into ``out/load-<share>``: ``{"capacity": ..., "loads": {share: workload entry}}``."""
    got = _replay_entry(replay, config, out)
    if "error" in got:
        return got
    if config.search != "capacity":
        return {"rc": got["rc"], "workload": _kept(got["entry"])}
    cap = got["entry"]["capacity"]
    ref = cap.get("reference")
    x = cap["configs"][ref]["rate_scale"]["median"] if ref is not None else 0.0
    at_load: dict[str, Any] = {}
    for share in loads if x > 0 else ():
        one = _replay_entry(replay, replace(config, search="", rate_scale=config.rate_scale * share * x),
                            out / f"load-{share:g}")
        if "error" in one:
            return one
        at_load[f"{share:g}"] = {"rate_scale": share * x, **_kept(one["entry"])}
    slim = {k: cap[k] for k in ("configs", "reference", "best_baseline", "best", "bound") if k in cap}
    return {"rc": got["rc"], "workload": {"capacity": slim, "loads": at_load}}


def _kept(entry: dict[str, Any]) -> dict[str, Any]:
    """What the map keeps of a replay's workload entry."""
    return {k: entry[k] for k in ("runs", "best_baseline", "vs_best") if k in entry}


def _replay_entry(replay: Replay, config: Any, out: Path) -> dict[str, Any]:
    """One replay into ``out``, its output swallowed: ``{"rc", "entry"}`` (its only workload's results.json
    entry), or ``{"error": ...}``."""
    sink = io.StringIO()
    config = replace(config, out=out)
    with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        rc = replay(config)
    results = out / "results.json"
    if not results.is_file():
        return {"error": f"exit {rc}: {sink.getvalue()[-400:]}"}
    workloads = json.loads(results.read_text())["workloads"]
    entry = next(iter(workloads.values()))
    return {"rc": rc, "entry": entry}


def _row(cell: dict[str, Any], got: dict[str, Any]) -> dict[str, Any]:
    """A cell's row of the map from what its worker returned."""
    row: dict[str, Any] = {"cell": cell, "id": cell_id(cell)}
    w = got.get("workload")
    if w is None:
        row["error"] = got.get("error", "?")
    elif "capacity" in w:
        row["capacity"] = capacity_cell(w["capacity"])
        row["loads"] = {share: {"rate_scale": e["rate_scale"], **cell_summary(e)} for share, e in w["loads"].items()}
        row["seeds"] = max((c["rate_scale"]["n"] for c in w["capacity"]["configs"].values()), default=0)
    else:
        row.update(cell_summary(w))
    return row


def _done(folder: Path, seeds: int, at_load: bool = False) -> dict[str, Any] | None:
    """The row ``folder`` holds of a finished cell of this kind (at load or not) with enough seeds."""
    path = folder / "cell.json"
    if not path.is_file():
        return None
    got = json.loads(path.read_text())
    ok = got.get("seeds", 0) >= seeds and "error" not in got and ("capacity" in got) == at_load
    return got if ok else None


def run_map(replay: Replay, base: Any, grid: dict[str, Sequence[Any]], out: Path, jobs: int, seeds: int = SEEDS,
            progress: Callable[..., Any] | None = None, loads: Sequence[float] = LOADS) -> list[dict[str, Any]]:
    """Run every cell of ``grid`` (``base``: the ReplayConfig of every cell but its axes; ``replay``: a
    module-level function, so that worker processes can be handed it) that ``out`` does not hold yet,
    ``jobs`` at a time, each with ``seeds`` seeds; returns one row per cell (its axes, id and
    :func:`cell_summary`, or at load -- ``base.search == "capacity"`` -- :func:`capacity_cell` and a
    :func:`cell_summary` per share of ``loads``)."""
    at_load = base.search == "capacity"
    todo = cells(grid)
    rows: dict[str, dict[str, Any]] = {}

    def config(cell: dict[str, Any], repeats: int) -> tuple[Any, Path]:
        folder = out / "cells" / (cell_id(cell) + ("" if repeats == 1 else f"-{repeats}seeds"))
        return replace(base, **overrides(cell), trace=("synth",), out=folder, repeats=repeats,
                       no_progress=True, no_plots=True, jobs=1), folder

    def run(batch: list[tuple[dict[str, Any], int]], desc: str) -> None:
        pending = []
        for cell, repeats in batch:
            cfg, folder = config(cell, repeats)
            held = _done(folder, repeats, at_load)
            if held is not None:
                rows[cell_id(cell)] = held
            else:
                pending.append((cell, repeats, cfg, folder))
        bar = progress(total=len(batch), initial=len(batch) - len(pending), desc=desc, unit="cell") \
            if progress else None
        with ProcessPoolExecutor(max(1, jobs)) if jobs > 1 else contextlib.nullcontext() as pool:
            if pool is None:
                done = ((c, r, f, _run_cell(replay, cfg, f, loads)) for c, r, cfg, f in pending)
            else:
                futures = {pool.submit(_run_cell, replay, cfg, f, loads): (c, r, f) for c, r, cfg, f in pending}
                done = ((*futures[fut], fut.result()) for fut in as_completed(futures))
            for cell, repeats, folder, got in done:
                row = _row(cell, got)
                row["seeds"] = max(row.get("seeds", 0), repeats if "workload" in got else 0)
                folder.mkdir(parents=True, exist_ok=True)
                (folder / "cell.json").write_text(json.dumps(row, indent=1))
                rows[cell_id(cell)] = row
                if bar is not None:
                    bar.update(1)
        if bar is not None:
            bar.close()

    run([(c, seeds) for c in todo], f"regimes, {seeds} seeds")
    return [rows[cell_id(c)] for c in todo if cell_id(c) in rows]


def write_map(rows: Sequence[dict[str, Any]], grid: dict[str, Sequence[Any]], base: dict[str, Any],
              out: Path, command: str, loads: Sequence[float] = LOADS) -> None:
    """``regimes.json``, ``regimes.md`` and ``regimes.png`` into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    at_load = base.get("search") == "capacity"
    found = capacity_misses(rows) if at_load else misses(rows)
    (out / "regimes.json").write_text(json.dumps({"command": command, "grid": grid, "config": base,
                                                  **({"loads": list(loads)} if at_load else {}),
                                                  "cells": list(rows), "misses": {k: [r["id"] for r in v] for k, v
                                                                                  in found.items()}},
                                                 indent=1, default=str))
    simulated = "simulated" if base.get("sim") else "live"
    configs = base.get("configs") or f"policies `{base.get('policies')}`, routers " \
                                      f"`{base.get('routers') or base.get('router')}`"
    if at_load:
        md = [f"# Regime map at load ({simulated})", "", f"```sh\n{command}\n```", "",
              f"Preset `{base.get('preset')}`, configurations `{configs}`; capacity: the highest rate scale at which "
              f"{base.get('slo_attainment')} of the requests meet the SLO; p99 TTFT in trace seconds.", "",
              *capacity_summary_lines(rows), "", capacity_table(rows, grid, loads)]
        plot(rows, grid, out / "regimes.png", [(lambda r, k=k: r.get("capacity", {}).get(k, {}).get("ratio"),
                                                 f"{k} capacity / best baseline's") for k in ("predictive", "oracle")],
             higher_is_better=True, label="capacity ratio (log scale)")
    else:
        md = [f"# Regime map ({simulated})", "", f"```sh\n{command}\n```", "",
              f"Preset `{base.get('preset')}`, {configs}; p99 TTFT in trace seconds.", "",
              *summary_lines(rows), "", table(rows, grid)]
        plot(rows, grid, out / "regimes.png")
    (out / "regimes.md").write_text("\n".join(md) + "\n")


def plot(rows: Sequence[dict[str, Any]], grid: dict[str, Sequence[Any]], path: Path,
         panels: Sequence[tuple[Callable[[dict[str, Any]], float | None], str]] | None = None,
         higher_is_better: bool = False, label: str = "p99 TTFT ratio (log scale)") -> None:
    """Per link, a heatmap per panel (rows: nodes, burst, window; columns: context) on one log color scale
    centred on 1.0, green where better: by default best predictive / best baseline and oracle / best
    baseline (p99 TTFT, lower is better); ``panels`` names others (what a row shows, a title)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import LogNorm

    if panels is None:
        panels = [(lambda r, k=k: r.get(k, {}).get("ratio"), title)
                  for k, title in (("predictive", "best predictive / best baseline"),
                                   ("oracle", "oracle / best baseline"))]
    by = {cell_id(r["cell"]): r for r in rows}
    ys = rows_of(grid)
    links = list(grid["link"])
    fig, axes = plt.subplots(len(links), len(panels), figsize=(2.2 + 1.3 * len(grid["context"]) * len(panels),
                                                               1.2 + 0.3 * len(ys) * len(links)), squeeze=False)
    norm = LogNorm(vmin=0.1, vmax=10.0)
    image = None
    for li, link in enumerate(links):
        for side, (value, title) in enumerate(panels):
            ax = axes[li][side]
            data = np.full((len(ys), len(grid["context"])), np.nan)
            for yi, row in enumerate(ys):
                for xi, context in enumerate(grid["context"]):
                    v = value(at(by, link, row, context))
                    if v is not None:
                        data[yi, xi] = v
            image = ax.imshow(np.clip(data, 0.1, 10.0), cmap="RdYlGn" if higher_is_better else "RdYlGn_r", norm=norm,
                              aspect="auto")
            for yi in range(len(ys)):
                for xi in range(len(grid["context"])):
                    if not np.isnan(data[yi, xi]):
                        worse = data[yi, xi] < 1.0 if higher_is_better else data[yi, xi] > 1.0
                        ax.text(xi, yi, f"{data[yi, xi]:.2f}", ha="center", va="center", fontsize=6,
                                fontweight="bold" if side == 0 and worse else "normal")
            ax.set_xticks(range(len(grid["context"])), [f"{c // 1024}k" for c in grid["context"]], fontsize=7)
            ax.set_yticks(range(len(ys)), [f"n{n} b{b} w{w:g}" for n, b, w in ys], fontsize=6)
            ax.set_title(f"{link}: {title}", fontsize=9)
            ax.set_xlabel("shared context (tokens)", fontsize=7)
    if image is not None:
        fig.colorbar(image, ax=axes, shrink=0.6, label=label)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def main(replay: Replay, config: Any, axes: Sequence[str], jobs: int, seeds: int,
         argv: Sequence[str], loads: Sequence[float] = LOADS) -> int:
    """``kvctl replay --regimes``: run the map (resuming what ``config.out`` holds) with ``replay`` running
    each cell, and write it; with ``--search capacity``, the map at load (simulated only)."""
    from tqdm import tqdm

    try:
        grid = parse_axes(axes)
        if config.search == "capacity" and not config.sim:
            raise ValueError("the regime map at load (--search capacity) runs on the simulator: add --sim")
        if config.search == "capacity" and (not loads or min(loads) <= 0):
            raise ValueError("--regimes-loads: positive shares of engine-only's capacity, e.g. 0.5,0.8,1.0")
    except ValueError as exc:
        print(f"kvctl replay: {exc}", file=sys.stderr)
        return 2
    jobs = jobs or (os.cpu_count() or 1 if config.sim else 1)
    rows = run_map(replay, config, grid, config.out, jobs, seeds, progress=tqdm, loads=loads)
    write_map(rows, grid, config.to_json(), config.out, "kvctl " + " ".join(argv), loads)
    print("\n".join(capacity_summary_lines(rows) if config.search == "capacity" else summary_lines(rows)))
    print(f"wrote {config.out / 'regimes.md'}, regimes.json and regimes.png")
    failed = [r["id"] for r in rows if "error" in r]
    if failed:
        print(f"cells that failed: {failed}", file=sys.stderr)
        return 1
    return 0
