"""Parsing engine and router /metrics text into the figures the status uses."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import generate_latest

from kvstrata.controller.promtext import MetricsParseError, parse_engine, parse_router, sum_routers
from kvstrata.router.metrics import RouterMetrics

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "status-vllm-0.32.0-metrics-sample.txt"


def _value(text: str, sample: str) -> float:
    for line in text.splitlines():
        if line.startswith(sample + "{") or line.startswith(sample + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{sample} not in fixture")


def test_recorded_vllm_scrape() -> None:
    text = FIXTURE.read_text()
    s = parse_engine(text)
    assert s.counters.queries == _value(text, "vllm:prefix_cache_queries_total")
    assert s.counters.hits == _value(text, "vllm:prefix_cache_hits_total")
    assert s.counters.external_hits == _value(text, "vllm:external_prefix_cache_hits_total")
    assert s.kv_usage == _value(text, "vllm:kv_cache_usage_perc")
    assert s.running == int(_value(text, "vllm:num_requests_running"))
    assert s.start_time == _value(text, "process_start_time_seconds")
    assert 0 < s.counters.hits < s.counters.queries


def test_data_parallel_engines_are_summed() -> None:
    text = "\n".join(
        [
            "# TYPE vllm:prefix_cache_queries counter",
            'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 100.0',
            'vllm:prefix_cache_queries_total{engine="1",model_name="m"} 50.0',
            "# TYPE vllm:prefix_cache_hits counter",
            'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 40.0',
            'vllm:prefix_cache_hits_total{engine="1",model_name="m"} 10.0',
            "# TYPE vllm:prompt_tokens_cached_by_source counter",
            'vllm:prompt_tokens_cached_by_source_total{engine="0",model_name="m",source="host"} 7.0',
            'vllm:prompt_tokens_cached_by_source_total{engine="0",model_name="m",source="disk"} 3.0',
            'vllm:prompt_tokens_cached_by_source_total{engine="0",model_name="m",source="device"} 40.0',
            "# TYPE vllm:kv_cache_usage_perc gauge",
            'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.2',
            'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.4',
            "",
        ]
    )
    s = parse_engine(text)
    assert s.counters.queries == 150
    assert s.counters.hits == 50
    assert s.counters.cpu_hits == 7
    assert s.counters.nvme_hits == 3
    assert s.kv_usage == pytest.approx(0.3)
    assert s.running is None


def test_not_vllm_metrics_is_a_clear_error() -> None:
    with pytest.raises(MetricsParseError, match="prefix_cache_queries"):
        parse_engine("# TYPE up gauge\nup 1\n")
    with pytest.raises(MetricsParseError, match="not Prometheus text"):
        parse_engine("this is { not metrics\n")


def test_router_metrics_from_the_real_registry() -> None:
    m = RouterMetrics()
    m.requests.labels("http://a", "ok").inc(3)
    m.requests.labels("http://b", "ok").inc(2)
    for reason in ("prefix", "prefix", "least-load", "approx-prefix"):
        m.decided(reason)
    m.fallbacks.labels("no-tokenizer").inc()
    s = parse_router(generate_latest(m.registry).decode())
    assert s.requests == 5
    assert s.decisions == 4
    assert s.affinity_decisions == 3
    assert s.fallbacks == 1
    total = sum_routers([s, s])
    assert total is not None and total.requests == 10
    assert sum_routers([]) is None


def test_fresh_router_is_zero_not_an_error() -> None:
    s = parse_router(generate_latest(RouterMetrics().registry).decode())
    assert (s.requests, s.decisions, s.fallbacks) == (0, 0, 0)
    with pytest.raises(MetricsParseError):
        parse_router("# TYPE up gauge\nup 1\n")
