"""bench-decision routes bench-proxy's requests through a real router in process; one small run, to keep
the benchmark working (its figures are not asserted: speed lives in the benchmark, not in tests)."""

from __future__ import annotations

import argparse

from bench.decision_bench import PHASES, render, run


def test_a_small_run_routes_every_request_and_renders_a_row_per_policy() -> None:
    args = argparse.Namespace(
        policies="kv-aware,round-robin", requests=120, warmup=20, in_flight=8, engines=3, rounds=3
    )
    payload = run(args)
    rows = {r["policy"]: r for r in payload["rows"]}
    assert set(rows) == {"kv-aware", "round-robin"}
    # kv-aware tokenized and hashed every prompt (the tiny tokenizer is real); round-robin hashes none.
    assert rows["kv-aware"]["hashed"] == 120
    assert rows["round-robin"]["hashed"] == 0
    for r in rows.values():
        assert r["requests"] == 120 and set(r["phase_us"]) == set(PHASES)
        # Each policy ran once a round; the figure shown is the median round's.
        assert len(r["cpu_us_rounds"]) == 3
        assert r["cpu_us_per_request"] == sorted(r["cpu_us_rounds"])[1]
    out = render(payload)
    assert "kv-aware" in out and "round-robin" in out and len(out.splitlines()) == 5
