"""End to end with real vLLM engines on CPU (dummy weights, fp32, greedy) and a
real 2-node kvstore cluster: engine A computes prompts and saves their KV to
node a; engine B, connected to node b, gets the same prefix plus a new
suffix and loads the prefix through kvstore.

- the KV B loaded equals, page by page, the KV A computed (and what node a
  stores), and B generates the tokens it generates when it computes the
  whole prompt itself;
- control: one stored page corrupted, the same check reports that page;
- node a SIGKILLed when B starts its load: B still answers, by recomputing.

Each engine runs in its own process (tests/engines/engine_proc.py). Skipped
where vLLM is not installed; ``make test-vllm`` installs it and runs these
with none skipped.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("KVSTORE_REQUIRE_VLLM"):
        raise RuntimeError("KVSTORE_REQUIRE_VLLM is set but vLLM is not installed")
    pytest.skip("vLLM is not installed (make test-vllm installs it)", allow_module_level=True)

from kvstore_client import KvClient  # noqa: E402
from tests.conftest import TESTS_DIR  # noqa: E402
from tests.kvstore_cluster import start_cluster, wait_until  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

BLOCK = 32
ENGINE = TESTS_DIR / "engines" / "engine_proc.py"
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128, "intermediate_size": 256,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1024,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "torch_dtype": "float32",
    "hidden_act": "silu", "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
}
PREFIX = [(7 * i + 3) % 1000 + 10 for i in range(8 * BLOCK)]     # 8 full blocks
SUFFIX_A = [11, 12, 13, 14, 15]
SUFFIX_B = [(5 * i + 1) % 900 + 20 for i in range(45)]          # B's new suffix


def write_model(folder: Path, config: dict) -> Path:  # type: ignore[type-arg]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def run_engine(tmp: Path, name: str, model: Path, address: str, jobs: list[dict]) -> dict:  # type: ignore[type-arg]
    """Run one engine process over ``jobs``; returns its report, with each
    job's pages (key hex -> page bytes) under ``pages``."""
    out = tmp / f"{name}.json"
    spec = {"model_dir": str(model), "address": address, "block_size": BLOCK, "jobs": jobs, "out": str(out),
            "connector": {"load_timeout_s": 3.0}}
    spec_path = tmp / f"{name}.spec.json"
    spec_path.write_text(json.dumps(spec))
    log = tmp / f"{name}.log"
    with open(log, "w") as fh:
        proc = subprocess.run([sys.executable, str(ENGINE), str(spec_path)], stdout=fh, stderr=subprocess.STDOUT,
                              timeout=300, env=dict(os.environ, PYTHONHASHSEED="0"))
    if proc.returncode != 0 or not out.exists():
        raise AssertionError(f"engine {name} failed ({proc.returncode}):\n{log.read_text()[-6000:]}")
    report = json.loads(out.read_text())
    for j, job in enumerate(report["jobs"]):
        rows = np.load(f"{out}.job{j}.npy")
        job["pages"] = {k: rows[i] for i, k in enumerate(job["keys"])}
    return report


def mismatched_pages(loaded: dict, computed: dict, keys: list[str]) -> list[int]:  # type: ignore[type-arg]
    """The equality check: indices of ``keys`` whose loaded page differs
    from the computed one, byte for byte."""
    return [i for i, k in enumerate(keys) if not np.array_equal(loaded[k], computed[k])]


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> Iterator[dict]:  # type: ignore[no-untyped-def,type-arg]
    """Nodes a and b, and engine A's run over three salted copies of the
    prompt (one per test, so the tests do not share pages)."""
    tmp = tmp_path_factory.mktemp("vllm")
    model = write_model(tmp / "tiny-llama", TINY_LLAMA)
    nodes = start_cluster("ab")
    try:
        salts = ["equal", "corrupt", "kill"]
        a = run_engine(tmp, "A", model, nodes["a"].address,
                       [{"tokens": PREFIX + SUFFIX_A, "salt": s} for s in salts])
        computed = {s: a["jobs"][i]["pages"] for i, s in enumerate(salts)}
        for job in a["jobs"]:
            assert job["stats"]["saved_blocks"] == 8 and job["stats"]["loaded_tokens"] == 0
        yield {"tmp": tmp, "model": model, "nodes": nodes, "A": a, "computed": computed}
    finally:
        for node in nodes.values():
            node.kill()


