"""Hit-rate arithmetic: deltas, counter resets, no traffic, per-tier shares, the window."""

from __future__ import annotations

import pytest

from kvstrata.controller.hitrate import CacheTracker, Counters, HitRates, percent, ratio, reset_aware_delta


def c(queries: float = 0, hits: float = 0, ext_q: float = 0, ext_h: float = 0, **kw: float) -> Counters:
    return Counters(queries=queries, hits=hits, external_queries=ext_q, external_hits=ext_h, **kw)


def test_delta_is_growth_since_previous() -> None:
    assert reset_aware_delta(c(100, 40), c(250, 130)) == c(150, 90)


def test_counter_that_went_down_counts_from_zero() -> None:
    # The process restarted between scrapes: what it shows now is all it counted since.
    assert reset_aware_delta(c(1000, 900), c(30, 10)) == c(30, 10)


def test_one_reset_counter_resets_all() -> None:
    # hits went down but queries grew past the old value: still one process, restarted
    assert reset_aware_delta(c(100, 90), c(120, 5)) == c(120, 5)


def test_known_restart_counts_from_zero_even_if_counters_grew() -> None:
    assert reset_aware_delta(c(10, 5), c(500, 400), restarted_since=True) == c(500, 400)


def test_no_previous_counts_everything() -> None:
    assert reset_aware_delta(None, c(7, 3)) == c(7, 3)


def test_no_traffic_is_none_not_zero() -> None:
    rates = HitRates.of(Counters())
    assert rates.hit_rate is None
    assert rates.gpu_hit_rate is None
    assert all(v is None for v in rates.tier_hit_rates.values())
    assert ratio(0, 0) is None
    assert ratio(0, 10) == 0.0


def test_tiers_are_shares_of_all_queries_and_add_up() -> None:
    counters = c(1000, 500, ext_q=500, ext_h=200, cpu_hits=150, nvme_hits=50)
    rates = HitRates.of(counters)
    assert rates.gpu_hit_rate == pytest.approx(0.5)
    assert rates.external_hit_rate == pytest.approx(0.2)
    assert rates.hit_rate == pytest.approx(rates.gpu_hit_rate + rates.external_hit_rate)
    assert rates.tier_hit_rates["cpu"] == pytest.approx(0.15)
    assert rates.tier_hit_rates["nvme"] == pytest.approx(0.05)
    assert rates.tokens_from_cache == 700
    assert rates.queried_tokens == 1000


def test_first_scrape_is_a_baseline_for_the_window_but_counts_in_total() -> None:
    t = CacheTracker(window_seconds=60)
    t.observe(0, {"a": c(1000, 600), "b": c(1000, 200)})
    assert t.window_rates().hit_rate is None
    assert t.total_rates().hit_rate == pytest.approx(0.4)


def test_window_rate_from_deltas_across_pods() -> None:
    t = CacheTracker(window_seconds=60)
    t.observe(0, {"a": c(1000, 600), "b": c(1000, 200)})
    t.observe(15, {"a": c(1100, 690), "b": c(1300, 470)})
    # a: +100/+90, b: +300/+270 -> 360/400
    assert t.window_rates().hit_rate == pytest.approx(0.9)
    assert t.total_rates().hit_rate == pytest.approx(1160 / 2400)


def test_idle_window_is_none_after_traffic_ages_out() -> None:
    t = CacheTracker(window_seconds=30)
    t.observe(0, {"a": c(0, 0)})
    t.observe(10, {"a": c(100, 50)})
    assert t.window_rates().hit_rate == pytest.approx(0.5)
    for now in (40, 50, 60, 75):
        t.observe(now, {"a": c(100, 50)})
    assert t.window().queries == 0
    assert t.window_rates().hit_rate is None
    assert t.total_rates().hit_rate == pytest.approx(0.5)


def test_window_spans_its_full_length() -> None:
    t = CacheTracker(window_seconds=30)
    for now, q in ((0, 0), (10, 100), (20, 200), (30, 300), (40, 400)):
        t.observe(now, {"a": c(q, q / 2)})
    # samples at or after 40-30=10 plus the one at the window start
    assert t.window().queries == pytest.approx(300)


def test_restarted_pod_does_not_make_a_negative_window() -> None:
    t = CacheTracker(window_seconds=300)
    t.observe(0, {"a": c(5000, 4000), "b": c(100, 0)})
    t.observe(15, {"a": c(40, 30), "b": c(200, 50)})
    w = t.window()
    assert w.queries == pytest.approx(40 + 100)
    assert w.hits == pytest.approx(30 + 50)
    assert t.total.queries == pytest.approx(5000 + 100 + 40 + 100)


def test_restart_detected_by_start_time() -> None:
    t = CacheTracker(window_seconds=300)
    t.observe(0, {"a": c(10, 5)}, start_times={"a": 1.0})
    t.observe(15, {"a": c(500, 400)}, start_times={"a": 2.0})
    assert t.window().queries == pytest.approx(500)


def test_pod_missing_from_one_scrape_is_not_double_counted() -> None:
    t = CacheTracker(window_seconds=300)
    t.observe(0, {"a": c(100, 50), "b": c(100, 50)}, alive={"a", "b"})
    t.observe(15, {"a": c(200, 150)}, alive={"a", "b"})  # b's scrape failed
    t.observe(30, {"a": c(200, 150), "b": c(150, 100)}, alive={"a", "b"})
    assert t.window().queries == pytest.approx(100 + 50)


def test_new_pod_after_baseline_counts_from_zero_and_gone_pods_are_forgotten() -> None:
    t = CacheTracker(window_seconds=300)
    t.observe(0, {"a": c(100, 50)}, alive={"a"})
    t.observe(15, {"b": c(40, 20)}, alive={"b"})
    assert "a" not in t.last
    assert t.window().queries == pytest.approx(40)


def test_time_going_backwards_is_refused() -> None:
    t = CacheTracker()
    t.observe(10, {})
    with pytest.raises(ValueError, match="backwards"):
        t.observe(5, {})


def test_percent() -> None:
    assert percent(None) is None
    assert percent(0.0) == 0
    assert percent(0.876) == 88
    assert percent(1.0) == 100
