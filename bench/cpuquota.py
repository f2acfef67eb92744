"""A fixed CPU share per engine, so CPU engines on one machine behave like pods with a GPU each.

Three vLLM CPU engines on a 2-core machine share the cores: an engine with work runs faster while the
others idle, so spreading requests over engines buys no capacity and the benchmark rewards piling work on
one engine. On a real cluster every engine has its own accelerator, and an idle one's compute is simply
unused. A CFS quota per engine (cgroup v1 ``cpu`` controller, or cgroup v2) gives each engine a fixed
share whatever the others do, which is that situation in small.

Needs a writable cgroup ``cpu`` hierarchy (root on this machine); :func:`cgroup_root` says where, or why
not (the benchmark then stops with that reason rather than run uncapped).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

PERIOD_US = 100_000
_V1 = Path("/sys/fs/cgroup/cpu")
_V2 = Path("/sys/fs/cgroup")


class QuotaUnavailable(RuntimeError):
    pass


def quota_us(cores: float, period_us: int = PERIOD_US) -> int:
    """CFS quota for ``cores`` CPUs per period (the kernel's minimum quota is 1 ms)."""
    if cores <= 0:
        raise ValueError(f"cores must be > 0, got {cores}")
    return max(1000, round(cores * period_us))


def _v2_has_cpu() -> bool:
    control = _V2 / "cgroup.subtree_control"
    return control.exists() and "cpu" in control.read_text().split()


def cgroup_root() -> tuple[Path, int]:
    """(parent directory for new groups, cgroup version) or QuotaUnavailable with the reason."""
    if (_V1 / "cpu.cfs_quota_us").exists():
        root, version = _V1, 1
    elif _v2_has_cpu():
        root, version = _V2, 2
    else:
        raise QuotaUnavailable("no cgroup cpu controller (neither /sys/fs/cgroup/cpu nor cpu in cgroup v2)")
    if not os.access(root, os.W_OK):
        raise QuotaUnavailable(f"{root} is not writable (run as root to cap each engine's CPU)")
    return root, version


@dataclass
class CpuQuotas:
    """One capped cgroup per engine process group; :meth:`close` moves the processes back and removes them."""

    cores: float
    name: str = f"kvstrata-bench-{os.getpid()}"
    _groups: list[Path] = field(default_factory=list)
    _root: Path | None = None

    def cap(self, index: int, pids: Iterable[int]) -> Path:
        root, version = cgroup_root()
        self._root = root
        group = root / self.name / f"engine-{index}"
        group.mkdir(parents=True, exist_ok=True)
        if version == 1:
            (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (group / "cpu.cfs_quota_us").write_text(str(quota_us(self.cores)))
        else:
            (root / self.name / "cgroup.subtree_control").write_text("+cpu")
            (group / "cpu.max").write_text(f"{quota_us(self.cores)} {PERIOD_US}")
        for pid in pids:
            try:
                (group / "cgroup.procs").write_text(str(pid))
            except ProcessLookupError:
                continue  # exited meanwhile
        self._groups.append(group)
        return group

    def close(self) -> None:
        if self._root is None:
            return
        for group in self._groups:
            # Lift the cap first: a task moved out while its group is throttled stalls ~1 s (seen here).
            if (group / "cpu.cfs_quota_us").exists():
                (group / "cpu.cfs_quota_us").write_text("-1")
            else:
                (group / "cpu.max").write_text(f"max {PERIOD_US}")
            for pid in (group / "cgroup.procs").read_text().split():
                try:
                    (self._root / "cgroup.procs").write_text(pid)
                except (ProcessLookupError, OSError):
                    continue
            group.rmdir()
        self._groups.clear()
        parent = self._root / self.name
        if parent.exists():
            parent.rmdir()
