"""Background processes a benchmark owns: started in their own process group, logged to a file, and always
stopped (group and children) on exit, error, Ctrl-C or SIGTERM."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class BenchError(RuntimeError):
    """A benchmark cannot go on; the message says why (printed without a traceback)."""


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


class ProcGroup:
    """Owns every process a benchmark starts; `stop_all()` (also run by `with`) ends them, newest first."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: list[Proc] = []
        self._logged: set[str] = set()
        log_dir.mkdir(parents=True, exist_ok=True)

    def start(self, name: str, argv: Sequence[str], env: Mapping[str, str] | None = None) -> Proc:
        log = self.log_dir / f"{name}.log"
        # A name started again (the next benchmark round) appends: the log keeps every round.
        with log.open("ab" if name in self._logged else "wb") as out:
            self._logged.add(name)
            popen = subprocess.Popen(
                list(argv),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **(env or {})},
                start_new_session=True,  # own process group: stopping it also stops its children
            )
        proc = Proc(name, popen, log)
        self.procs.append(proc)
        return proc

    def stop(self, proc: Proc, timeout: float = 10.0) -> None:
        if proc.alive():
            _signal_group(proc.popen.pid, signal.SIGTERM)
            try:
                proc.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                _signal_group(proc.popen.pid, signal.SIGKILL)
                proc.popen.wait()
        # Children that outlived their leader (engine workers) still belong to the group.
        _signal_group(proc.popen.pid, signal.SIGKILL)
        if proc in self.procs:
            self.procs.remove(proc)

    def stop_all(self) -> None:
        for proc in reversed(list(self.procs)):
            self.stop(proc)

    def __enter__(self) -> ProcGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Turn SIGTERM into KeyboardInterrupt so `finally` blocks stop our processes when make is killed."""

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def bench_main(
    name: str, run: Callable[[], dict[str, Any]], render: Callable[[dict[str, Any]], str], out: Path
) -> int:
    """A benchmark's `main`: run it with SIGTERM as Ctrl-C, say what failed without a traceback, else
    write the JSON and print the table."""
    from bench.report import write_json

    try:
        with sigterm_as_interrupt():
            payload = run()
    except BenchError as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{name}: interrupted; all processes stopped", file=sys.stderr)
        return 130
    except Exception as exc:  # EngineError and friends: say what failed, no traceback
        print(f"{name}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    write_json(out, payload)
    print()
    print(render(payload))
    print(f"\nwrote {out}")
    return 0


def free_port() -> int:
    try:  # the engine harness owns the canonical helper; fall back only if it is absent
        from kvstrata_dev.testing.engines import free_port as harness_free_port
    except ImportError:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            return int(sock.getsockname()[1])
    return int(harness_free_port())


def http_get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def http_post(url: str, body: bytes, timeout: float = 30.0) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def wait_until(
    what: str, check: Callable[[], bool], timeout: float, procs: Sequence[Proc] = (), interval: float = 0.25
) -> float:
    """Poll `check` until it is true; fail fast with the log tail if one of `procs` dies. Returns seconds waited."""
    start = time.monotonic()
    while True:
        for proc in procs:
            if not proc.alive():
                raise BenchError(
                    f"{proc.name} exited ({proc.popen.returncode}) while waiting for {what}:\n"
                    f"{proc.log_tail()}"
                )
        try:
            if check():
                return time.monotonic() - start
        except (OSError, ValueError):
            pass
        if time.monotonic() - start > timeout:
            tails = "\n".join(f"--- {p.name} ({p.log}) ---\n{p.log_tail()}" for p in procs)
            raise BenchError(f"timed out after {timeout:.0f}s waiting for {what}\n{tails}")
        time.sleep(interval)
