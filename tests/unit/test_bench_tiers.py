"""bench-router-tiers gives its tiered engines the offloading config the operator renders for device cpu."""

from __future__ import annotations

import json
from pathlib import Path

from bench.tiers_bench import render, tier_args
from helpers import example

from kvstrata.api.manifest import validate
from kvstrata.planner import plan


def test_tier_args_match_the_rendered_transfer_config(tmp_path: Path) -> None:
    ic = validate(example("tiny-cpu-tiered.yaml"))
    argv = plan(ic.spec).engine_args
    rendered = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    ours = json.loads(tier_args(24 << 20, tmp_path)[1])
    assert ours["kv_connector"] == rendered["kv_connector"]
    mine, theirs = ours["kv_connector_extra_config"], rendered["kv_connector_extra_config"]
    for key in ("spec_name", "spec_module_path", "cpu_bytes_to_use"):
        assert mine[key] == theirs[key], key
    (fs,) = mine["secondary_tiers"]
    assert fs["type"] == "fs" and fs["root_dir"] == str(tmp_path) and fs["enable_kv_events"] is True


def test_render_prints_each_tier() -> None:
    row = {
        "router": "kvstrata/kv-aware [pool + cpu + nvme]",
        "all_tier_hit_rate": 0.7,
        "tier_hit_rates": {"gpu": 0.4, "cpu": 0.1, "nvme": 0.2},
        "ttft_ms": {"p50": 100.0, "p99": 900.0, "mean": 200.0},
        "errors": 0,
    }
    payload = {
        "results": [row],
        "engines": {"count": 3, "blocks_each": 64},
        "workload": {"requests": 10, "seeds": [7]},
        "tiers": {"cpu_mib": 24},
        "total_s": 1.0,
    }
    line = next(ln for ln in render(payload).splitlines() if ln.startswith("kvstrata/kv-aware"))
    assert line.split()[-8:] == ["70.0", "40.0", "10.0", "20.0", "100", "900", "200", "0"]
