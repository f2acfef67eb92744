"""Run Debian's `wrk` with a POST body and read its summary back as JSON (printed by a Lua `done` hook)."""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.procs import BenchError

_MARK = "WRKJSON "
_LUA = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = [==[%BODY%]==]

done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    '%MARK%{"requests":%d,"duration_us":%d,"bytes":%d,"connect":%d,"read":%d,"write":%d,' ..
    '"status":%d,"timeout":%d,"mean_us":%.1f,"p50_us":%d,"p90_us":%d,"p99_us":%d,"max_us":%d}\\n',
    summary.requests, summary.duration, summary.bytes, e.connect, e.read, e.write, e.status, e.timeout,
    latency.mean, latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.max))
end
"""


@dataclass(frozen=True)
class WrkResult:
    requests: int
    seconds: float
    rps: float
    bytes_per_s: float
    errors: int  # connect/read/write/timeout errors plus non-2xx/3xx responses
    non_2xx: int
    mean_ms: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)


UNIQUE = "@@N@@"
# Replaces the fixed body: UNIQUE in the body becomes a per-request counter, so every prompt differs
# (routers cannot serve tokenization or prefix look-ups from a one-entry cache).
_LUA_UNIQUE = """
local head, tail = [==[%HEAD%]==], [==[%TAIL%]==]
local n = 0
request = function()
  n = n + 1
  return wrk.format(nil, nil, nil, head .. n .. tail)
end
"""


def write_script(path: Path, body: str) -> Path:
    if "]==]" in body:
        raise BenchError("request body must not contain ']==]' (Lua long-string terminator)")
    lua = _LUA.replace("%BODY%", body).replace("%MARK%", _MARK)
    if UNIQUE in body:
        head, _, tail = body.partition(UNIQUE)
        lua += _LUA_UNIQUE.replace("%HEAD%", head).replace("%TAIL%", tail)
    path.write_text(lua)
    return path


def run_wrk(
    url: str, script: Path, connections: int, seconds: float, threads: int = 1, timeout_s: float = 10.0
) -> WrkResult:
    wrk = shutil.which("wrk")
    if wrk is None:
        raise BenchError("wrk not found: `make bench-proxy` installs it (apt-get install wrk)")
    argv = [
        wrk,
        "-t",
        str(threads),
        "-c",
        str(connections),
        "-d",
        f"{seconds:g}s",
        "--timeout",
        f"{timeout_s:g}s",
        "-s",
        str(script),
        url,
    ]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + timeout_s + 30)
    if out.returncode != 0:
        raise BenchError(f"wrk failed ({out.returncode}): {out.stderr.strip() or out.stdout.strip()}")
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith(_MARK)), None)
    if line is None:
        raise BenchError(f"wrk printed no summary:\n{out.stdout}\n{out.stderr}")
    raw = json.loads(line[len(_MARK) :])
    secs = raw["duration_us"] / 1e6
    io_errors = raw["connect"] + raw["read"] + raw["write"] + raw["timeout"]
    ok = max(raw["requests"] - raw["status"], 0)
    return WrkResult(
        requests=raw["requests"],
        seconds=round(secs, 3),
        rps=round(ok / secs, 1) if secs else 0.0,
        bytes_per_s=round(raw["bytes"] / secs, 1) if secs else 0.0,
        errors=io_errors + raw["status"],
        non_2xx=raw["status"],
        mean_ms=round(raw["mean_us"] / 1000, 3),
        p50_ms=round(raw["p50_us"] / 1000, 3),
        p90_ms=round(raw["p90_us"] / 1000, 3),
        p99_ms=round(raw["p99_us"] / 1000, 3),
        max_ms=round(raw["max_us"] / 1000, 3),
    )
