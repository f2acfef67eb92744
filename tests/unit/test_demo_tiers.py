"""The demo's per-tier table and its tier workload (pure parts of kvstrata_dev.e2e.demo / workload)."""

from __future__ import annotations

from kvstrata_dev.e2e import workload
from kvstrata_dev.e2e.demo import tier_table


def test_tier_table_shows_each_configured_tier_its_own_rate() -> None:
    ic = {
        "spec": {"kvCache": {"tiers": {"gpu": {}, "cpu": {"size": "24Mi"}, "nvme": {"size": "256Mi"}}}},
        "status": {
            "cache": {"gpuHitRate": 0.30, "cpuHitRate": 0.125, "nvmeHitRate": 0.20, "hitRate": 0.625},
        },
    }
    rows = {line.split("  ")[0]: line for line in tier_table(ic).splitlines()}
    assert rows["gpu (engine KV pool)"].endswith("30.0%")
    assert rows["cpu (DRAM offload)"].endswith("12.5%")
    assert rows["nvme (fs offload)"].endswith("20.0%")
    assert rows["all tiers"].endswith("62.5%")


def test_tier_table_marks_unconfigured_tiers() -> None:
    ic = {
        "spec": {"kvCache": {"tiers": {"gpu": {}}}},
        "status": {"cache": {"gpuHitRate": 0.5, "cpuHitRate": 0}},
    }
    rows = {line.split("  ")[0]: line for line in tier_table(ic).splitlines()}
    assert rows["cpu (DRAM offload)"].split()[-2:] == ["no", "-"]
    assert rows["nvme (fs offload)"].split()[-2:] == ["no", "-"]


def test_tier_revisit_requests_revisit_at_the_given_distances() -> None:
    reqs = workload.tier_revisit_requests(new=12, revisits=(1, 6, 11))  # not the defaults: easier to read
    firsts = [r.group for r in reqs if r.prompt == workload.distinct_prompt(r.group)]
    assert len(reqs) == 12 + 11 + 6 + 1
    assert len({r.prompt for r in reqs}) == 12  # only the 12 distinct prompts, revisited
    assert firsts[:2] == [0, 1]
    # After new prompt 11 come its revisits: 10, 5 and 0.
    i = next(k for k, r in enumerate(reqs) if r.group == 11)
    assert [r.group for r in reqs[i : i + 4]] == [11, 10, 5, 0]
