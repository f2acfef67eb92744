# `make demo`: the whole stack on the local cluster with real vLLM CPU engines (docs/demo.md).
# First run builds the control plane and installs vLLM (cached in $(KVSTRATA_CACHE)); later runs reuse both.
# DEMO_ARGS: e.g. `--exit` (stop after printing the results), `--requests 64`, `--example FILE`.
.PHONY: demo demo-down
DEMO_ARGS ?=

demo: venv vllm cluster-bin
	$(VENV)/bin/python -m kvstrata_dev.e2e.demo up $(DEMO_ARGS)

# Stops a running `make demo` (or what a crashed one left): engines, router, operator, and the
# control plane if the demo started it.
demo-down: venv
	$(VENV)/bin/python -m kvstrata_dev.e2e.demo down
