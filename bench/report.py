"""Small pure helpers for figures: percentiles, CPU accounting of a process group, plain-text tables, JSON."""

from __future__ import annotations

import gzip
import json
import math
import os
import platform
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

from kvstrata_dev.testing.engines import cpuinfo_field

T = TypeVar("T")


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def alternating(items: Sequence[T], round_: int) -> Sequence[T]:
    """``items`` in round ``round_``'s order, reversed every other round (ABBA): a drift of the machine's
    speed over a run weighs on each of them alike."""
    return items if round_ % 2 == 0 else items[::-1]


def fmt(value: float | int | str | None, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    if isinstance(value, int):
        return str(value)
    return f"{value:.{digits}f}"


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    line = "  ".join(
        h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(headers, widths, strict=True))
    )
    out = [line, "  ".join("-" * w for w in widths)]
    for row in rows:
        out.append(
            "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))
            )
        )
    return "\n".join(out)


_CLK_TCK = os.sysconf("SC_CLK_TCK")


def group_cpu_seconds(pgid: int) -> float:
    """User+system CPU seconds of every live process in process group `pgid` (threads included)."""
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # Fields after the parenthesised command name; pgrp is field 5, utime/stime are 14/15 (1-based).
        fields = stat[stat.rfind(")") + 2 :].split()
        if int(fields[2]) == pgid:
            total += int(fields[11]) + int(fields[12])
    return total / _CLK_TCK


# The vector extensions a CPU engine's speed, and so every figure, depends on (vLLM's CPU kernels pick
# their path by them); machines of one kind have differed in them.
_ISA_FLAGS = frozenset({"avx2", "avx512f", "avx512_bf16", "amx_tile"})


def _cpu() -> dict[str, Any]:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux: the platform string is all there is
        return {"cpu_model": platform.processor() or None, "cpu_isa": []}
    return {
        "cpu_model": cpuinfo_field(info, "model name"),
        "cpu_isa": sorted(_ISA_FLAGS & set((cpuinfo_field(info, "flags") or "").split())),
    }


def machine() -> dict[str, Any]:
    return {
        "cpus": os.cpu_count(),
        **_cpu(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        # Other work on the machine skews every figure: record how busy it was.
        "loadavg_1m_5m_15m": [round(x, 2) for x in os.getloadavg()],
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def read_json(path: Path) -> Any:
    """A benchmark's JSON as written by :func:`write_json`, or gzipped (``.gz``: the runs kept in
    ``bench/results/``, which a report pools with new ones)."""
    raw = path.read_bytes()
    return json.loads(gzip.decompress(raw) if path.suffix == ".gz" else raw)


def write_json(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n")
