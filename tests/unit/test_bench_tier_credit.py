"""bench-tier-credit classifies each send by the engine's own counters and scores it against its round."""

from __future__ import annotations

from typing import Any

import pytest
from bench.tier_credit_bench import credit, render, served_by, summarize

from kvstrata.controller.hitrate import Counters


def test_a_send_counts_for_the_tier_that_served_nearly_all_of_it() -> None:
    assert served_by(Counters(), 1008) == "cold"
    assert served_by(Counters(hits=1008), 1008) == "gpu"
    assert served_by(Counters(cpu_hits=1000), 1008) == "cpu"
    assert served_by(Counters(nvme_hits=912), 1008) == "nvme"
    # Split between tiers, or partly cold: not a clean measurement of any one tier.
    assert served_by(Counters(hits=500, nvme_hits=508), 1008) is None
    assert served_by(Counters(cpu_hits=100), 1008) is None


def test_credit_is_the_share_of_the_cold_to_gpu_gap_saved() -> None:
    assert credit(1.0, 0.2, 0.2) == 1.0
    assert credit(1.0, 0.2, 1.0) == 0.0
    assert abs(credit(1.0, 0.2, 0.6) - 0.5) < 1e-9  # type: ignore[operator]
    assert credit(1.0, 0.2, 1.4) < 0  # type: ignore[operator]  # slower than cold: a cost, shown as such
    assert credit(0.2, 0.2, 0.1) is None  # no gap to measure against


def _send(ms: float, by: str | None) -> dict[str, Any]:
    return {"ttft_s": ms / 1000, "served_by": by}


def test_summary_uses_clean_sends_of_clean_rounds_only() -> None:
    rounds = [
        {
            "cold": _send(100, "cold"),
            "gpu": _send(20, "gpu"),
            "cpu": _send(40, "cpu"),
            "nvme": _send(60, "nvme"),
        },
        {
            "cold": _send(120, "cold"),
            "gpu": _send(20, "gpu"),
            "cpu": _send(70, "cpu"),
            "nvme": _send(90, None),
        },
        # The pool still held the prompt at the cpu step: that send says nothing about the CPU tier.
        {
            "cold": _send(100, "cold"),
            "gpu": _send(20, "gpu"),
            "cpu": _send(20, "gpu"),
            "nvme": _send(60, "nvme"),
        },
    ]
    payload = {
        "rounds": rounds,
        "prompt_tokens": 1024,
        "engine": {"pool_blocks": 160, "cpu_tier_mib": 40, "cpu_tier_blocks": 320},
        "reset_prefix_cache": {"status": 200, "then_served_by": "nvme"},
        "total_s": 1.0,
    }
    s = summarize(payload)
    assert s["cpu"]["clean"] == 2 and s["nvme"]["clean"] == 2 and s["gpu"]["clean"] == 3
    assert (s["cpu"]["credit_min"], s["cpu"]["credit_max"]) == pytest.approx((0.5, 0.75))
    assert s["nvme"]["credit_median"] == pytest.approx(0.5)
    text = render(payload)
    assert "reset_prefix_cache: HTTP 200; the prompt then came from nvme" in text
    assert "2/3" in text
