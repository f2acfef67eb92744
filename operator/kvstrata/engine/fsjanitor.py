"""Keeps vLLM's fs KV tier (the NVMe PVC) under its byte budget: vLLM neither bounds nor evicts it.

Runs as a sidecar in the engine pod (`python -m kvstrata.engine.fsjanitor --root /kv-cache ...`), not as
a thread in the engine: walking a directory of many files every second would take the GIL from vLLM's
scheduler process, and a sidecar keeps the bound while the engine restarts (the PVC outlives it).

Eviction is least recently used by `max(atime, mtime)` of each block file: exact on `strictatime`
mounts; under the usual `relatime` the first read after a write counts; under `noatime` it is oldest
written first. Only finished block files (`*.bin`) are evicted; vLLM's in-flight temp files and its
run config count towards the bytes but are never removed.

Safe against a file being read: vLLM's fs tier opens a block by path, reads it, closes it. Unlinking
an open file on Linux leaves the reader's descriptor valid, so a read in progress completes; a lookup
after the unlink sees no file (`os.path.exists`) and is a miss; a load scheduled on an earlier lookup
fails to open, and vLLM marks those keys a miss and recomputes them (tiering/fs/manager.py
`get_finished_jobs`, tiering/manager.py `_complete_promotion`) — never an engine error.

The router learns of the evictions from the janitor (vLLM publishes a STORAGE BlockStored for each block
file it writes but never a BlockRemoved, as it never deletes one): the janitor keeps the 64-bit block hash
of every file it evicted in a bounded log and serves it at `GET /evictions?after=<n>` next to `/metrics`;
the router polls it and drops those STORAGE entries from its index (router/storage_evictions.py). A block
file is named by the block's full hash in hex (vllm/v1/kv_offload/file_mapper.py) and KV events carry its
low 64 bits (`maybe_convert_block_hash`), so the name alone gives the event's hash.

A full PVC does not crash the engine either: a store that hits ENOSPC raises in vLLM's I/O thread, the
job is reported failed and logged ("block I/O failed"), the temp file is removed, and the CPU tier
keeps the block. The budget (the planner's 90% of the PVC) leaves room beyond it; under the budget, the
eviction marks keep room for the growth until the next pass at the fastest rate seen, and at the rate
the tier grew lately for as long again as passes have lately woken late; passes come sooner as the
fastest rate rises (see `pacing`, `recent_rate`, `lateness` and `choose_victims`).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

BLOCK_SUFFIX = ".bin"
# Start evicting above this share of the budget, stop below LOW_WATER: the gap absorbs the blocks
# written between two scans, so the directory stays under the budget itself.
HIGH_WATER = 0.85
LOW_WATER = 0.70
# The sidecar's metrics (port 9402): the dashboard and tests name them from here.
METRIC_USED = "kvstrata_fs_tier_used_bytes"
METRIC_BUDGET = "kvstrata_fs_tier_budget_bytes"
METRIC_EVICTED_BYTES = "kvstrata_fs_tier_evicted_bytes"  # counters: exported with a _total suffix
METRIC_EVICTED_FILES = "kvstrata_fs_tier_evicted_files"
EVICTIONS_PATH = "/evictions"
# Evicted block hashes kept for the router to fetch: at a poll a second, far more than a pass evicts.
EVICTION_LOG_SIZE = 1 << 16
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class KvFile:
    path: str
    size: int
    last_used: float
    evictable: bool


@dataclass(frozen=True)
class Eviction:
    """What one pass decided: the files to remove and the directory's bytes before and after."""

    victims: tuple[KvFile, ...]
    used_bytes: int
    after_bytes: int


