# Real-vLLM harness and planner cross-checks (docs/testing-with-vllm.md).
.PHONY: test-vllm tiny-model

# Planner vs vLLM's own KV specs, pool sizing, parser and real CPU engines; ~15 min on 2 cores.
test-vllm: venv vllm
	$(VENV)/bin/pytest -q tests/vllm

# The tiny random-weight model every local engine serves ($(KVSTRATA_CACHE)/models/tiny-llama).
tiny-model: venv
	$(PY) -m kvstrata_dev.testing.tinymodel
