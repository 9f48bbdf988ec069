"""One real vLLM engine (CPU, dummy weights, greedy) with the kvstore
connector, in its own process: ``python engine_proc.py SPEC.json``.

The spec names the model folder, the kvstore node, the prompts to run one
after the other, and optionally a node to SIGKILL when the engine starts a
load. After each prompt it writes the pages of the prompt's full blocks as
they are in the engine's paged KV (gathered with kvstore's page ops) and
which of them were loaded; at the end the connector's counters. The test
process compares those files; nothing here decides pass or fail.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")   # the connector lives in this process
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def wait_dead(address: str, timeout: float = 10.0) -> None:
    """Until ``address`` refuses connections (the killed node's sockets closed)."""
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, int(port)), timeout=0.2).close()
        except OSError:
            return
        time.sleep(0.01)
    raise RuntimeError(f"{address} still accepts connections")


def main(spec_path: str) -> None:
    spec = json.load(open(spec_path))
    import numpy as np
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.inputs import TokensPrompt

    extra = {"address": spec["address"], **spec.get("connector", {})}
    started = time.perf_counter()
    llm = LLM(model=spec["model_dir"], load_format="dummy", skip_tokenizer_init=True, block_size=spec["block_size"],
              enforce_eager=True, max_model_len=spec.get("max_model_len", 2048), dtype="float32", seed=0,
              max_num_batched_tokens=spec.get("max_num_batched_tokens", 4096),
              enable_prefix_caching=spec.get("enable_prefix_caching", True),
              kv_transfer_config=KVTransferConfig(
                  kv_connector="KvstoreConnector", kv_connector_module_path="kvstore_vllm.connector",
                  kv_role="kv_both", kv_load_failure_policy="recompute", kv_connector_extra_config=extra))
    start_s = time.perf_counter() - started
    worker = get_kv_transfer_group().worker
    assert worker is not None
    armed: dict[str, object] = {}

    def kill_on_load(specs) -> None:  # type: ignore[no-untyped-def]
        target = armed.pop("kill", None)
        if target:
            os.kill(int(target["pid"]), signal.SIGKILL)  # type: ignore[index]
            wait_dead(target["address"])  # type: ignore[index]

    worker.on_load_start.append(kill_on_load)
    params = SamplingParams(max_tokens=spec.get("max_tokens", 8), temperature=0.0, detokenize=False)
    results = []
    for j, job in enumerate(spec["jobs"]):
        if job.get("kill_on_load"):
            armed["kill"] = job["kill_on_load"]
        seen_loads, seen_saves = set(worker.loaded), set(worker.saved)
        before = worker.stats.snapshot()
        t0 = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=job["tokens"], cache_salt=job.get("salt") or None)],
                           params, use_tqdm=False)
        ttft_wall = time.perf_counter() - t0
        worker.flush(30)
        after = worker.stats.snapshot()
        metrics = out[0].metrics
        record = {"tokens": list(out[0].outputs[0].token_ids), "wall_s": ttft_wall,
                  "stats": {k: after[k] - before[k] for k in after},
                  "ttft_s": getattr(metrics, "first_token_latency", None) if metrics is not None else None}
        # the prompt's full blocks as they are in the engine now: loaded ones and computed ones
        blocks: dict[str, int] = {}
        loaded: list[str] = []
        for req_id in [r for r in worker.loaded if r not in seen_loads]:
            spec_l = worker.loaded[req_id]
            for key, block in zip(spec_l.keys, spec_l.block_ids):
                blocks[key.hex()] = block
            loaded += [k.hex() for k in spec_l.keys]
        for req_id in [r for r in worker.saved if r not in seen_saves]:
            for spec_s in worker.saved[req_id]:
                for key, block in zip(spec_s.keys, spec_s.block_ids):
                    blocks.setdefault(key.hex(), block)
        keys = list(blocks)
        pages = np.empty((len(keys), worker.page_bytes), dtype=np.uint8)
        if keys:
            worker.ops.gather(worker.layers, [blocks[k] for k in keys], pages, np.arange(len(keys)),
                              layout=worker.layout)
        np.save(f"{spec['out']}.job{j}.npy", pages)
        record.update(keys=keys, loaded=loaded)
        results.append(record)
    json.dump({"start_s": start_s, "namespace": worker.namespace, "page_bytes": worker.page_bytes,
               "jobs": results}, open(spec["out"], "w"))
    sys.stdout.flush()
    os._exit(0)  # skip the engine's slow teardown; every save was flushed above


if __name__ == "__main__":
    main(sys.argv[1])
