"""bench/overhead_bench.py's pure parts: which short prompts ran beside a huge one, and its table."""

from __future__ import annotations

from bench.overhead_bench import in_flight_since, render_beside_huge

_SPANS = [(10.0, 12.0, 200), (12.5, 15.0, 200)]


def test_a_short_prompt_is_beside_a_huge_one_only_when_wholly_inside_its_flight() -> None:
    assert in_flight_since((10.5, 10.6), _SPANS) == 10.0
    assert in_flight_since((13.0, 14.9), _SPANS) == 12.5
    assert in_flight_since((11.9, 12.1), _SPANS) is None  # it outlived the first huge request
    assert in_flight_since((12.1, 12.4), _SPANS) is None  # between two
    assert in_flight_since((14.9, 15.1), _SPANS) is None


_ROW = {
    "router": "kvstrata/kv-aware",
    "idle_p50_ms": 3.1,
    "idle_p90_ms": 4.0,
    "beside_p50_ms": 4.5,
    "beside_p90_ms": 9.0,
    "beside_p99_ms": 15.0,
    "beside_max_ms": 40.0,
    "beside": 900,
    "short_timed": 901,
    "huge_done": 2,
    "huge_p50_s": 3.5,
    "errors": 0,
    "huge_errors": 1,
    "huge_statuses": [200, 413],
}
_SETTINGS = {"short_tokens": 256, "huge_chars": 4_000_000, "huge_seconds": 8.0}


def test_the_table_names_every_router_with_its_figures_and_huge_errors() -> None:
    text = render_beside_huge([_ROW], _SETTINGS)
    assert "4,000,000-character" in text
    line = next(ln for ln in text.splitlines() if ln.startswith("kvstrata/kv-aware"))
    for cell in (
        "3.10 / 4.00",
        "4.50 / 9.00 / 15.00 / 40.00",
        "900 of 901",
        "2 (3.50)",
        "0 / 1 (HTTP [200, 413])",
    ):
        assert cell in line, (cell, line)
    assert " - " in line  # a run from before the control had none


def test_the_control_stands_beside_the_short_prompts_timed_beside_a_huge_one() -> None:
    row = {
        **_ROW,
        "control": 7000,
        "control_p50_ms": 0.5,
        "control_p90_ms": 0.8,
        "control_p99_ms": 1.2,
        "control_max_ms": 12.5,
    }
    line = next(ln for ln in render_beside_huge([row], _SETTINGS).splitlines() if ln.startswith("kvstrata/"))
    assert "0.50 / 0.80 / 1.20 / 12.50 (7000)" in line and "4.50 / 9.00 / 15.00 / 40.00" in line
