"""bench-router's options and report: seeds as rounds, the default open loop and CPU share, the
per-round table (pure functions; the benchmark itself runs real engines and is not a test)."""

from __future__ import annotations

from typing import Any

import pytest
from bench import router_bench as rb
from bench.client import Result
from bench.cpuquota import QuotaUnavailable
from bench.engine_metrics import EngineDelta


@pytest.fixture(autouse=True)
def _no_bench_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("BENCH_SEEDS", "BENCH_SEED", "BENCH_ROUNDS", "BENCH_ARRIVAL_RATE", "BENCH_ENGINE_CPU"):
        monkeypatch.delenv(name, raising=False)


def test_defaults_are_open_loop_over_ten_seeds_with_cpu_share_auto() -> None:
    args = rb.parse_args([])
    assert args.seeds == [7, 11, 12, 13, 14, 21, 22, 23, 24, 25]
    assert args.rounds == 1
    assert args.arrival_rate == 0.4
    assert args.engine_cpu is None  # auto


def test_one_seed_from_bench_seed_and_bench_seeds_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BENCH_SEED", "11")
    assert rb.parse_args([]).seeds == [11]
    monkeypatch.setenv("BENCH_SEEDS", "3, 4")
    assert rb.parse_args([]).seeds == [3, 4]
    assert rb.parse_args(["--seeds", "9"]).seeds == [9]


@pytest.mark.parametrize(
    ("raw", "says"),
    [("7,x", "comma-separated integers"), (",", "at least one seed"), ("7,7", "--rounds")],
)
def test_bad_seeds_are_refused_with_the_reason(
    raw: str, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        rb.parse_args(["--seeds", raw])
    assert says in capsys.readouterr().err


def test_engine_cpu_takes_cores_zero_or_auto(capsys: pytest.CaptureFixture[str]) -> None:
    assert rb.parse_args(["--engine-cpu", "0.5"]).engine_cpu == 0.5
    assert rb.parse_args(["--engine-cpu", "0"]).engine_cpu == 0.0
    assert rb.parse_args(["--engine-cpu", "auto"]).engine_cpu is None
    for bad in ("-1", "lots"):
        with pytest.raises(SystemExit):
            rb.parse_args(["--engine-cpu", bad])
    assert "--engine-cpu" in capsys.readouterr().err


def test_auto_caps_where_cgroups_allow_and_says_why_not(monkeypatch: pytest.MonkeyPatch) -> None:
    def unavailable() -> None:
        raise QuotaUnavailable("/sys/fs/cgroup/cpu is not writable")

    monkeypatch.setattr(rb, "cgroup_root", unavailable)
    assert rb.resolve_engine_cpu(None) == (0.0, "/sys/fs/cgroup/cpu is not writable")
    # An explicit request is kept; capping then fails loudly instead of running uncapped.
    assert rb.resolve_engine_cpu(0.5) == (0.5, None)
    monkeypatch.setattr(rb, "cgroup_root", lambda: None)
    assert rb.resolve_engine_cpu(None) == (rb.AUTO_ENGINE_CPU, None)


def _workload(seed: int, tokens: int, ideal: float, working_set: int) -> rb._Workload:
    info = {
        "seed": seed,
        "requests": 54,
        "prompt_tokens_total": tokens,
        "longest_prompt_tokens": 900,
        "working_set_blocks": working_set,
        "ideal_hit_rate": ideal,
        "last_arrival_s": 40.0 + seed,
    }
    return rb._Workload(seed, [], None, info)


def test_workload_info_pools_the_ceiling_by_prompt_tokens() -> None:
    args = rb.parse_args(["--seeds", "1,2"])
    info = rb._workload_info([_workload(1, 1000, 0.8, 260), _workload(2, 3000, 0.6, 270)], args)
    assert info["seeds"] == [1, 2]
    assert info["ideal_hit_rate"] == pytest.approx((800 + 1800) / 4000)
    assert info["working_set_blocks"] == 270  # engines are sized for the largest
    assert info["last_arrival_s"] == 42.0
    assert info["concurrency"] is None and info["arrival_rate"] == 0.4
    assert [s["seed"] for s in info["by_seed"]] == [1, 2]


def _round(seed: int, ttfts_s: list[float]) -> rb._Round:
    results = [Result(cid=i, turn=0, ok=True, ttft_s=t, latency_s=t + 0.1) for i, t in enumerate(ttfts_s)]
    rows = [EngineDelta(f"http://e{i}", 50.0, 100.0, 2.0, 100.0, 0.0) for i in range(3)]
    return rb._Round(seed, results, rows, 10.0, 1.0, [], 0.5)


def test_report_has_one_row_per_seed_with_mean_and_p99() -> None:
    a = rb._summarize("a", [_round(7, [1.0, 3.0]), _round(11, [2.0, 2.0])])
    b = rb._summarize("b", [_round(7, [4.0, 4.0]), _round(11, [1.0, 1.0])])
    assert a["seed_by_round"] == [7, 11]
    assert a["ttft_ms_mean_by_round"] == [2000.0, 2000.0]
    assert a["ttft_ms_p99_by_round"][0] == pytest.approx(2980.0, abs=20)
    assert a["hit_rate"] == 0.5 and a["split_max_over_mean"] == 1.0
    text = rb._by_round_table([a, b, {"router": "c", "problem": "did not start"}])
    assert text is not None
    lines = text.splitlines()
    assert "a" in lines[0] and "b" in lines[0] and "c" not in lines[0]
    assert "1 (7)" in text and "2 (11)" in text
    assert "4000 / 4000" in text and "1000 / 1000" in text
    assert rb._by_round_table([rb._summarize("a", [_round(7, [1.0])])]) is None


def test_render_names_seeds_and_shared_cores() -> None:
    payload: dict[str, Any] = {
        "machine": {"cpus": 2, "loadavg_1m_5m_15m": [0.1, 0, 0], "loadavg_at_end": [2.0, 0, 0]},
        "engines": {"count": 3, "blocks_each": 122, "ready_s": 70.0, "cpu_each": None},
        "workload": rb._workload_info([_workload(7, 1000, 0.8, 270)], rb.parse_args(["--seeds", "7"])),
        "rounds": 2,
        "skipped": {},
        "results": [rb._summarize("a", [_round(7, [1.0]), _round(7, [2.0])])],
        "total_s": 100.0,
    }
    text = rb.render(payload)
    assert "x 2 rounds (seeds 7)" in text
    assert "sharing the cores" in text
    assert "open loop (0.4 conversations/s" in text
    assert "per round" in text
