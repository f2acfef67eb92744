# Benchmarks: kvstrata's router vs vllm-router and sglang-router. Figures are printed and written to
# .bench/*.json; they never fail a build. See docs/benchmarks.md.
.PHONY: bench-router bench-router-fixed bench-router-tiers bench-tier-credit bench-proxy bench-router-overhead bench-admission bench-decision bench-relay-floor bench-deps bench-tools bench-lint

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

# kvstrata vs sglang-router and vllm-router over BENCH_DRAWS (20) random draws of a workload family:
# tenants, users, turns, lengths, completions/chat, closed/Poisson/bursty arrivals, KV capacity 0.3-3x
# the working set (bench/family.py). Three real vLLM CPU engines per draw; paired differences per regime.
# Several hours on two cores; BENCH_DRAWS=3 for a look. `--dry-run` in BENCH_ARGS lists the draws.
bench-router: venv vllm bench-deps
	$(PY) -m bench.family_bench --out $(BENCH_DIR)/router-family.json $(BENCH_ARGS)

# The earlier fixed shape (one shared-prefix multi-turn workload, ten seeds; docs/benchmarks.md).
bench-router-fixed: venv vllm bench-deps
	$(PY) -m bench.router_bench --out $(BENCH_DIR)/router.json $(BENCH_ARGS)

# The same workload on engines without and then with CPU DRAM + NVMe (fs) KV tiers, in one run
# (bench/tiers_bench.py); e.g. BENCH_ARGS="--routers kvstrata/kv-aware --seeds 7".
bench-router-tiers: venv vllm bench-deps
	$(PY) -m bench.tiers_bench --out $(BENCH_DIR)/router-tiers.json $(BENCH_ARGS)

# What a prefix hit on each KV tier saves (the router's tierWeights), on one real tiered engine.
bench-tier-credit: venv vllm
	$(PY) -m bench.tier_credit_bench --out $(BENCH_DIR)/tier-credit.json $(BENCH_ARGS)

# Router overhead: req/s and added latency to a static nginx backend, non-streaming and SSE.
bench-proxy: venv bench-deps bench-tools
	$(PY) -m bench.proxy_bench --out $(BENCH_DIR)/proxy.json $(BENCH_ARGS)

# Latency each router adds to long prompts (1K-128K tokens), cold and extending a known prompt, against
# the same static nginx backend, and one long agent conversation; kvstrata and both peers in one run.
# BENCH_OVERHEAD_SIZES, BENCH_OVERHEAD_REQUESTS, BENCH_OVERHEAD_AGENT_TURNS, BENCH_OVERHEAD_ROUTERS.
# Writes .bench/overhead.json.
bench-router-overhead: venv bench-deps bench-tools
	$(PY) -m bench.overhead_bench --out $(BENCH_DIR)/overhead.json $(BENCH_ARGS)

# What the admission gate costs the router's loop while it holds 10-1,000 requests (in process, the real
# index, no engine; no peer holds requests). Writes .bench/admission.json.
bench-admission: venv
	$(PY) -m bench.admission_bench --out $(BENCH_DIR)/admission.json $(BENCH_ARGS)

# What the router's decision and bookkeeping cost per request without HTTP (in process, bench-proxy's
# prompts, no engine; no peer can be driven this way). Writes .bench/decision.json.
bench-decision: venv
	$(PY) -m bench.decision_bench --out $(BENCH_DIR)/decision.json $(BENCH_ARGS)

# The least a Python relay that decides nothing costs per request under bench-proxy's load (aiohttp's
# application and low-level server, a bare httptools protocol; the router's upstream client). Writes
# .bench/relay-floor.json.
# The native relays (bench/relay_native/: hyper, tokio, PyO3), built into the venv by maturin with the
# pinned crates of their Cargo.lock; benchmark only, never part of the router.
RELAY_NATIVE_SRC := bench/relay_native/Cargo.toml bench/relay_native/Cargo.lock bench/relay_native/pyproject.toml $(wildcard bench/relay_native/src/*.rs)
$(VENV)/.relay-native-ok: $(RELAY_NATIVE_SRC) $(VENV)/.ok
	$(PY) -m pip install --disable-pip-version-check -q ./bench/relay_native
	touch $@

bench-relay-floor: venv bench-tools $(VENV)/.relay-native-ok
	$(PY) -m bench.relay_floor --out $(BENCH_DIR)/relay-floor.json $(BENCH_ARGS)

bench-lint: venv
	$(VENV)/bin/ruff check bench
	$(VENV)/bin/ruff format --check bench
