"""A handle on a running local cluster for tests, e2e launchers and scripts (the pytest fixtures
in the repo-root conftest.py are thin wrappers around `acquire`/`release`/`fresh_namespace`).

Several pytest sessions may share one state dir at once (helpers run suites side by side): a
file lock serialises `up`, each session registers its PID under `users/`, and the last live
user tears down a cluster that a fixture started. A cluster started by hand (`kvstrata-dev cluster
up`) or with KVSTRATA_REUSE_CLUSTER=1 is never torn down by tests.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import secrets
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from kvstrata_dev.localcluster import cluster, versions
from kvstrata_dev.localcluster.layout import Layout, State

T = TypeVar("T")
FIXTURE_MARK = "started-by-fixture"


class CommandError(subprocess.CalledProcessError):
    """A kubectl/helm call failed; str() carries the command and its stderr."""

    def __str__(self) -> str:
        return f"{' '.join(map(str, self.cmd))} exited {self.returncode}: {(self.stderr or '').strip()}"


@dataclass(frozen=True)
class LocalCluster:
    kubeconfig: Path
    bin_dir: Path
    env: dict[str, str]
    server: str
    pod_ip_cidr: str
    state_dir: Path
    versions: dict[str, str] = field(default_factory=dict)

    def _run(
        self, tool: str, args: tuple[str, ...], input: str | None, check: bool, timeout: float
    ) -> subprocess.CompletedProcess[str]:
        cmd = [str(self.bin_dir / tool), *args]
        proc = subprocess.run(cmd, input=input, capture_output=True, text=True, env=self.env, timeout=timeout)
        if check and proc.returncode != 0:
            raise CommandError(proc.returncode, cmd, proc.stdout, proc.stderr)
        return proc

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        return self._run("kubectl", args, input, check, timeout)

    def helm(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 300
    ) -> subprocess.CompletedProcess[str]:
        return self._run("helm", args, input, check, timeout)

    def kubectl_json(self, *args: str) -> Any:
        return json.loads(self.kubectl(*args, "-o", "json").stdout)

    def apply(self, *objects: dict[str, Any], namespace: str | None = None) -> None:
        ns = ("-n", namespace) if namespace else ()
        self.kubectl("apply", *ns, "-f", "-", input="\n".join(json.dumps(o) for o in objects))

    def wait_for(
        self, what: str, predicate: Callable[[], T], timeout: float = 60, interval: float = 0.5
    ) -> T:
        """Poll `predicate()` until it returns something truthy; raise TimeoutError naming `what`."""
        deadline = time.monotonic() + timeout
        last: T | None = None
        while time.monotonic() < deadline:
            last = predicate()
            if last:
                return last
            time.sleep(interval)
        raise TimeoutError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


def handle(layout: Layout, state: State) -> LocalCluster:
    bin_dir = Path(state.bin_dir)
    return LocalCluster(
        kubeconfig=layout.kubeconfig,
        bin_dir=bin_dir,
        env=cluster.kubectl_env(layout, bin_dir),
        server=state.server,
        pod_ip_cidr=state.pod_cidr,
        state_dir=layout.root,
        versions=dict(state.versions),
    )


@contextmanager
def _locked(layout: Layout) -> Iterator[None]:
    layout.root.mkdir(parents=True, exist_ok=True)
    with (layout.root / ".lock").open("w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _users_dir(layout: Layout) -> Path:
    return layout.root / "users"


def _live_users(layout: Layout) -> list[int]:
    live = []
    for f in _users_dir(layout).glob("*"):
        try:
            pid = int(f.name)
            os.kill(pid, 0)
            live.append(pid)
        except (ValueError, ProcessLookupError, PermissionError):
            f.unlink(missing_ok=True)
    return live


def acquire(state_dir: Path | None = None) -> LocalCluster:
    """Bring the cluster up (building binaries if needed) or join the one that runs."""
    layout = Layout((state_dir or versions.default_state_dir()).resolve())
    with _locked(layout):
        was_up = cluster.status(layout).all_up
        state = cluster.up(layout)
        if not was_up:
            marker = layout.root / FIXTURE_MARK
            if os.environ.get("KVSTRATA_REUSE_CLUSTER") == "1":
                marker.unlink(missing_ok=True)
            else:
                marker.write_text(f"{os.getpid()}\n")
        _users_dir(layout).mkdir(exist_ok=True)
        (_users_dir(layout) / str(os.getpid())).write_text("")
    return handle(layout, state)


def release(lc: LocalCluster) -> bool:
    """Leave the cluster; stop it if a fixture started it and nobody else uses it. Returns whether stopped."""
    layout = Layout(lc.state_dir)
    with _locked(layout):
        (_users_dir(layout) / str(os.getpid())).unlink(missing_ok=True)
        if not (layout.root / FIXTURE_MARK).exists() or os.environ.get("KVSTRATA_REUSE_CLUSTER") == "1":
            return False
        if _live_users(layout):
            return False
        cluster.down(layout)
        (layout.root / FIXTURE_MARK).unlink(missing_ok=True)
        return True


def namespace_name(hint: str) -> str:
    base = re.sub(r"[^a-z0-9-]+", "-", hint.lower()).strip("-")[:40].strip("-") or "t"
    return f"{base}-{secrets.token_hex(3)}"


@contextmanager
def fresh_namespace(lc: LocalCluster, hint: str = "t") -> Iterator[str]:
    """A new namespace whose `default` ServiceAccount exists (pods need it); deleted afterwards."""
    name = namespace_name(hint)
    lc.kubectl("create", "namespace", name)
    lc.wait_for(
        f"ServiceAccount default in {name}",
        lambda: lc.kubectl("get", "serviceaccount", "default", "-n", name, check=False).returncode == 0,
        timeout=30,
    )
    try:
        yield name
    finally:
        lc.kubectl("delete", "namespace", name, "--wait=false", "--ignore-not-found", check=False)
