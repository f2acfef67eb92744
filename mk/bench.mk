# Benchmarks: kvstrata's router vs vllm-router and sglang-router. Figures are printed and written to
# .bench/*.json; they never fail a build. See docs/benchmarks.md.
.PHONY: bench-router bench-router-tiers bench-proxy bench-deps bench-tools bench-lint

BENCH_DIR ?= .bench

# Peer routers (pip extra `bench`), installed once per pyproject change.
$(VENV)/.bench-ok: pyproject.toml $(VENV)/.ok
	$(VENV)/bin/pip install --disable-pip-version-check -q -e '.[bench]'
	touch $@

bench-deps: $(VENV)/.bench-ok

# nginx (static backend) and wrk (load generator) from Debian, as root; the stamp lives outside the
# work tree because they are installed system-wide.
BENCH_TOOLS_STAMP := $(KVSTRATA_CACHE)/.bench-tools-ok
$(BENCH_TOOLS_STAMP):
	@if ! command -v nginx >/dev/null || ! command -v wrk >/dev/null; then \
	  if [ "$$(id -u)" != 0 ]; then echo "bench-proxy needs nginx and wrk: run as root or apt-get install nginx-light wrk"; exit 1; fi; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx-light wrk; \
	fi
	mkdir -p $(dir $@) && touch $@

bench-tools: $(BENCH_TOOLS_STAMP)

# Three real vLLM CPU engines + one shared-prefix multi-turn workload through every router, one round per
# seed (BENCH_SEEDS, ten by default), open loop (BENCH_ARRIVAL_RATE; 0 = closed loop), 0.6 CPU per engine
# where cgroups are writable (BENCH_ENGINE_CPU); ~50 min, BENCH_SEEDS=7 ~6 min. Size with
# BENCH_CONVERSATIONS, BENCH_TURNS, BENCH_GROUPS (see python -m bench.router_bench --help).
bench-router: venv vllm bench-deps
	$(PY) -m bench.router_bench --out $(BENCH_DIR)/router.json $(BENCH_ARGS)

# The same workload on engines without and then with CPU DRAM + NVMe (fs) KV tiers, in one run
# (bench/tiers_bench.py); e.g. BENCH_ARGS="--routers kvstrata/kv-aware --seeds 7".
bench-router-tiers: venv vllm bench-deps
	$(PY) -m bench.tiers_bench --out $(BENCH_DIR)/router-tiers.json $(BENCH_ARGS)

# Router overhead: req/s and added latency to a static nginx backend, non-streaming and SSE.
bench-proxy: venv bench-deps bench-tools
	$(PY) -m bench.proxy_bench --out $(BENCH_DIR)/proxy.json $(BENCH_ARGS)

bench-lint: venv
	$(VENV)/bin/ruff check bench
	$(VENV)/bin/ruff format --check bench
