"""bench-proxy's pairing: each kvstrata router against each peer within a round, and added latency
against the straight run of the same round."""

from __future__ import annotations

from typing import Any

import pytest
from bench.proxy_bench import _add_overhead, _paired_cpu


def _row(target: str, mode: str, round_: int, cpu: float | None, p50: float = 1.0) -> dict[str, Any]:
    return {
        "target": target,
        "mode": mode,
        "round": round_,
        "router_cpu_us_per_req": cpu,
        "p50_ms": p50,
        "p99_ms": 2 * p50,
        "rps": 1000.0,
    }


def test_cpu_is_paired_within_a_round_for_every_kvstrata_router_and_peer() -> None:
    rows = [
        _row("direct (nginx)", "json", 0, None),
        _row("sglang-router/cache_aware", "json", 0, 200.0),
        _row("kvstrata/kv-aware", "json", 0, 150.0),
        _row("direct (nginx)", "json", 1, None),
        _row("kvstrata/kv-aware", "json", 1, 240.0),
        _row("sglang-router/cache_aware", "json", 1, 200.0),
        _row("direct (nginx)", "json", 2, None),
        _row("kvstrata/kv-aware", "json", 2, 180.0),
        {**_row("sglang-router/cache_aware", "json", 2, 90.0), "problem": "wrong answer"},
    ]
    [p] = _paired_cpu(rows, rounds=3)
    assert (p["router"], p["peer"], p["mode"]) == ("kvstrata/kv-aware", "sglang-router/cache_aware", "json")
    assert p["ratios"] == [0.75, 1.2]  # round 2's peer row failed: no pair
    assert p["mean"] == pytest.approx(0.975)
    assert p["se"] == pytest.approx(0.225)
    assert p["rounds_at_or_under"] == 1


def test_one_round_pairs_nothing() -> None:
    rows = [_row("sglang-router/cache_aware", "json", 0, 200.0), _row("kvstrata/kv-aware", "json", 0, 150.0)]
    assert _paired_cpu(rows, rounds=1) == []


def test_added_latency_is_against_the_same_rounds_straight_run() -> None:
    rows = [
        _row("direct (nginx)", "json", 0, None, p50=0.5),
        _row("kvstrata/kv-aware", "json", 0, 150.0, p50=3.0),
        _row("direct (nginx)", "json", 1, None, p50=1.5),
        _row("kvstrata/kv-aware", "json", 1, 150.0, p50=3.0),
    ]
    _add_overhead(rows)
    assert [r["added_p50_ms"] for r in rows if r["target"] != "direct (nginx)"] == [2.5, 1.5]
