# kvstrata — every set-up step lives here (and in mk/*.mk), so a fresh machine needs only
# `make demo` and `make test`.
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
KVSTRATA_CACHE ?= $(HOME)/.cache/kvstrata
export KVSTRATA_CACHE
VLLM_VENV ?= $(KVSTRATA_CACHE)/vllm-0.32.0
export VLLM_VENV

.PHONY: help venv vllm lint fmt crds crds-check test test-unit test-integration test-e2e demo plan clean

help:
	@echo "make demo   - the whole stack on the embedded local cluster"
	@echo "make test   - unit + integration + e2e tests"
	@echo "make plan   - print the plans of examples/"
	@echo "make crds   - regenerate crds/ and the chart's CRD from the pydantic models"
	@echo "make lint   - ruff + mypy"

# The product (kvstrata, editable, with its dev tools) and the development harness (kvstrata-dev: local
# control plane, engine harness, e2e launcher, demo), which is never part of the product wheel.
# The router's native core (native/: Rust, PyO3, built by maturin with the pinned crates of Cargo.lock)
# is installed with them; it needs cargo (rustup), not a container or a prebuilt wheel.
NATIVE_SRC := native/Cargo.toml native/Cargo.lock native/pyproject.toml native/kvstrata_native.pyi $(wildcard native/src/*.rs)
$(VENV)/.ok: pyproject.toml dev/pyproject.toml $(NATIVE_SRC)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --disable-pip-version-check -q --upgrade pip==25.3
	$(PY) -m pip install --disable-pip-version-check -q -e '.[dev]' -e ./dev ./native
	touch $@

# The router's request path compiled by mypyc into $(VENV)/kvstrata-compiled/ (operator/kvstrata/compiled.py says
# why and how it loads); about a minute on two cores, then a no-op while the sources are unchanged.
venv: $(VENV)/.ok
	@$(PY) -m kvstrata_dev.build_compiled

# vLLM (CPU build) in its own cached venv: see scripts/install-vllm.sh for why.
vllm: $(VLLM_VENV)/.ok
$(VLLM_VENV)/.ok:
	bash scripts/install-vllm.sh

LINT_PATHS := operator dev tests e2e bench conftest.py

# ruff, then mypy (strict settings in pyproject.toml) over the product package.
lint: venv
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(VENV)/bin/ruff format --check $(LINT_PATHS)
	$(VENV)/bin/mypy

fmt: venv
	$(VENV)/bin/ruff check --fix $(LINT_PATHS)
	$(VENV)/bin/ruff format $(LINT_PATHS)

crds: venv
	$(PY) -m kvstrata.api.crd --write

plan: venv
	$(VENV)/bin/kvstrata plan examples/

test-unit: venv
	$(VENV)/bin/pytest -q tests/unit

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache

include $(wildcard mk/*.mk)

# `make test` = lint + CRD freshness + unit + integration (real kube-apiserver) + e2e (real vLLM).
# It builds or reuses the cached control plane and vLLM venv first, so a fresh machine needs nothing else.
test: venv vllm cluster-bin
	$(MAKE) lint
	$(VENV)/bin/pytest tests e2e

test-integration: venv vllm cluster-bin
	$(VENV)/bin/pytest -q tests/integration

test-e2e: venv vllm cluster-bin
	$(VENV)/bin/pytest -q e2e
