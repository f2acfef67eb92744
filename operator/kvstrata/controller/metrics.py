"""Prometheus metrics of the operator itself (the engines' and router's metrics live elsewhere)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

REGISTRY = CollectorRegistry(auto_describe=True)

RECONCILES = Counter(
    "kvstrata_operator_reconciles_total",
    "Reconciles of InferenceClusters by result (applied, infeasible, retry, error)",
    ["result"],
    registry=REGISTRY,
)
ERRORS = Counter(
    "kvstrata_operator_errors_total",
    "API and handler errors by kind (api-<status>, unreachable, waiting, invalid)",
    ["kind"],
    registry=REGISTRY,
)
RECONCILE_SECONDS = Histogram(
    "kvstrata_operator_reconcile_duration_seconds",
    "Wall time of one reconcile (plan, render, apply, status)",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
    registry=REGISTRY,
)
STATUS_WRITES = Counter(
    "kvstrata_operator_status_writes_total",
    "Status patches by outcome (written, unchanged, error)",
    ["outcome"],
    registry=REGISTRY,
)
ADMISSIONS = Counter(
    "kvstrata_operator_admission_reviews_total",
    "Validating webhook decisions (allowed, denied)",
    ["decision"],
    registry=REGISTRY,
)
CLUSTERS = Gauge(
    "kvstrata_operator_inferenceclusters",
    "InferenceClusters the operator currently tracks",
    registry=REGISTRY,
)


def serve(addr: str, port: int) -> None:
    """Expose /metrics on addr:port (a daemon thread); port 0 disables it."""
    if port:
        start_http_server(port, addr=addr, registry=REGISTRY)
