"""The whole stack on the local cluster, as the demo and the e2e tests bring it up and down.

Order: the Helm chart (CRD, RBAC, webhook) → the operator process as the chart's ServiceAccount → the model PVC with the tiny model
written into its volume → the InferenceCluster → the launcher (runs the pods' real processes) → wait
until the cluster reports READY n/n from real engines. Every process this module starts runs in its own
process group, is recorded in `<state>/pids.json`, and is stopped by `Stack.stop` (or `stop_recorded`
from another process, which is what `make demo-down` does).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvstrata.controller.hitrate import Counters
from kvstrata.controller.promtext import parse_engine
from kvstrata_dev.localcluster.session import LocalCluster
from kvstrata_dev.localrun import (
    Install,
    OperatorProcess,
    install_chart,
    run_operator,
    uninstall_chart,
    wait_webhook_serving,
)
from kvstrata_dev.testing.engines import group_alive, spawn_logged
from kvstrata_dev.testing.tinymodel import ensure_tiny_model

Obj = dict[str, Any]


class StackError(RuntimeError):
    """A step of bringing the stack up failed; the message names the step and the log to read."""


def say(msg: str) -> None:
    print(f"[kvstrata demo] {msg}", file=sys.stderr, flush=True)


def load_manifest(path: Path) -> Obj:
    try:
        doc = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise StackError(f"cannot read {path}: {e}") from None
    if not isinstance(doc, dict) or doc.get("kind") != "InferenceCluster":
        raise StackError(f"{path} is not an InferenceCluster manifest")
    return doc


def tiny_model_kwargs(manifest: Obj) -> dict[str, int]:
    """ensure_tiny_model arguments from the manifest's architecture block (what the planner planned)."""
    arch = (manifest["spec"]["model"].get("architecture")) or {}
    mapping = {
        "num_layers": "numLayers",
        "hidden_size": "hiddenSize",
        "num_heads": "numAttentionHeads",
        "num_kv_heads": "numKvHeads",
        "head_dim": "headDim",
        "vocab_size": "vocabSize",
        "max_position_embeddings": "maxPositionEmbeddings",
    }
    return {k: int(arch[v]) for k, v in mapping.items() if v in arch}


def model_claim(manifest: Obj) -> tuple[str, str]:
    source = manifest["spec"]["model"]["source"]
    if not source.startswith("pvc://"):
        raise StackError(f"the local stack needs a pvc:// model source, got {source!r}")
    claim, _, path = source.removeprefix("pvc://").partition("/")
    return claim, path.strip("/")


@dataclass
class Proc:
    name: str
    argv: list[str]
    log: Path
    env: dict[str, str] = field(default_factory=dict)
    popen: subprocess.Popen[bytes] | None = None

    def start(self) -> Proc:
        self.popen = spawn_logged(self.argv, self.env, self.log, header=False)
        return self

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen else None

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None


