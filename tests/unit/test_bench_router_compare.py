"""The round-by-round comparison of bench-router runs (pure functions over the JSON it writes)."""

from __future__ import annotations

import math
from typing import Any

from bench.router_compare import burst_profile, paired_differences, summarize


def result(router: str, by_round: list[float], detail: list[list[Any]] | None = None) -> dict[str, Any]:
    return {
        "router": router,
        "rounds": len(by_round),
        "ttft_ms_mean_by_round": by_round,
        "requests_detail": detail or [],
        "engines": [{"queries": 1000.0, "hits": 600.0}, {"queries": 1000.0, "hits": 800.0}],
        "wall_s": 10.0,
    }


def test_burst_profile_splits_the_opening_burst_from_the_rest() -> None:
    detail = [[0, 1, 0, 0.0, 4000.0], [0, 2, 0, 0.05, 6000.0], [0, 1, 1, 3.0, 1000.0], [1, 1, 0, 0.0, 5000.0]]
    b = burst_profile(result("a", [1.0, 2.0], detail))
    assert b["uncached_tokens_per_s"] == 600 / 2 / 10
    assert b["burst_max_s_by_round"] == [6.0, 5.0]
    assert b["burst_mean_ms"] == 5000.0
    assert b["later_mean_ms"] == 1000.0


def test_paired_differences_use_only_runs_with_both_routers() -> None:
    runs = [
        {"results": [result("a", [100.0, 200.0]), result("b", [150.0, 150.0])]},
        {"results": [result("a", [300.0])]},  # no "b": not paired
        {"results": [result("b", [400.0]), result("a", [350.0])]},
    ]
    diffs = paired_differences(runs, "a", "b")
    assert diffs == [-50.0, 50.0, -50.0]
    n, lower, m, se = summarize(diffs) or (0, 0, 0.0, 0.0)
    assert (n, lower) == (3, 2)
    assert math.isclose(m, -50 / 3)
    assert math.isclose(se, math.sqrt(((100 / 3) ** 2 * 2 + (200 / 3) ** 2) / 2) / math.sqrt(3))
    assert summarize([1.0]) is None


def test_paired_differences_of_another_per_round_figure() -> None:
    a, b = result("a", [1.0]), result("b", [1.0])
    a["ttft_ms_p99_by_round"], b["ttft_ms_p99_by_round"] = [900.0, 1000.0], [1000.0, 800.0]
    runs = [{"results": [a, b]}, {"results": [result("a", [1.0]), result("b", [2.0])]}]  # older: no p99
    assert paired_differences(runs, "a", "b", "ttft_ms_p99_by_round") == [-100.0, 200.0]
