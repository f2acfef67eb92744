"""The e2e launcher: plays the kubelet for kwok pods of InferenceClusters on this machine.

kwok schedules pods, gives them 127.10.x.y IPs and marks them Running and Ready, but runs nothing.
The launcher watches the pods kvstrata manages and, for every engine or router pod that kwok reports
Running, runs that pod's container command line here (see `podspec` for the three substitutions).
Like a kubelet it then:

- restarts a process that exits (restartPolicy Always, with CrashLoopBackOff-style back-off),
- stops the process when its pod is deleted (or is being deleted),
- runs the container's readinessProbe against the pod IP and writes the outcome into the pod's
  status (`Ready`, `ContainersReady`, `containerStatuses[].ready/restartCount`). kwok marks a pod Ready
  the moment it is placed; the launcher overwrites that with Ready=False on first sight (within one
  poll, ~1 s) and sets it True only when the real process answers the probe. kwok's pod-ready stage
  matches Pending pods only, so it never overwrites the launcher afterwards.

Native sidecars (init containers with `restartPolicy: Always`, e.g. the engine pod's fs-tier janitor)
run as processes of their own, started before the main container and restarted when they exit, like a
kubelet does; their metrics bind the pod IP (`--metrics-host`). Engine-pod processes get the image's
`PYTHONPATH=/opt/kvstrata` (kvstrata's engine package) mapped to this checkout's `operator/`
(`rebind_engine_env`), after `podnet/`.

Router pods get static discovery: their router.json (from the ConfigMap volume) lists the engine pods
of the same InferenceCluster, and the router is restarted when that set changes (see
`podspec.static_discovery` for why EndpointSlices cannot be used locally).

State for tests: `<state-dir>/procs.json` lists every managed pod with its process group id, IP and
restart count. Run: `python -m kvstrata_dev.e2e.launcher --kubeconfig K --state-dir D [--namespace NS]`.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstrata_dev.e2e.podspec import (
    LaunchSpec,
    PodSpecError,
    launch_spec,
    native_sidecars,
    rewrite_paths,
    static_discovery,
)
from kvstrata_dev.testing.engines import VllmEngine, group_alive, rebind_engine_env, spawn_logged, vllm_python

log = logging.getLogger("kvstrata_dev.e2e.launcher")

Obj = dict[str, Any]
MANAGED_SELECTOR = "app.kubernetes.io/managed-by=kvstrata"
COMPONENT = "app.kubernetes.io/component"
INSTANCE = "app.kubernetes.io/instance"
PODNET_DIR = Path(__file__).resolve().parent / "podnet"
MAX_BACKOFF_S = 30.0
_STOP_GRACE_S = 15.0


def now_iso() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def readiness_patch(
    container: str, ready: bool, started: bool, restarts: int, reason: str | None = None
) -> Obj:
    """Strategic-merge patch of pod status, as a kubelet writes it after a probe or a container exit."""
    ts = now_iso()
    status = "True" if ready else "False"
    conds = []
    for ctype in ("Ready", "ContainersReady"):
        cond: Obj = {"type": ctype, "status": status, "lastTransitionTime": ts}
        if not ready:
            cond["reason"] = "ContainersNotReady"
            cond["message"] = f"containers with unready status: [{container}]" + (
                f" ({reason})" if reason else ""
            )
        else:
            cond["reason"] = None
            cond["message"] = None
        conds.append(cond)
    state: Obj = (
        {"running": {"startedAt": ts}, "waiting": None, "terminated": None}
        if started
        else {"running": None, "terminated": None, "waiting": {"reason": reason or "ContainerCreating"}}
    )
    return {
        "status": {
            "conditions": conds,
            "containerStatuses": [
                {
                    "name": container,
                    "ready": ready,
                    "started": started,
                    "restartCount": restarts,
                    "state": state,
                }
            ],
        }
    }


class LocalProcess:
    """A non-vLLM container process (the router) in its own process group."""

    def __init__(self, argv: list[str], env: dict[str, str], log_path: Path) -> None:
        self.argv, self.env, self.log_path = argv, env, log_path
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> LocalProcess:
        self._proc = spawn_logged(self.argv, self.env, self.log_path)
        return self

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def stop(self, grace: float = _STOP_GRACE_S) -> None:
        if self._proc is None:
            return
        pgid = self._proc.pid
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and (self._proc.poll() is None or group_alive(pgid)):
            time.sleep(0.2)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout=10)


Proc = VllmEngine | LocalProcess


@dataclass
class Managed:
    """One pod's stand-in process and its kubelet-like bookkeeping."""

    spec: LaunchSpec
    component: str
    instance: str
    workdir: Path
    proc: Proc | None = None
    restarts: int = 0
    next_start: float = 0.0
    backoff: float = 1.0
    started_at: float = 0.0
    ready: bool = False
    reported: tuple[bool, bool, int] | None = None
    successes: int = 0
    failures: int = 0
    next_probe: float = 0.0
    discovery: tuple[str, ...] = field(default_factory=tuple)
    sidecars: list[Sidecar] = field(default_factory=list)


