"""Per-engine CPU caps of the router benchmark: the quota arithmetic, and a real cap on a busy process."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from bench.cpuquota import CpuQuotas, QuotaUnavailable, cgroup_root, quota_us
from bench.report import group_cpu_seconds


def test_quota_is_cores_times_period_with_the_kernel_minimum() -> None:
    assert quota_us(0.6) == 60_000
    assert quota_us(2) == 200_000
    assert quota_us(0.001) == 1000
    with pytest.raises(ValueError):
        quota_us(0)


def test_a_capped_busy_process_gets_its_share_and_is_released() -> None:
    try:
        cgroup_root()
    except QuotaUnavailable as exc:
        pytest.skip(str(exc))
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
    quotas = CpuQuotas(0.2, name=f"kvstrata-test-{spin.pid}")
    try:
        group = quotas.cap(0, [spin.pid])
        assert (group / "cgroup.procs").read_text().split() == [str(spin.pid)]
        cpu0, t0 = group_cpu_seconds(spin.pid), time.monotonic()
        time.sleep(1.5)
        share = (group_cpu_seconds(spin.pid) - cpu0) / (time.monotonic() - t0)
        assert share < 0.3  # uncapped it would use a whole core
        quotas.close()
        assert not group.exists() and not group.parent.exists()
        cpu1, t1 = group_cpu_seconds(spin.pid), time.monotonic()
        time.sleep(1.0)
        assert (group_cpu_seconds(spin.pid) - cpu1) / (time.monotonic() - t1) > 0.3  # released
    finally:
        quotas.close()
        spin.kill()
        spin.wait()
