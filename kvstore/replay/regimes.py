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
    out["best_baseline"] = {"config": base["config"], "p99": base["ttft_p99_s"]["median"]}
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
        out["predictive"] = {"config": k, "ratio": ratio["median"], "min": ratio["min"], "max": ratio["max"]}
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
                "| nodes | burst | window s | " + " | ".join(f"{c // 1024}k" for c in grid["context"]) + " |",
                "|---|---|---|" + "---|" * len(grid["context"])]
        for row in rows_of(grid):
            texts = [_cell_text(at(by, link, row, context)) for context in grid["context"]]
            out.append(f"| {row[0]} | {row[1]} | {row[2]:g} | " + " | ".join(texts) + " |")
        out.append("")
    return "\n".join(out)


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


# ---- running it ------------------------------------------------------------------------
Replay = Callable[[Any], int]
"""Runs one replay (a ReplayConfig) into its ``out`` folder; returns its exit code (``kvctl replay``'s)."""


def _run_cell(replay: Replay, config: Any, out: Path) -> dict[str, Any]:
    """(worker) One cell's replay into ``out``; its workload entry, or ``{"error": ...}``."""
    sink = io.StringIO()
    with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        rc = replay(config)
    results = out / "results.json"
    if not results.is_file():
        return {"error": f"exit {rc}: {sink.getvalue()[-400:]}"}
    workloads = json.loads(results.read_text())["workloads"]
    entry = next(iter(workloads.values()))
    return {"rc": rc, "workload": {k: entry[k] for k in ("runs", "best_baseline", "vs_best") if k in entry}}


def _done(folder: Path, seeds: int) -> dict[str, Any] | None:
    path = folder / "cell.json"
    if not path.is_file():
        return None
    got = json.loads(path.read_text())
    return got if got.get("seeds", 0) >= seeds and "error" not in got else None


