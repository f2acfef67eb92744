"""Sample a Python router under load with py-spy and summarise where its CPU goes.

py-spy's `raw` format is one collapsed stack per line (`frame;frame;...;leaf COUNT`). The summary has
the top frames by self samples (the leaf: where the CPU actually is) and by inclusive samples (any
position: which call paths are expensive). Idle samples are dropped by py-spy itself (no `--idle`).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from bench.procs import BenchError


@dataclass(frozen=True)
class Profile:
    samples: int
    self_top: list[tuple[str, float]]  # (frame, share of samples)
    inclusive_top: list[tuple[str, float]]
    raw_file: str


def summarize(collapsed: str, top: int = 15) -> tuple[int, list[tuple[str, float]], list[tuple[str, float]]]:
    self_counts: Counter[str] = Counter()
    incl_counts: Counter[str] = Counter()
    total = 0
    for line in collapsed.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = stack.split(";")
        total += count
        self_counts[frames[-1]] += count
        for frame in set(frames):
            incl_counts[frame] += count
    if not total:
        return 0, [], []

    def share(c: Counter[str]) -> list[tuple[str, float]]:
        return [(frame, round(n / total, 3)) for frame, n in c.most_common(top)]

    return total, share(self_counts), share(incl_counts)


def record(pid: int, seconds: float, out: Path) -> Profile:
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(py_spy).exists():
        raise BenchError("py-spy not found: `make bench-deps` installs it (pip extra `bench`)")
    argv = [
        py_spy,
        "record",
        "--pid",
        str(pid),
        "--duration",
        str(int(seconds)),
        "--format",
        "raw",
        "--output",
        str(out),
        "--rate",
        "200",
        "--nonblocking",
        "--subprocesses",
    ]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + 60)
    if done.returncode != 0 or not out.exists():
        raise BenchError(f"py-spy failed ({done.returncode}): {(done.stderr or done.stdout).strip()[:300]}")
    total, self_top, incl_top = summarize(out.read_text())
    return Profile(total, self_top, incl_top, str(out))