def choose_victims(
    files: Iterable[KvFile],
    budget_bytes: int,
    high: float = HIGH_WATER,
    low: float = LOW_WATER,
    reserve_bytes: int = 0,
) -> Eviction:
    """The least recently used block files to remove so that usage falls to the low mark, when it is
    above the high mark; nothing otherwise. Pure: no I/O.

    The marks are `high`/`low` x budget, lowered so that `reserve_bytes` (the most the tier grew between
    two passes) still fits under the budget before the next pass: the directory stays under the budget
    as long as no pass-to-pass burst exceeds the largest one seen."""
    if not 0 < low <= high <= 1:
        raise ValueError(f"need 0 < low <= high <= 1, got low={low} high={high}")
    all_files = list(files)
    used = sum(f.size for f in all_files)
    trigger = min(budget_bytes * high, budget_bytes - reserve_bytes)
    if used <= trigger:
        return Eviction((), used, used)
    target = max(0.0, min(budget_bytes * low, budget_bytes - 2 * reserve_bytes))
    victims: list[KvFile] = []
    after = used
    for f in sorted((f for f in all_files if f.evictable), key=lambda f: (f.last_used, f.path)):
        if after <= target:
            break
        victims.append(f)
        after -= f.size
    return Eviction(tuple(victims), used, after)


# Passes come at most this often, however fast the tier grows. It binds only where a budget is small
# against the write rate (tests: 24 MiB at 100+ MB/s); at 50 ms a faster machine could write a whole such
# budget between two passes. A pass over a few hundred files takes ~1 ms.
MIN_INTERVAL_S = 0.01
# Between two passes the tier may grow by at most this share of the budget at the fastest rate seen. The
# high mark leaves three such periods of room under the budget: at a tenth (one and a half periods) a
# clean-clone CI run saw one engine's directory 4.6% over its 60 MB budget, once in 85 samples, from a
# pass later or a burst faster than any seen before it.
PASS_GROWTH_SHARE = 0.05


def pacing(
    budget_bytes: int,
    max_rate: float,
    interval_s: float,
    work_s: float = 0.0,
    late_s: float = 0.0,
    rate: float | None = None,
) -> tuple[float, int]:
    """Seconds to sleep before the next pass, and the bytes to keep free for the growth until then.

    A fixed interval bounds the directory only while less than the budget is written between two passes:
    a CPU engine writes its fs tier at ~100 MB/s (measured), which at 1 s overran a 60 MB budget in the
    e2e test, and a reserve for a whole second's writes left nothing cached. So passes come sooner as the
    fastest growth rate seen (bytes/s) rises: one period (the sleep plus a pass's own ``work_s``) grows
    the tier by at most `PASS_GROWTH_SHARE` of the budget, and half as much again is kept free. A pass can also wake
    later than it asked, on a machine whose cores the engine keeps busy: ``late_s``, the lateness seen
    lately, is kept free on top: half a period's growth covers only a pass late by half a period.

    The room for the period the janitor plans is kept at the fastest rate seen, since a burst can start
    at any moment; the room for what a busy machine adds to that period (the pass's own work and the
    lateness) at ``rate``, how fast the tier grew lately (`recent_rate`; the fastest rate seen when not
    given). A restarting engine writes nothing and keeps both cores busy: its lateness at the burst rate
    of ~400 MB/s once asked for more room than the whole budget, and a pass evicted every block file the
    restart was to read back. Pure: no I/O."""
    if max_rate <= 0:
        return interval_s, 0
    sleep = min(interval_s, max(MIN_INTERVAL_S, PASS_GROWTH_SHARE * budget_bytes / max_rate - work_s))
    lately = max_rate if rate is None else min(rate, max_rate)
    return sleep, math.ceil(max_rate * 1.5 * sleep + lately * (1.5 * work_s + late_s))


# How long a growth rate is remembered once the tier stops growing (the time constant of its fade): it
# spans the gaps between one engine's bursts of writes under load (a prompt's prefill, under a second),
# and seconds after the last write a stalled pass keeps little room for writes that are not coming. A
# pass after a long stall has itself faded the rate by the stall's length, so lateness x rate stays small.
RATE_MEMORY_S = 1.0


def recent_rate(previous: float, observed: float, elapsed_s: float) -> float:
    """The tier's recent growth rate after a pass that saw it grow at ``observed`` bytes/s over
    ``elapsed_s``: that rate, or the earlier one fading with time, whichever is higher (so never below
    zero while the tier shrinks: ``previous`` starts at 0). Pure."""
    return max(observed, previous * math.exp(-elapsed_s / RATE_MEMORY_S))


