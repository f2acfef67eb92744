# The operator: chart checks, its integration tests and its benchmark. See docs/operator.md.
.PHONY: helm-lint test-operator bench-operator

BENCH_DIR ?= .bench
# helm comes with the local control plane's binaries (make cluster-bin).
OPERATOR_HELM = $(shell $(PY) -c 'from kvstrata_dev.localcluster.versions import bin_dir; print(bin_dir() / "helm")' 2>/dev/null)

helm-lint: venv cluster-bin
	$(OPERATOR_HELM) lint --strict charts/kvstrata
	$(OPERATOR_HELM) template kvstrata charts/kvstrata --namespace kvstrata-system >/dev/null

# Operator, chart and admission tests only (each module installs the chart and runs one operator).
test-operator: venv cluster-bin
	$(VENV)/bin/pytest -q tests/unit/controller tests/integration/test_chart.py \
	  tests/integration/test_operator.py tests/integration/test_admission.py tests/integration/test_operator_faults.py

# apply→Ready for 1 and for 100 InferenceClusters, operator RSS with 200: prints a table, writes .bench/operator.json.
bench-operator: venv cluster-bin
	$(PY) -m bench.operator_bench --out $(BENCH_DIR)/operator.json $(BENCH_ARGS)
