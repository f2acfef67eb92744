"""bench-admission holds requests at the real gate over the real index and reports what weighing them
costs; one small run, to keep the benchmark working (its figures are not asserted: speed lives in the
benchmark, not in tests)."""

from __future__ import annotations

import argparse

from bench.admission_bench import render, run


def test_a_small_run_holds_what_it_says_and_renders_a_row_per_count() -> None:
    args = argparse.Namespace(held="3,40", engines=3, running=2, pool=256)
    payload = run(args)
    assert [r["held"] for r in payload["rows"]] == [3, 40]
    for row in payload["rows"]:
        # Every count is held before it is measured (the run asserts it), and a pass looks each one up
        # at most once.
        assert 0 < row["pump_lookups"] <= row["held"]
    out = render(payload)
    assert "held" in out and "idle cpu ms/s" in out and len(out.splitlines()) == 6
