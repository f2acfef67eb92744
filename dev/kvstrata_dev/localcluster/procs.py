"""Start, find and stop the cluster's processes by the PID files in the state dir.

A PID is trusted only while /proc/<pid>/cmdline still names the binary we started, so a recycled
PID never gets a signal meant for our process.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

from kvstrata_dev.localcluster.layout import Layout


def start(layout: Layout, name: str, argv: list[str], env: dict[str, str] | None = None) -> int:
    """Start `argv` in its own session with output to logs/<name>.log; record and return its PID."""
    layout.logs.mkdir(parents=True, exist_ok=True)
    layout.pids.mkdir(parents=True, exist_ok=True)
    with layout.log(name).open("ab") as log:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # survives the `kvstrata-dev cluster up` that started it
            env=env,
            close_fds=True,
        )
    layout.pid_file(name).write_text(f"{proc.pid}\n{argv[0]}\n")
    _await_exec(proc, argv[0])
    return proc.pid


def _await_exec(proc: subprocess.Popen[bytes], exe: str, timeout: float = 5.0) -> None:
    """Popen returns once exec has begun, but /proc/<pid>/cmdline is empty until the kernel has
    set up the new image; a liveness check in that window would call the process dead."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        cmd = _cmdline(proc.pid)
        if cmd and os.path.basename(cmd[0]) == os.path.basename(exe):
            return
        time.sleep(0.01)


def _cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [p.decode(errors="replace") for p in raw.split(b"\0") if p]


def _is_zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def recorded(layout: Layout, name: str) -> tuple[int, str] | None:
    try:
        pid_s, exe = layout.pid_file(name).read_text().splitlines()[:2]
        return int(pid_s), exe
    except (OSError, ValueError):
        return None


def alive_pid(layout: Layout, name: str) -> int | None:
    """The PID of component `name` if that very process still runs."""
    rec = recorded(layout, name)
    if rec is None:
        return None
    pid, exe = rec
    cmd = _cmdline(pid)
    if not cmd or _is_zombie(pid):
        return None
    # The executable, or for `python -m ...` the interpreter, must match what we started.
    if cmd[0] != exe and os.path.basename(cmd[0]) != os.path.basename(exe):
        return None
    return pid


def exited_early(layout: Layout, name: str) -> bool:
    return recorded(layout, name) is not None and alive_pid(layout, name) is None


def stop(layout: Layout, name: str, timeout: float = 15.0) -> bool:
    """SIGTERM then SIGKILL the process group of `name`. Returns whether something was stopped."""
    pid = alive_pid(layout, name)
    layout.pid_file(name).unlink(missing_ok=True)
    if pid is None:
        return False
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pid, sig)  # its own session: the group holds only it and its children
        except ProcessLookupError:
            return True
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if not _cmdline(pid) or _is_zombie(pid):
                _reap(pid)
                return True
            time.sleep(0.1)
    return True


def _reap(pid: int) -> None:
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
