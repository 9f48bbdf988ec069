# kvstore developer entry points. Every target installs what it needs first.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
PROTO_SRC := proto/kvstore/v1/kvstore.proto
ARGS    ?=

.PHONY: install proto test test-gpu bench run demo kernels clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

# Regenerate the committed protobuf/gRPC code (tests fail when it is stale).
proto: $(STAMP)
	$(BIN)/python -m kvstore.protogen

# Compile every CUDA kernel to a cubin for sm_80 and sm_90 (needs nvcc).
kernels:
	@for f in kernels/*.cu; do for a in sm_80 sm_90; do \
	  echo "nvcc -arch=$$a -cubin $$f"; nvcc -arch=$$a -cubin -o /dev/null $$f || exit 1; done; done

test: $(STAMP)
	$(BIN)/python -m pytest $(ARGS)

# GPU parity tests only (run on a machine with a CUDA device and `.[gpu]`).
test-gpu: $(STAMP)
	$(BIN)/python -m pytest -m gpu $(ARGS)

bench: $(STAMP)
	$(BIN)/kvctl bench micro $(ARGS)

# The main job: trace replay on local 4-node clusters (CPU fallback) -- a window of
# the Mooncake conversation trace and the synthetic fan-out workload, policies
# none/reactive/full/predictive/oracle side by side; prints the table and writes
# bench/out/replay/{results.json,report.md,*.png} (docs/benchmark.md).
run: $(STAMP)
	$(BIN)/kvctl replay --device cpu $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
