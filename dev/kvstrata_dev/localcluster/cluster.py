"""`up`, `down`, `status` and `env` of the local control plane.

`up` order: etcd -> kube-apiserver (/readyz) -> controller-manager, scheduler, kwok -> nodes and
the default StorageClass -> harness (PV provisioner + loopback EndpointSlices) -> nodes Ready and
the `default` ServiceAccount exist. Every process is recorded by PID in the state dir; `down`
stops them in reverse order and removes the state.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import shutil
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import kvstrata
import kvstrata_dev
from kvstrata_dev.localcluster import build, components, kubeconfig, manifests, pki, procs, versions
from kvstrata_dev.localcluster.layout import SERVICE_IP, Layout, State, choose_ports

# start order; `down` goes backwards
ORDER = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok", "harness")


class ClusterError(RuntimeError):
    """`up` could not bring the cluster up; the message says which part and where its log is."""


@dataclass(frozen=True)
class Status:
    running: dict[str, int | None]

    @property
    def all_up(self) -> bool:
        return all(pid is not None for pid in self.running.values())

    @property
    def any_up(self) -> bool:
        return any(pid is not None for pid in self.running.values())


def status(layout: Layout) -> Status:
    return Status({name: procs.alive_pid(layout, name) for name in ORDER})


def say(msg: str) -> None:
    print(f"[kvstrata-dev cluster] {msg}", file=sys.stderr, flush=True)


def _wait(what: str, check: Callable[[], bool], timeout: float, layout: Layout, name: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if name and procs.exited_early(layout, name):
            raise ClusterError(f"{name} exited while waiting for {what}:\n{procs.tail(layout.log(name))}")
        try:
            if check():
                return
        except (OSError, urllib.error.URLError, subprocess.SubprocessError, ValueError, ClusterError):
            pass
        time.sleep(0.2)
    raise ClusterError(f"timed out after {timeout:.0f}s waiting for {what}; see {layout.log(name)}")


def _http_ok(url: str, ctx: ssl.SSLContext | None = None) -> bool:
    with urllib.request.urlopen(url, timeout=2, context=ctx) as resp:
        return resp.status == 200


def admin_ssl_context(layout: Layout) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(layout.pki.ca_crt))
    ctx.load_cert_chain(str(layout.pki.client_crt("admin")), str(layout.pki.client_key("admin")))
    return ctx


def kubectl_env(layout: Layout, bin_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["KUBECONFIG"] = str(layout.kubeconfig)
    env["PATH"] = f"{bin_dir}:{env.get('PATH', '')}"
    return env


def kubectl(layout: Layout, bin_dir: Path, *args: str, input: str | None = None) -> str:
    proc = subprocess.run(
        [str(bin_dir / "kubectl"), *args],
        input=input,
        capture_output=True,
        text=True,
        env=kubectl_env(layout, bin_dir),
        timeout=120,
    )
    if proc.returncode != 0:
        raise ClusterError(f"kubectl {' '.join(args)} failed: {proc.stderr.strip()}")
    return proc.stdout


def env_lines(layout: Layout, bin_dir: Path) -> list[str]:
    return [
        f"export KUBECONFIG={layout.kubeconfig}",
        f'export PATH="{bin_dir}:$PATH"',
    ]


def _write_kubeconfigs(layout: Layout, server: str) -> None:
    p = layout.pki
    kubeconfig.write(
        layout.kubeconfig, server, p.ca_crt, p.client_crt("admin"), p.client_key("admin"), "admin"
    )
    for name in ("controller-manager", "scheduler", "kwok"):
        kubeconfig.write(
            layout.component_kubeconfig(name), server, p.ca_crt, p.client_crt(name), p.client_key(name), name
        )


def _fresh_state_dir(layout: Layout) -> None:
    for sub in (
        layout.etcd_data,
        layout.pki.dir,
        layout.kubeconfigs,
        layout.pids,
        layout.volumes,
        layout.logs,
    ):
        shutil.rmtree(sub, ignore_errors=True)
    for f in (layout.state_json, layout.kubeconfig, layout.env_file):
        f.unlink(missing_ok=True)
    layout.root.mkdir(parents=True, exist_ok=True)
    for sub in (layout.etcd_data, layout.kubeconfigs, layout.pids, layout.volumes, layout.logs):
        sub.mkdir(parents=True, exist_ok=True)
    layout.etcd_data.chmod(0o700)


def _nodes_ready(layout: Layout, bin_dir: Path) -> bool:
    out = json.loads(kubectl(layout, bin_dir, "get", "nodes", "-o", "json"))
    names = set(manifests.node_names())
    ready = {
        n["metadata"]["name"]
        for n in out["items"]
        if any(c["type"] == "Ready" and c["status"] == "True" for c in n["status"].get("conditions", []))
    }
    return names <= ready


def up(layout: Layout, bin_dir: Path | None = None, timeout: float = 120.0) -> State:
    """Start the cluster in `layout.root` unless it already runs; return its recorded state."""
    st = status(layout)
    if st.all_up and (state := State.load(layout)) is not None:
        say(f"already up ({state.server}); nothing to do")
        return state
    if st.any_up:
        say("found a partly running cluster; stopping it first")
        down(layout)
    started = time.monotonic()
    bin_dir = bin_dir or build.build()
    _fresh_state_dir(layout)
    ports = choose_ports()
    pki.generate(layout.pki, SERVICE_IP)
    state = State(
        bin_dir=str(bin_dir),
        ports=ports,
        versions={
            "kubernetes": versions.KUBERNETES,
            "etcd": versions.ETCD,
            "kwok": versions.KWOK,
            "helm": versions.HELM,
        },
        started_at=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    )
    _write_kubeconfigs(layout, state.server)
    try:
        _start_all(layout, bin_dir, state, timeout)
    except BaseException:
        say("up failed; stopping what was started (logs kept in " + str(layout.logs) + ")")
        _stop_all(layout)
        raise
    state.up_seconds = round(time.monotonic() - started, 1)
    state.save(layout)
    layout.env_file.write_text("\n".join(env_lines(layout, bin_dir)) + "\n")
    say(f"up in {state.up_seconds}s: {state.server}; kubeconfig {layout.kubeconfig}")
    return state


def _start_all(layout: Layout, bin_dir: Path, state: State, timeout: float) -> None:
    ports = state.ports
    procs.start(layout, "etcd", components.etcd(bin_dir, layout, ports))
    _wait("etcd /health", lambda: _http_ok(f"http://127.0.0.1:{ports['etcd']}/health"), 30, layout, "etcd")

    procs.start(layout, "kube-apiserver", components.kube_apiserver(bin_dir, layout, ports))
    ctx = admin_ssl_context(layout)
    _wait(
        "kube-apiserver /readyz",
        lambda: _http_ok(f"{state.server}/readyz", ctx),
        timeout,
        layout,
        "kube-apiserver",
    )

    procs.start(layout, "kube-controller-manager", components.kube_controller_manager(bin_dir, layout, ports))
    procs.start(layout, "kube-scheduler", components.kube_scheduler(bin_dir, layout, ports))
    procs.start(layout, "kwok", components.kwok(bin_dir, layout, ports))

    docs = "\n".join(json.dumps(o) for o in manifests.bootstrap_objects())
    kubectl(layout, bin_dir, "apply", "-f", "-", input=docs)

    harness_argv = [
        sys.executable,
        "-m",
        "kvstrata_dev.localcluster.harness",
        f"--kubeconfig={layout.kubeconfig}",
        f"--volumes-dir={layout.volumes}",
    ]
    procs.start(layout, "harness", harness_argv, env=_python_env())

    _wait("nodes Ready", lambda: _nodes_ready(layout, bin_dir), timeout, layout, "kwok")
    _wait(
        "the default ServiceAccount",
        lambda: bool(kubectl(layout, bin_dir, "get", "serviceaccount", "default", "-o", "name")),
        timeout,
        layout,
        "kube-controller-manager",
    )
    for name in ORDER:
        if procs.alive_pid(layout, name) is None:
            raise ClusterError(f"{name} is not running:\n{procs.tail(layout.log(name))}")


def _python_env() -> dict[str, str]:
    """The harness must import the product and this package, also when they are not installed (PYTHONPATH runs)."""
    env = dict(os.environ)
    roots = [str(Path(m.__file__).resolve().parents[1]) for m in (kvstrata, kvstrata_dev)]
    env["PYTHONPATH"] = os.pathsep.join(p for p in (*roots, env.get("PYTHONPATH", "")) if p)
    return env


def _stop_all(layout: Layout) -> list[str]:
    return [name for name in reversed(ORDER) if procs.stop(layout, name)]


def down(layout: Layout, keep_logs: bool = True) -> list[str]:
    """Stop every recorded process and remove the state (logs stay unless keep_logs is False)."""
    stopped = _stop_all(layout)
    for sub in (layout.etcd_data, layout.pki.dir, layout.kubeconfigs, layout.pids, layout.volumes):
        shutil.rmtree(sub, ignore_errors=True)
    for f in (layout.state_json, layout.kubeconfig, layout.env_file):
        f.unlink(missing_ok=True)
    if not keep_logs:
        shutil.rmtree(layout.root, ignore_errors=True)
    return stopped