# How lateness is remembered: the largest seen, shrinking by this factor a pass (about a minute at 1 s
# passes, a second or two while a growing tier brings passes every 10-60 ms), so one stall keeps room for
# the next for a while and a machine that calms down gets it back. Not in wall-clock time: remembered for
# a minute (tried), the lateness of a busy workload met the burst rate of the next prompt's writes after
# it, the room for the two exceeded the budget, and each pass evicted every block file (the e2e restart
# test's prompt never stayed on the PVC).
LATE_DECAY = 0.98


def lateness(seen_s: float, planned_s: float, slept_s: float) -> float:
    """The remembered lateness after a sleep of ``planned_s`` that took ``slept_s``. Pure."""
    return max(slept_s - planned_s, seen_s * LATE_DECAY, 0.0)


def scan(root: Path) -> Iterator[KvFile]:
    """Every regular file under root; files that vanish mid-scan (vLLM's temp renames) are skipped."""
    stack = [str(root)]
    while stack:
        try:
            entries = list(os.scandir(stack.pop()))
        except (FileNotFoundError, NotADirectoryError):
            continue
        for entry in entries:
            try:
                if entry.is_dir(follow_symlinks=False):
                    stack.append(entry.path)
                elif entry.is_file(follow_symlinks=False):
                    st = entry.stat(follow_symlinks=False)
                    yield KvFile(
                        entry.path,
                        st.st_size,
                        max(st.st_atime, st.st_mtime),
                        entry.name.endswith(BLOCK_SUFFIX),
                    )
            except FileNotFoundError:
                continue


def evict(victims: Iterable[KvFile]) -> int:
    """Unlink the victims; returns the bytes actually removed (a file already gone removes nothing)."""
    removed = 0
    for f in victims:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f.path)
            removed += f.size
    return removed


def block_hash(path: str) -> int | None:
    """The hash KV events carry for the block stored in ``path``, or None for a file that is not a block."""
    name = os.path.basename(path)
    if not name.endswith(BLOCK_SUFFIX):
        return None
    try:
        return int(name[: -len(BLOCK_SUFFIX)], 16) & _MASK64
    except ValueError:
        return None


class EvictionLog:
    """The last ``size`` evicted block hashes, numbered from 0 since this process started (``epoch``).

    A reader passes the number after the last hash it has seen; ``missed`` tells it some were dropped
    from the log before it read them (their index entries then stay until the router's own bound)."""

    def __init__(self, size: int = EVICTION_LOG_SIZE) -> None:
        self.epoch = uuid.uuid4().hex
        self._hashes: deque[int] = deque(maxlen=size)
        self._next = 0
        self._lock = threading.Lock()

    def add(self, hashes: Iterable[int]) -> None:
        with self._lock:
            for h in hashes:
                self._hashes.append(h)
                self._next += 1

    def since(self, after: int) -> dict[str, object]:
        with self._lock:
            first = self._next - len(self._hashes)
            start = min(max(after, first), self._next) if after >= 0 else first
            hashes = list(itertools.islice(self._hashes, start - first, None))
            return {
                "epoch": self.epoch,
                "next": self._next,
                "hashes": hashes,
                "missed": after < first or after > self._next,
            }


def _handler(log: EvictionLog) -> type[BaseHTTPRequestHandler]:  # pragma: no cover
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            url = urlsplit(self.path)
            if url.path == EVICTIONS_PATH:
                try:
                    after = int(parse_qs(url.query).get("after", ["0"])[0])
                except ValueError:
                    self.send_error(400, "after must be an integer")
                    return
                body, ctype = json.dumps(log.since(after)).encode(), "application/json"
            elif url.path in ("/", "/metrics"):
                body, ctype = generate_latest(), CONTENT_TYPE_LATEST
            else:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass  # one line per poll would flood the sidecar's log

    return Handler