def run_map(replay: Replay, base: Any, grid: dict[str, Sequence[Any]], out: Path, jobs: int, seeds: int = SEEDS,
            progress: Callable[..., Any] | None = None) -> list[dict[str, Any]]:
    """Run every cell of ``grid`` (``base``: the ReplayConfig of every cell but its axes; ``replay``: a
    module-level function, so that worker processes can be handed it) that ``out`` does not hold yet,
    ``jobs`` at a time, each with ``seeds`` seeds; returns one row per cell (its axes, id and
    :func:`cell_summary`)."""
    todo = cells(grid)
    rows: dict[str, dict[str, Any]] = {}

    def config(cell: dict[str, Any], repeats: int) -> tuple[Any, Path]:
        folder = out / "cells" / (cell_id(cell) + ("" if repeats == 1 else f"-{repeats}seeds"))
        return replace(base, **overrides(cell), trace=("synth",), out=folder, repeats=repeats,
                       no_progress=True, no_plots=True), folder

    def run(batch: list[tuple[dict[str, Any], int]], desc: str) -> None:
        pending = []
        for cell, repeats in batch:
            cfg, folder = config(cell, repeats)
            held = _done(folder, repeats)
            if held is not None:
                rows[cell_id(cell)] = held
            else:
                pending.append((cell, repeats, cfg, folder))
        bar = progress(total=len(batch), initial=len(batch) - len(pending), desc=desc, unit="cell") \
            if progress else None
        with ProcessPoolExecutor(max(1, jobs)) if jobs > 1 else contextlib.nullcontext() as pool:
            if pool is None:
                done = ((c, r, f, _run_cell(replay, cfg, f)) for c, r, cfg, f in pending)
            else:
                futures = {pool.submit(_run_cell, replay, cfg, f): (c, r, f) for c, r, cfg, f in pending}
                done = ((*futures[fut], fut.result()) for fut in as_completed(futures))
            for cell, repeats, folder, got in done:
                row = {"cell": cell, "id": cell_id(cell), **(cell_summary(got["workload"]) if "workload" in got
                                                             else {"error": got.get("error", "?")})}
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
              out: Path, command: str) -> None:
    """``regimes.json``, ``regimes.md`` and ``regimes.png`` into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "regimes.json").write_text(json.dumps({"command": command, "grid": grid, "config": base,
                                                  "cells": list(rows), "misses": {k: [r["id"] for r in v] for k, v
                                                                                  in misses(rows).items()}},
                                                 indent=1, default=str))
    simulated = "simulated" if base.get("sim") else "live"
    md = [f"# Regime map ({simulated})", "", f"```sh\n{command}\n```", "",
          f"Preset `{base.get('preset')}`, policies `{base.get('policies')}`, routers "
          f"`{base.get('routers') or base.get('router')}`; p99 TTFT in trace seconds.", "",
          *summary_lines(rows), "", table(rows, grid)]
    (out / "regimes.md").write_text("\n".join(md) + "\n")
    plot(rows, grid, out / "regimes.png")


def plot(rows: Sequence[dict[str, Any]], grid: dict[str, Sequence[Any]], path: Path) -> None:
    """Per link, two heatmaps (rows: nodes, burst, window; columns: context): best predictive / best
    baseline and oracle / best baseline, on one log color scale centred on 1.0."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import LogNorm

    by = {cell_id(r["cell"]): r for r in rows}
    ys = rows_of(grid)
    links = list(grid["link"])
    fig, axes = plt.subplots(len(links), 2, figsize=(2.2 + 1.3 * len(grid["context"]) * 2, 1.2 + 0.3 * len(ys)
                                                         * len(links)), squeeze=False)
    norm = LogNorm(vmin=0.1, vmax=10.0)
    image = None
    for li, link in enumerate(links):
        for side, (what, title) in enumerate((("predictive", "best predictive / best baseline"),
                                               ("oracle", "oracle / best baseline"))):
            ax = axes[li][side]
            data = np.full((len(ys), len(grid["context"])), np.nan)
            for yi, row in enumerate(ys):
                for xi, context in enumerate(grid["context"]):
                    r = at(by, link, row, context)
                    if what in r:
                        data[yi, xi] = r[what]["ratio"]
            image = ax.imshow(np.clip(data, 0.1, 10.0), cmap="RdYlGn_r", norm=norm, aspect="auto")
            for yi in range(len(ys)):
                for xi in range(len(grid["context"])):
                    if not np.isnan(data[yi, xi]):
                        ax.text(xi, yi, f"{data[yi, xi]:.2f}", ha="center", va="center", fontsize=6,
                                fontweight="bold" if what == "predictive" and data[yi, xi] > 1.0 else "normal")
            ax.set_xticks(range(len(grid["context"])), [f"{c // 1024}k" for c in grid["context"]], fontsize=7)
            ax.set_yticks(range(len(ys)), [f"n{n} b{b} w{w:g}" for n, b, w in ys], fontsize=6)
            ax.set_title(f"{link}: {title}", fontsize=9)
            ax.set_xlabel("shared context (tokens)", fontsize=7)
    if image is not None:
        fig.colorbar(image, ax=axes, shrink=0.6, label="p99 TTFT ratio (log scale)")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def main(replay: Replay, config: Any, axes: Sequence[str], jobs: int, seeds: int,
         argv: Sequence[str]) -> int:
    """``kvctl replay --regimes``: run the map (resuming what ``config.out`` holds) with ``replay`` running
    each cell, and write it."""
    from tqdm import tqdm

    try:
        grid = parse_axes(axes)
    except ValueError as exc:
        print(f"kvctl replay: {exc}", file=sys.stderr)
        return 2
    jobs = jobs or (os.cpu_count() or 1 if config.sim else 1)
    rows = run_map(replay, config, grid, config.out, jobs, seeds, progress=tqdm)
    write_map(rows, grid, config.to_json(), config.out, "kvctl " + " ".join(argv))
    print("\n".join(summary_lines(rows)))
    print(f"wrote {config.out / 'regimes.md'}, regimes.json and regimes.png")
    failed = [r["id"] for r in rows if "error" in r]
    if failed:
        print(f"cells that failed: {failed}", file=sys.stderr)
        return 1
    return 0