def stop_group(pgid: int, grace: float) -> None:
    """SIGTERM a process group, SIGKILL what is left after `grace` seconds."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)


def stop_recorded(state_dir: Path) -> list[str]:
    """Stop every process recorded in `<state_dir>/pids.json` (launcher first: it stops the engines)."""
    pids_file = state_dir / "pids.json"
    try:
        pids: dict[str, int] = json.loads(pids_file.read_text())
    except (OSError, ValueError):
        return []
    stopped = []
    for name in ("launcher", "operator"):
        pid = pids.get(name)
        if pid and group_alive(pid):
            stop_group(pid, grace=60 if name == "launcher" else 15)
            stopped.append(name)
    # Engines the launcher could not stop (it was SIGKILLed): their groups are in procs.json.
    with contextlib.suppress(OSError, ValueError):
        for entry in json.loads((state_dir / "launcher" / "procs.json").read_text()).values():
            if entry.get("pid") and group_alive(entry["pid"]):
                stop_group(entry["pid"], grace=15)
                stopped.append(entry["pod"])
            for name, sidecar in (entry.get("sidecars") or {}).items():
                if sidecar.get("pid") and group_alive(sidecar["pid"]):
                    stop_group(sidecar["pid"], grace=5)
                    stopped.append(f"{entry['pod']}/{name}")
    pids_file.unlink(missing_ok=True)
    return stopped


class Stack:
    def __init__(
        self,
        lc: LocalCluster,
        namespace: str,
        manifest: Obj,
        state_dir: Path,
        *,
        status_interval: float = 5.0,
        release: str = "kvstrata",
        release_namespace: str = "kvstrata-system",
        webhook_failure_policy: str | None = None,
        log: Callable[[str], None] = say,
    ) -> None:
        self.lc = lc
        self.namespace = namespace
        self.manifest = manifest
        self.name = manifest["metadata"]["name"]
        self.state_dir = state_dir
        self.status_interval = status_interval
        self.log = log
        self.release = release
        self.release_namespace = release_namespace
        self.webhook_failure_policy = webhook_failure_policy
        self.procs: dict[str, Proc] = {}
        self.install: Install | None = None
        self.operator: OperatorProcess | None = None

    # --- processes ---------------------------------------------------------------------------
    def _record(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        pids = {n: p.pid for n, p in self.procs.items() if p.pid}
        if self.operator is not None and self.operator.pid:
            pids["operator"] = self.operator.pid
        (self.state_dir / "pids.json").write_text(json.dumps(pids))

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Proc:
        proc = Proc(name, argv, self.state_dir / "logs" / f"{name}.log", env or {}).start()
        self.procs[name] = proc
        self._record()
        return proc

    def check_alive(self) -> None:
        for name, p in self.procs.items():
            if not p.alive():
                tail = (
                    "\n".join(p.log.read_text(errors="replace").splitlines()[-30:]) if p.log.exists() else ""
                )
                raise StackError(f"the {name} process exited; log {p.log}:\n{tail}")

    # --- steps -------------------------------------------------------------------------------
    def install_operator(self) -> None:
        """`helm install` the chart (CRD, RBAC, webhook, operator Deployment), then run the operator
        process for its kwok pod the way the operator's own tests do (`controller.localrun`): with a
        token of the chart's ServiceAccount, serving the webhook on the pod's IP."""
        self.lc.kubectl("create", "namespace", self.namespace, check=False)
        values: dict[str, Any] = {"watchNamespaces": [self.namespace]}
        if self.webhook_failure_policy:
            values["webhook"] = {"failurePolicy": self.webhook_failure_policy}
        try:
            self.install = install_chart(self.lc, self.release, self.release_namespace, values=values)
        except Exception:
            # A failed install still leaves a release record (and maybe objects) behind.
            self.lc.helm("uninstall", self.release, "--namespace", self.release_namespace, check=False)
            raise
        self.log(f"helm release {self.release} installed in {self.release_namespace}")
        previous = os.environ.get("KVSTRATA_CACHE_STATUS_INTERVAL")
        os.environ["KVSTRATA_CACHE_STATUS_INTERVAL"] = str(self.status_interval)
        try:
            self.operator = run_operator(
                self.install, self.state_dir / "operator", extra_args=["--namespace", self.namespace]
            )
        finally:
            if previous is None:
                os.environ.pop("KVSTRATA_CACHE_STATUS_INTERVAL", None)
            else:
                os.environ["KVSTRATA_CACHE_STATUS_INTERVAL"] = previous
        self._record()
        wait_webhook_serving(self.lc, self.namespace)
        self.log(
            f"operator running as ServiceAccount {self.release_namespace}/{self.install.service_account} on "
            f"{self.operator.pod_ip} (pid {self.operator.pid}), log {self.operator.log_path}"
        )

    def prepare_model(self) -> Path:
        """The `models` PVC, bound by the local provisioner, with the tiny model written into its volume."""
        claim, path = model_claim(self.manifest)
        pvc = {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": claim, "namespace": self.namespace},
            "spec": {"accessModes": ["ReadOnlyMany"], "resources": {"requests": {"storage": "1Gi"}}},
        }
        self.lc.apply(pvc)

        def bound() -> str | None:
            got = self.lc.kubectl_json("get", "pvc", claim, "-n", self.namespace)
            return got["spec"].get("volumeName") if got.get("status", {}).get("phase") == "Bound" else None

        pv_name = self.lc.wait_for(f"PVC {claim} bound", bound, timeout=60)
        pv = self.lc.kubectl_json("get", "pv", pv_name)
        host_path = Path(pv["spec"]["hostPath"]["path"])
        model_dir = ensure_tiny_model(host_path / path, **tiny_model_kwargs(self.manifest))
        self.log(f"model volume: PVC {claim} -> PV {pv_name} -> {model_dir}")
        return model_dir

    def apply_cluster(self, manifest: Obj | None = None) -> None:
        if manifest is not None:
            self.manifest = manifest
        self.lc.apply(self.manifest, namespace=self.namespace)

    def start_launcher(self) -> None:
        argv = [
            sys.executable,
            "-m",
            "kvstrata_dev.e2e.launcher",
            "--kubeconfig",
            str(self.lc.kubeconfig),
            "--state-dir",
            str(self.state_dir / "launcher"),
            "--namespace",
            self.namespace,
        ]
        self._spawn("launcher", argv)
        self.log(f"launcher running (pid {self.procs['launcher'].pid}), log {self.procs['launcher'].log}")

    # --- observation -------------------------------------------------------------------------
    def ic(self) -> Obj:
        return self.lc.kubectl_json("get", "inferencecluster", self.name, "-n", self.namespace)

    def pods(self, component: str) -> list[Obj]:
        sel = f"app.kubernetes.io/instance={self.name},app.kubernetes.io/component={component}"
        return self.lc.kubectl_json("get", "pods", "-n", self.namespace, "-l", sel)["items"]

    def launcher_procs(self) -> dict[str, Obj]:
        try:
            return json.loads((self.state_dir / "launcher" / "procs.json").read_text())
        except (OSError, ValueError):
            return {}

    def processes_ready(self) -> bool:
        """Every engine and router pod has a launcher process that passed its readiness probe.

        kwok marks a new pod Ready before the launcher overwrites that (within a second), so the
        cluster's Ready condition alone can be true for that instant without a real engine."""
        pods = {p["metadata"]["uid"] for c in ("engine", "router") for p in self.pods(c)}
        procs = self.launcher_procs()
        return bool(pods) and all(uid in procs and procs[uid]["ready"] for uid in pods)

    def condition(self, ctype: str) -> Obj | None:
        conds = (self.ic().get("status") or {}).get("conditions") or []
        return next((c for c in conds if c.get("type") == ctype), None)

    def wait_ready(self, timeout: float = 900, on_tick: Callable[[Obj], None] | None = None) -> Obj:
        """Until the InferenceCluster's Ready condition is True (real engines answered their probes)."""
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            self.check_alive()
            ic = self.ic()
            st = ic.get("status") or {}
            conds = {c["type"]: c for c in st.get("conditions") or []}
            if on_tick is not None:
                on_tick(ic)
            ready = conds.get("Ready", {})
            if (
                ready.get("status") == "True"
                and st.get("observedGeneration") == ic["metadata"]["generation"]
                and self.processes_ready()
            ):
                return ic
            last = ready.get("message") or st.get("ready")
            time.sleep(2)
        raise StackError(
            f"{self.name} not Ready after {timeout:.0f}s (last: {last}); logs in {self.state_dir}/logs"
        )

    def router_url(self) -> str:
        pods = [p for p in self.pods("router") if p.get("status", {}).get("podIP")]
        if not pods:
            raise StackError("no router pod with an IP")
        port = int((self.manifest["spec"].get("router") or {}).get("port", 8080))
        return f"http://{pods[0]['status']['podIP']}:{port}"

    def served_model(self) -> str:
        model = self.manifest["spec"]["model"]
        return str(model.get("servedName") or model["name"])

    def engine_metrics(self) -> dict[str, str]:
        """Each engine pod's own /metrics text, by pod name."""
        port = int((self.manifest["spec"].get("engine") or {}).get("port", 8000))
        out = {}
        for pod in self.pods("engine"):
            ip = pod.get("status", {}).get("podIP")
            with urllib.request.urlopen(f"http://{ip}:{port}/metrics", timeout=10) as resp:
                out[pod["metadata"]["name"]] = resp.read().decode()
        return out

    def engine_counters(self) -> Counters:
        """The engines' own prefix-cache counters, summed (what the status must agree with)."""
        total = Counters()
        for text in self.engine_metrics().values():
            total = total + parse_engine(text).counters
        return total

    def cache_mark(self) -> tuple[int, Counters]:
        """(status.cache.queriedTokens, the engines' own counters) now: the start of a span that
        `wait_cache_caught_up` compares. The status total also keeps tokens of replaced pods, the engines'
        counters do not, so only growth over the same span is comparable."""
        cache = (self.ic().get("status") or {}).get("cache") or {}
        return int(cache.get("queriedTokens") or 0), self.engine_counters()

    def wait_cache_caught_up(self, mark: tuple[int, Counters], timeout: float = 120) -> tuple[Obj, Counters]:
        """Until status.cache has counted every prompt token the engines counted since `mark`, with a
        window hit rate. Returns the cluster and the engines' counters at that point."""
        status_before, engines_before = mark
        deadline = time.monotonic() + timeout
        while True:
            engines = self.engine_counters()
            grown = int(engines.queries - engines_before.queries)
            ic = self.ic()
            cache = (ic.get("status") or {}).get("cache") or {}
            counted = int(cache.get("queriedTokens") or 0) - status_before
            if cache.get("hitRate") is not None and counted == grown:
                return ic, engines
            if time.monotonic() > deadline:
                raise StackError(
                    f"status.cache counted {counted} of the engines' {grown} new prompt tokens "
                    f"after {timeout:.0f}s: {cache}"
                )
            time.sleep(1)

    # --- teardown ----------------------------------------------------------------------------
    def stop(self, uninstall: bool = True) -> None:
        """Launcher first (it stops engines and the router), then the operator, then the release
        (the CRD stays, as it would for a user: helm keeps it)."""
        p = self.procs.get("launcher")
        if p is not None and p.pid is not None:
            stop_group(p.pid, grace=60)
        if self.operator is not None:
            self.operator.stop()
        stop_recorded(self.state_dir)
        self.procs.clear()
        if uninstall and self.install is not None:
            uninstall_chart(self.install)
            self.install = None