def prefix_keys(report_job: dict) -> list[str]:  # type: ignore[type-arg]
    return report_job["loaded"]


def test_loaded_kv_equals_computed_kv_and_tokens_match(setup) -> None:  # type: ignore[no-untyped-def]
    nodes, computed = setup["nodes"], setup["computed"]["equal"]
    keys = list(computed)[:8]
    with KvClient(nodes["a"].address) as kv:                 # node a stores exactly what A computed
        stored = kv.get(setup["A"]["namespace"], [bytes.fromhex(k) for k in keys])
        assert stored.found.all()
        assert mismatched_pages({k: stored.pages[i] for i, k in enumerate(keys)}, computed, keys) == []
    b = run_engine(setup["tmp"], "B-equal", setup["model"], nodes["b"].address, [
        {"tokens": PREFIX + SUFFIX_B, "salt": "ref-equal"},    # B computes everything itself
        {"tokens": PREFIX + SUFFIX_B, "salt": "equal"},        # B loads the prefix through kvstore
    ])
    ref, hit = b["jobs"]
    assert ref["stats"]["loaded_tokens"] == 0
    assert hit["stats"]["loaded_tokens"] == 8 * BLOCK          # counted by the connector
    assert hit["stats"]["load_failed_blocks"] == 0
    assert prefix_keys(hit) == keys                           # the 8 prefix pages, from node a via node b
    assert mismatched_pages(hit["pages"], computed, keys) == []
    assert hit["tokens"] == ref["tokens"]
    assert len(hit["tokens"]) == 8


def test_corrupted_page_fails_the_equality_check(setup) -> None:  # type: ignore[no-untyped-def]
    nodes, computed = setup["nodes"], setup["computed"]["corrupt"]
    keys = list(computed)[:8]
    ns = setup["A"]["namespace"]
    victim = 5
    with KvClient(nodes["a"].address) as kv:
        bad = computed[keys[victim]].copy()
        bad[::97] ^= 0x5A                                     # flip bits across every layer's part
        assert kv.delete(ns, [bytes.fromhex(keys[victim])]).deleted == 1
        assert kv.put(ns, [bytes.fromhex(keys[victim])], bad[None]).stored == 1
    b = run_engine(setup["tmp"], "B-corrupt", setup["model"], nodes["b"].address,
                   [{"tokens": PREFIX + SUFFIX_B, "salt": "corrupt"}])
    hit = b["jobs"][0]
    assert hit["stats"]["loaded_tokens"] == 8 * BLOCK
    assert mismatched_pages(hit["pages"], computed, keys) == [victim]


def test_killed_node_during_load_means_recompute(setup) -> None:  # type: ignore[no-untyped-def]
    nodes = setup["nodes"]
    a = nodes["a"]
    with KvClient(nodes["b"].address) as kv:
        wait_until(lambda: kv.lookup_nodes(setup["A"]["namespace"],
                                           [bytes.fromhex(k) for k in list(setup["computed"]["kill"])[:8]]
                                           ).nodes[0].prefix_length == 8, 10, "node b to see a's prefix")
    b = run_engine(setup["tmp"], "B-kill", setup["model"], nodes["b"].address, [
        {"tokens": PREFIX + SUFFIX_B, "salt": "ref-kill"},
        {"tokens": PREFIX + SUFFIX_B, "salt": "kill",
         "kill_on_load": {"pid": a.proc.pid, "address": a.address}},
    ])
    assert a.proc.wait(10) == -9                              # node a really died, during B's load
    ref, hit = b["jobs"]
    assert hit["stats"]["load_failed_blocks"] == 8           # every prefix page missed ...
    assert hit["stats"]["loaded_tokens"] == 0
    assert hit["tokens"] == ref["tokens"]                    # ... and B answered by recomputing
    assert hit["wall_s"] < 30