@dataclass
class Sidecar:
    """A native sidecar of a managed pod: started before the main container, restarted when it exits,
    stopped with the pod."""

    spec: LaunchSpec
    proc: LocalProcess | None = None
    restarts: int = 0
    next_start: float = 0.0


def _probe(url: str, timeout: float) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return 200 <= resp.status < 400
    except (OSError, urllib.error.URLError, ValueError):
        return False


class Launcher:
    def __init__(
        self, kubeconfig: Path, state_dir: Path, namespace: str | None = None, poll: float = 1.0
    ) -> None:
        from kubernetes import client, config

        self.api = client.CoreV1Api(config.new_client_from_config(config_file=str(kubeconfig)))
        self.exc = client.exceptions.ApiException
        self.state_dir = state_dir
        self.namespace = namespace
        self.poll = poll
        self.managed: dict[str, Managed] = {}
        self.stopping: list[threading.Thread] = []
        self.programs = {
            "engine": {"python3": str(vllm_python()), "python": str(vllm_python())},
            "router": {
                "kvstrata": shutil.which("kvstrata") or str(Path(sys.executable).with_name("kvstrata"))
            },
        }

    # --- Kubernetes reads --------------------------------------------------------------------
    def _json(self, fn: Any, *args: Any, **kw: Any) -> Obj:
        return json.loads(fn(*args, _preload_content=False, **kw).data)

    def list_pods(self) -> list[Obj]:
        if self.namespace:
            data = self._json(self.api.list_namespaced_pod, self.namespace, label_selector=MANAGED_SELECTOR)
        else:
            data = self._json(self.api.list_pod_for_all_namespaces, label_selector=MANAGED_SELECTOR)
        return data["items"]

    def volume_dirs(self, pod: Obj, workdir: Path) -> dict[str, Path] | None:
        """Local directory of each volume of `pod`; None while a PVC is not bound yet."""
        ns = pod["metadata"]["namespace"]
        out: dict[str, Path] = {}
        for vol in pod["spec"].get("volumes") or []:
            name = vol["name"]
            if "persistentVolumeClaim" in vol:
                claim = self._json(
                    self.api.read_namespaced_persistent_volume_claim,
                    vol["persistentVolumeClaim"]["claimName"],
                    ns,
                )
                pv_name = claim.get("spec", {}).get("volumeName")
                if not pv_name or claim.get("status", {}).get("phase") != "Bound":
                    return None
                pv = self._json(self.api.read_persistent_volume, pv_name)
                host_path = pv["spec"].get("hostPath", {}).get("path")
                if not host_path:
                    raise PodSpecError(
                        f"PV {pv_name} of claim {claim['metadata']['name']} is not a hostPath volume"
                    )
                out[name] = Path(host_path)
            elif "configMap" in vol:
                cm = self._json(self.api.read_namespaced_config_map, vol["configMap"]["name"], ns)
                target = workdir / "volumes" / name
                target.mkdir(parents=True, exist_ok=True)
                for key, value in (cm.get("data") or {}).items():
                    (target / key).write_text(value)
                out[name] = target
            elif "emptyDir" in vol:
                target = workdir / "volumes" / name
                target.mkdir(parents=True, exist_ok=True)
                out[name] = target
        return out

    # --- status writes -----------------------------------------------------------------------
    def report(self, m: Managed, reason: str | None = None) -> None:
        started = m.proc is not None and m.proc.running()
        key = (m.ready, started, m.restarts)
        if key == m.reported:
            return
        patch = readiness_patch(m.spec.container, m.ready, started, m.restarts, reason)
        try:
            self.api.patch_namespaced_pod_status(m.spec.pod, m.spec.namespace, patch)
            m.reported = key
        except self.exc as e:
            if e.status != 404:
                log.warning("pod %s/%s: status patch failed: %s", m.spec.namespace, m.spec.pod, e.reason)

    # --- processes ---------------------------------------------------------------------------
    def _start(self, m: Managed) -> None:
        log_path = self.state_dir / "logs" / f"{m.spec.namespace}_{m.spec.pod}.log"
        env = {**m.spec.env, "KVSTRATA_POD_IP": m.spec.pod_ip}
        if m.component == "engine":
            env["PYTHONPATH"] = engine_pythonpath(m.spec.env)
            proc: Proc = VllmEngine.from_argv(m.spec.argv, env, log_path=log_path, kv_cache_space_gib=None)
        else:
            proc = LocalProcess(m.spec.argv, env, log_path)
        proc.start()
        m.proc, m.started_at = proc, time.monotonic()
        m.ready, m.successes, m.failures = False, 0, 0
        m.next_probe = time.monotonic() + 1.0
        log.info(
            "started %s/%s (%s) at %s: pid %s%s",
            m.spec.namespace,
            m.spec.pod,
            m.component,
            m.spec.pod_ip,
            proc.pid,
            f", restart {m.restarts}" if m.restarts else "",
        )

    def _start_sidecars(self, m: Managed, now: float) -> None:
        for sc in m.sidecars:
            if sc.proc is not None and not sc.proc.running():
                sc.proc, sc.restarts = None, sc.restarts + 1
                sc.next_start = now + min(2.0**sc.restarts, MAX_BACKOFF_S)
                log.warning(
                    "%s/%s: sidecar %s exited (restart %d)",
                    m.spec.namespace,
                    m.spec.pod,
                    sc.spec.container,
                    sc.restarts,
                )
            if sc.proc is None and now >= sc.next_start:
                log_path = (
                    self.state_dir / "logs" / f"{m.spec.namespace}_{m.spec.pod}_{sc.spec.container}.log"
                )
                env = {**rebind_engine_env(sc.spec.env), "KVSTRATA_POD_IP": sc.spec.pod_ip}
                sc.proc = LocalProcess(sc.spec.argv, env, log_path).start()
                log.info(
                    "started %s/%s sidecar %s: pid %s",
                    m.spec.namespace,
                    m.spec.pod,
                    sc.spec.container,
                    sc.proc.pid,
                )

    def _stop_async(self, m: Managed, why: str) -> None:
        procs: list[Proc] = [sc.proc for sc in m.sidecars if sc.proc is not None]
        for sc in m.sidecars:
            sc.proc = None
        if m.proc is not None:
            procs.insert(0, m.proc)  # the main container first, then its sidecars (as a kubelet does)
        m.proc = None
        if not procs:
            return
        log.info("stopping %s/%s (%s): %s", m.spec.namespace, m.spec.pod, m.component, why)

        def stop_all() -> None:
            for p in procs:
                p.stop()

        t = threading.Thread(target=stop_all, name=f"stop-{m.spec.pod}", daemon=True)
        t.start()
        self.stopping.append(t)

    def adopt(self, pod: Obj) -> Managed | None:
        meta = pod["metadata"]
        component = (meta.get("labels") or {}).get(COMPONENT)
        if component not in self.programs:
            return None
        workdir = self.state_dir / "pods" / f"{meta['namespace']}_{meta['name']}_{meta['uid'][:8]}"
        dirs = self.volume_dirs(pod, workdir)
        if dirs is None:
            return None
        spec = launch_spec(pod, programs=self.programs[component], volume_dirs=dirs)
        # The only native sidecar a device-cpu pod renders is the fs-tier janitor, whose one bind is its
        # metrics server; a sidecar with another bind flag would need its own entry here.
        sidecars = [
            Sidecar(
                launch_spec(
                    pod,
                    container_name=name,
                    programs=self.programs[component],
                    volume_dirs=dirs,
                    bind_flag="--metrics-host",
                )
            )
            for name in native_sidecars(pod)
        ]
        m = Managed(
            spec=spec,
            component=component,
            instance=(meta.get("labels") or {}).get(INSTANCE, ""),
            workdir=workdir,
            sidecars=sidecars,
        )
        for s in [spec, *(sc.spec for sc in sidecars)]:
            for sub in s.substitutions:
                log.info("%s/%s %s: %s", s.namespace, s.pod, s.container, sub)
        return m

    def _engine_ips(self, pods: list[Obj], namespace: str, instance: str) -> tuple[str, ...]:
        return tuple(
            sorted(
                p["status"]["podIP"]
                for p in pods
                if p["metadata"]["namespace"] == namespace
                and (p["metadata"].get("labels") or {}).get(INSTANCE) == instance
                and (p["metadata"].get("labels") or {}).get(COMPONENT) == "engine"
                and p.get("status", {}).get("podIP")
                and not p["metadata"].get("deletionTimestamp")
            )
        )

    def _write_router_config(self, m: Managed, engine_ips: tuple[str, ...]) -> None:
        cfg_path = next((Path(a) for a in m.spec.argv if a.endswith("router.json")), None)
        if cfg_path is None or not cfg_path.exists():
            raise PodSpecError(f"router pod {m.spec.pod}: no router.json among its arguments")
        original = cfg_path.with_suffix(".json.rendered")
        if not original.exists():
            original.write_text(cfg_path.read_text())
        # The file is read inside the container too: its paths under mounts (the tokenizer) map like argv.
        cfg = rewrite_paths(
            static_discovery(json.loads(original.read_text()), list(engine_ips)), m.spec.mounts
        )
        cfg_path.write_text(json.dumps(cfg, indent=2))
        m.discovery = engine_ips

    def step(self) -> None:
        pods = self.list_pods()
        live = {p["metadata"]["uid"]: p for p in pods if not p["metadata"].get("deletionTimestamp")}
        for uid in [u for u in self.managed if u not in live]:
            self._stop_async(self.managed.pop(uid), "pod deleted")
        for uid, pod in live.items():
            if uid in self.managed:
                continue
            if pod.get("status", {}).get("phase") != "Running" or not pod.get("status", {}).get("podIP"):
                continue
            try:
                m = self.adopt(pod)
            except (PodSpecError, self.exc) as e:
                log.error(
                    "pod %s/%s cannot run locally: %s",
                    pod["metadata"]["namespace"],
                    pod["metadata"]["name"],
                    e,
                )
                continue
            if m is not None:
                self.managed[uid] = m
                self.report(m, "ContainerCreating")
        now = time.monotonic()
        for m in self.managed.values():
            if m.component == "router":
                ips = self._engine_ips(pods, m.spec.namespace, m.instance)
                if ips != m.discovery:
                    self._write_router_config(m, ips)
                    if m.proc is not None:
                        # Synchronously: the new router binds the same pod IP and port.
                        log.info("restarting router %s: engines now %s", m.spec.pod, ", ".join(ips) or "none")
                        m.proc.stop(grace=5.0)
                        m.proc = None
                        m.next_start = now
            if m.proc is not None and not m.proc.running():
                m.proc = None
                m.restarts += 1
                m.next_start = now + m.backoff
                log.warning(
                    "%s/%s exited; restarting in %.0fs (restart %d)",
                    m.spec.namespace,
                    m.spec.pod,
                    m.backoff,
                    m.restarts,
                )
                m.backoff = min(m.backoff * 2, MAX_BACKOFF_S)
                m.ready = False
                self.report(m, "CrashLoopBackOff")
            # Native sidecars start before the main container and run independently of it.
            self._start_sidecars(m, now)
            if m.proc is None and now >= m.next_start:
                self._start(m)
                self.report(m, "Starting")
            if m.proc is not None and now >= m.next_probe:
                self._probe(m, now)
        self.stopping = [t for t in self.stopping if t.is_alive()]
        self._write_state()

    def _probe(self, m: Managed, now: float) -> None:
        probe = m.spec.readiness
        if probe is None:
            m.ready = True
            self.report(m)
            return
        m.next_probe = now + probe.period_seconds
        # A kubelet's 1 s default is too tight for an engine decoding on two shared cores.
        ok = _probe(f"http://{m.spec.pod_ip}:{probe.port}{probe.path}", max(probe.timeout_seconds, 3.0))
        if ok:
            m.successes, m.failures = m.successes + 1, 0
            if not m.ready and m.successes >= probe.success_threshold:
                m.ready = True
                m.backoff = 1.0
                log.info(
                    "%s/%s ready after %.0fs", m.spec.namespace, m.spec.pod, time.monotonic() - m.started_at
                )
        else:
            m.failures, m.successes = m.failures + 1, 0
            if m.ready and m.failures >= probe.failure_threshold:
                m.ready = False
                log.warning(
                    "%s/%s failed its readiness probe %d times", m.spec.namespace, m.spec.pod, m.failures
                )
        self.report(m, None if m.ready else "ProbeFailed")

    def _write_state(self) -> None:
        state = {
            uid: {
                "namespace": m.spec.namespace,
                "pod": m.spec.pod,
                "component": m.component,
                "instance": m.instance,
                "ip": m.spec.pod_ip,
                "pid": m.proc.pid if m.proc is not None else None,
                "ready": m.ready,
                "restarts": m.restarts,
                "argv": m.spec.argv,
                "sidecars": {
                    sc.spec.container: {
                        "pid": sc.proc.pid if sc.proc is not None else None,
                        "restarts": sc.restarts,
                        "argv": sc.spec.argv,
                    }
                    for sc in m.sidecars
                },
                "volumes": {path: str(local) for path, local in m.spec.mounts.items()},
            }
            for uid, m in self.managed.items()
        }
        tmp = self.state_dir / "procs.json.tmp"
        tmp.write_text(json.dumps(state, indent=2))
        tmp.replace(self.state_dir / "procs.json")

    def run(self, stop: threading.Event) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        try:
            while not stop.is_set():
                started = time.monotonic()
                try:
                    self.step()
                except Exception as e:  # keep running through API server hiccups
                    log.warning("launcher step failed: %s", e)
                stop.wait(max(0.0, self.poll - (time.monotonic() - started)))
        finally:
            self.shutdown()

    def shutdown(self) -> None:
        procs: list[Proc] = [m.proc for m in self.managed.values() if m.proc is not None]
        procs += [sc.proc for m in self.managed.values() for sc in m.sidecars if sc.proc is not None]
        for p in procs:  # SIGTERM all first so they stop in parallel
            if p.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            p.stop()
        for t in self.stopping:
            t.join(timeout=_STOP_GRACE_S + 15)
        self.managed.clear()
        with contextlib.suppress(OSError):
            self._write_state()


def engine_pythonpath(env: dict[str, str]) -> str:
    """PYTHONPATH of an engine process here: `podnet/` (wildcard ZMQ binds on the pod IP), then the
    rendered PYTHONPATH with the image's kvstrata engine package mapped to this checkout
    (`rebind_engine_env`), then this process's own."""
    rendered = rebind_engine_env(env).get("PYTHONPATH", "")
    return os.pathsep.join(p for p in (str(PODNET_DIR), rendered, os.environ.get("PYTHONPATH", "")) if p)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m kvstrata_dev.e2e.launcher", description=__doc__.split("\n")[0]
    )
    p.add_argument("--kubeconfig", type=Path, required=True)
    p.add_argument("--state-dir", type=Path, required=True, help="logs, per-pod volumes, procs.json")
    p.add_argument("--namespace", default=None, help="only this namespace (default: all)")
    p.add_argument("--poll", type=float, default=1.0)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s launcher: %(message)s")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        Launcher(args.kubeconfig, args.state_dir.resolve(), args.namespace, args.poll).run(stop)
    except Exception as e:
        print(f"launcher: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