def run(
    root: Path,
    budget_bytes: int,
    interval_s: float,
    metrics_port: int | None,
    metrics_host: str = "",
    verbose: bool = False,
) -> None:  # pragma: no cover
    from prometheus_client import Counter, Gauge

    used_g = Gauge(METRIC_USED, "Bytes in the fs KV tier directory after the last pass")
    budget_g = Gauge(METRIC_BUDGET, "Byte budget of the fs KV tier")
    evicted_bytes = Counter(METRIC_EVICTED_BYTES, "Bytes of KV block files evicted")
    evicted_files = Counter(METRIC_EVICTED_FILES, "KV block files evicted")
    budget_g.set(budget_bytes)
    log = EvictionLog()
    if metrics_port is not None:
        server = ThreadingHTTPServer((metrics_host or "0.0.0.0", metrics_port), _handler(log))
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, name="http", daemon=True).start()
    last_after = 0
    max_rate = 0.0
    rate = 0.0
    work_s = 0.0
    late_s = 0.0
    planned_s = interval_s
    last_pass = time.monotonic()
    while True:
        started = time.monotonic()
        files = list(scan(root))
        now = time.monotonic()
        scan_s = now - started
        # Growth since the last pass, as a rate: how fast the engine can fill the tier.
        growth = sum(f.size for f in files) - last_after
        elapsed = now - last_pass
        observed = growth / max(elapsed, MIN_INTERVAL_S)
        max_rate = max(max_rate, observed)
        rate = recent_rate(rate, observed, elapsed)
        last_pass = now
        sleep_s, reserve = pacing(budget_bytes, max_rate, interval_s, work_s, late_s, rate)
        decision = choose_victims(files, budget_bytes, reserve_bytes=reserve)
        if decision.used_bytes > budget_bytes:
            # Always logged: the bound failed, and only these figures tell a late pass from a burst.
            print(
                f"{time.time():.3f} over budget: used {decision.used_bytes} > {budget_bytes}; grew {growth} in"
                f" {elapsed:.3f}s (planned {planned_s:.3f}s, late {late_s:.3f}s); max rate {max_rate:.0f} B/s",
                file=sys.stderr,
                flush=True,
            )
        removed = evict(decision.victims)
        work_s = time.monotonic() - now + scan_s
        log.add(h for h in map(block_hash, (f.path for f in decision.victims)) if h is not None)
        last_after = decision.used_bytes - removed
        evicted_bytes.inc(removed)
        evicted_files.inc(len(decision.victims))
        used_g.set(decision.used_bytes - removed)
        if verbose and decision.victims:
            print(
                f"{time.time():.3f} used {decision.used_bytes} evicted {removed} in {len(decision.victims)}"
                f" files; rate {rate:.0f} (max {max_rate:.0f}) B/s reserve {reserve} late {late_s:.3f}s next in {sleep_s:.3f}s",
                flush=True,
            )
        asleep = time.monotonic()
        time.sleep(sleep_s)
        late_s = lateness(late_s, sleep_s, time.monotonic() - asleep)
        planned_s = sleep_s + work_s


def main(argv: list[str] | None = None) -> None:  # pragma: no cover
    p = argparse.ArgumentParser(
        prog="python -m kvstrata.engine.fsjanitor", description=__doc__.splitlines()[0]
    )
    p.add_argument("--root", type=Path, required=True, help="the fs tier's root_dir")
    p.add_argument("--budget-bytes", type=int, required=True)
    p.add_argument(
        "--interval",
        type=float,
        default=1.0,
        help="seconds between passes (at most: sooner when the tier grows fast)",
    )
    p.add_argument("--metrics-port", type=int, default=None)
    # In a pod every interface is the pod's own (the default); the local e2e launcher, whose pods share
    # one network namespace, binds each pod's janitor to that pod's IP instead.
    p.add_argument("--metrics-host", default="", help="address to serve metrics on (default: all)")
    p.add_argument("--verbose", action="store_true", help="log every pass that evicts (tests)")
    args = p.parse_args(argv)
    if args.budget_bytes <= 0:
        p.error("--budget-bytes must be positive")
    run(args.root, args.budget_bytes, args.interval, args.metrics_port, args.metrics_host, args.verbose)


if __name__ == "__main__":  # pragma: no cover
    main()
