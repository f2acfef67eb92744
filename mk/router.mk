# The router's own test targets (unit: seconds; engines: three real vLLM CPU engines, ~5-10 min).
.PHONY: test-router test-router-engines

test-router: venv
	$(VENV)/bin/pytest -q tests/unit/router

test-router-engines: venv vllm
	$(VENV)/bin/pytest -q -s tests/vllm/test_router_engines.py
