"""Run the operator against the local (kwok) cluster the way the chart would run it in a real one.

kwok pods run no containers, so the operator's pod from the Helm chart is only a placeholder with an IP. This
module plays its kubelet:

- installs the chart (`helm install`), which creates the ServiceAccount, the ClusterRole, the webhook Secret,
  Service and ValidatingWebhookConfiguration and the operator Deployment;
- mints a token for the chart's ServiceAccount (`kubectl create token`) and writes a kubeconfig with it, so
  the operator process has exactly the chart's RBAC permissions, no more;
- copies the webhook Secret's tls.crt/tls.key into a directory, as the Secret volume would;
- starts `kvstrata operator` bound to the operator pod's IP (127.10.x.y) on the chart's webhook port, so the
  apiserver reaches the webhook through the Service's EndpointSlice, exactly as in a cluster.

Used by the integration tests and the operator benchmark; the e2e launcher can use it too.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvstrata_dev.localcluster.layout import Layout, service_port
from kvstrata_dev.localcluster.session import LocalCluster
from kvstrata_dev.repo import CHART

CRD_NAME = "inferenceclusters.kvstrata.io"
RELEASE = "kvstrata"
NAMESPACE = "kvstrata-system"


@dataclass
class Install:
    lc: LocalCluster
    release: str = RELEASE
    namespace: str = NAMESPACE
    ports: dict[str, int] = field(default_factory=dict)

    @property
    def fullname(self) -> str:
        """The chart's `kvstrata.fullname` (names of its objects)."""
        return self.release[:40] if "kvstrata" in self.release else f"{self.release}-kvstrata"[:40]

    @property
    def service_account(self) -> str:
        return f"{self.fullname}-operator"


def _adopt_crd(lc: LocalCluster, release: str, namespace: str) -> None:
    """A CRD applied by hand (`kubectl apply -f crds/`) is adopted by the release instead of failing it."""
    got = lc.kubectl("get", "crd", CRD_NAME, "-o", "json", check=False)
    if got.returncode != 0:
        return
    ann = json.loads(got.stdout)["metadata"].get("annotations") or {}
    if (
        ann.get("meta.helm.sh/release-name") == release
        and ann.get("meta.helm.sh/release-namespace") == namespace
    ):
        return
    lc.kubectl(
        "annotate",
        "--overwrite",
        "crd",
        CRD_NAME,
        f"meta.helm.sh/release-name={release}",
        f"meta.helm.sh/release-namespace={namespace}",
    )
    lc.kubectl("label", "--overwrite", "crd", CRD_NAME, "app.kubernetes.io/managed-by=Helm")


def install_chart(
    lc: LocalCluster,
    release: str = RELEASE,
    namespace: str = NAMESPACE,
    values: dict[str, Any] | None = None,
    timeout: str = "120s",
) -> Install:
    """`helm upgrade --install` with ports for webhook, metrics and health that no other socket gets meanwhile."""
    ports: dict[str, int] = {}
    for name in ("webhook", "metrics", "health"):
        ports[name] = service_port(taken=ports.values())
    merged: dict[str, Any] = {
        "webhook": {"port": ports["webhook"]},
        "metrics": {"port": ports["metrics"]},
        "health": {"port": ports["health"]},
        # a kwok pod: nothing pulls it, but the name must be valid
        "image": {"repository": "ghcr.io/kvstrata/operator", "tag": "local"},
    }
    for key, value in (values or {}).items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = {**merged[key], **value}
        else:
            merged[key] = value
    _adopt_crd(lc, release, namespace)
    _wait_namespace_not_terminating(lc, namespace)
    lc.helm(
        "upgrade",
        "--install",
        release,
        str(CHART),
        "--namespace",
        namespace,
        "--create-namespace",
        "--wait",
        "--timeout",
        timeout,
        "-f",
        "-",
        input=yaml.safe_dump(merged),
    )
    return Install(lc, release, namespace, ports)


def _wait_namespace_not_terminating(lc: LocalCluster, namespace: str, timeout: float = 120) -> None:
    """A namespace a previous uninstall is still deleting refuses new objects: wait until it is gone."""

    def settled() -> bool:
        proc = lc.kubectl("get", "namespace", namespace, "-o", "jsonpath={.status.phase}", check=False)
        return proc.returncode != 0 or proc.stdout.strip() != "Terminating"

    lc.wait_for(f"namespace {namespace} to finish terminating", settled, timeout=timeout)


def uninstall_chart(inst: Install, delete_namespace: bool = False) -> None:
    """`helm uninstall` (the CRD stays: resource-policy keep); optionally the release's namespace too."""
    inst.lc.helm("uninstall", inst.release, "--namespace", inst.namespace, "--wait", check=False)
    if delete_namespace:
        inst.lc.kubectl(
            "delete", "namespace", inst.namespace, "--wait=false", "--ignore-not-found", check=False
        )


def operator_pod_ip(inst: Install, timeout: float = 60) -> str:
    selector = f"app.kubernetes.io/instance={inst.release},app.kubernetes.io/component=operator"

    def ip() -> str | None:
        pods = inst.lc.kubectl_json("get", "pods", "-n", inst.namespace, "-l", selector)["items"]
        running = [
            p
            for p in pods
            if p.get("status", {}).get("phase") == "Running"
            and p["status"].get("podIP")
            and not p["metadata"].get("deletionTimestamp")
        ]
        return running[0]["status"]["podIP"] if len(running) == 1 else None

    return inst.lc.wait_for("the operator pod's IP", ip, timeout=timeout)


def service_account_kubeconfig(inst: Install, path: Path) -> Path:
    """A kubeconfig that authenticates as the chart's ServiceAccount (a bound token, 6 h)."""
    sa = inst.service_account
    token = inst.lc.kubectl("create", "token", sa, "-n", inst.namespace, "--duration=6h").stdout.strip()
    ca = Layout(inst.lc.state_dir).pki.ca_crt.read_bytes()
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "local",
                "cluster": {
                    "server": inst.lc.server,
                    "certificate-authority-data": base64.b64encode(ca).decode(),
                },
            }
        ],
        "users": [{"name": sa, "user": {"token": token}}],
        "contexts": [{"name": sa, "context": {"cluster": "local", "user": sa, "namespace": inst.namespace}}],
        "current-context": sa,
    }
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)
    return path


def webhook_cert_dir(inst: Install, path: Path) -> Path:
    """What the Secret volume would hold: tls.crt, tls.key (and ca.crt)."""
    secret = inst.lc.kubectl_json("get", "secret", f"{inst.fullname}-webhook-tls", "-n", inst.namespace)
    path.mkdir(parents=True, exist_ok=True)
    for key, value in secret["data"].items():
        (path / key).write_bytes(base64.b64decode(value))
    (path / "tls.key").chmod(0o600)
    return path


@dataclass
class OperatorProcess:
    inst: Install
    pod_ip: str
    kubeconfig: Path
    cert_dir: Path
    log_path: Path
    extra_args: list[str] = field(default_factory=list)
    proc: subprocess.Popen[bytes] | None = None

    def argv(self) -> list[str]:
        p = self.inst.ports
        # The console script the image's entrypoint runs; `python -m kvstrata.cli` when not installed.
        script = Path(sys.executable).parent / "kvstrata"
        entry = [str(script)] if script.exists() else [sys.executable, "-m", "kvstrata.cli"]
        return [
            *entry,
            "operator",
            f"--kubeconfig={self.kubeconfig}",
            f"--webhook-addr={self.pod_ip}",
            f"--webhook-port={p['webhook']}",
            f"--webhook-cert-dir={self.cert_dir}",
            f"--metrics-addr={self.pod_ip}",
            f"--metrics-port={p['metrics']}",
            f"--health-addr={self.pod_ip}",
            f"--health-port={p['health']}",
            "--log-format=json",
            *self.extra_args,
        ]

    def start(self, ready_timeout: float = 60) -> None:
        env = dict(os.environ)
        env.pop("KUBECONFIG", None)  # the SA kubeconfig only: never the admin one
        env["PYTHONUNBUFFERED"] = "1"
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                self.argv(), stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        try:
            self.wait_ready(ready_timeout)
        except BaseException:
            self.stop(signal.SIGKILL)  # never leave a half-started operator behind
            raise

    def healthy(self) -> bool:
        try:
            url = f"http://{self.pod_ip}:{self.inst.ports['health']}/healthz"
            with urllib.request.urlopen(url, timeout=2) as resp:
                return resp.status == 200
        except OSError:
            return False

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"operator exited with {self.proc.returncode}:\n{self.log_tail()}")
            if self.healthy():
                return
            time.sleep(0.2)
        raise TimeoutError(f"operator not healthy after {timeout}s:\n{self.log_tail()}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else None
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(10)

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def metrics(self) -> str:
        url = f"http://{self.pod_ip}:{self.inst.ports['metrics']}/metrics"
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.read().decode()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None


def run_operator(inst: Install, workdir: Path, extra_args: list[str] | None = None) -> OperatorProcess:
    workdir.mkdir(parents=True, exist_ok=True)
    op = OperatorProcess(
        inst=inst,
        pod_ip=operator_pod_ip(inst),
        kubeconfig=service_account_kubeconfig(inst, workdir / "operator.kubeconfig"),
        cert_dir=webhook_cert_dir(inst, workdir / "webhook-tls"),
        log_path=workdir / "operator.log",
        extra_args=list(extra_args or []),
    )
    op.start()
    return op


def ensure_model_claim(lc: LocalCluster, namespace: str, name: str = "models") -> None:
    """The claim the examples' `source: pvc://models/...` reads weights from (a user creates it in a real
    cluster); the local provisioner binds it."""
    claim = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "1Gi"}}},
    }
    lc.kubectl("apply", "-f", "-", input=json.dumps(claim))


def wait_webhook_serving(lc: LocalCluster, namespace: str, timeout: float = 60) -> None:
    """Until a server-side dry-run create reaches the webhook (the EndpointSlice may lag the pod)."""
    probe = {
        "apiVersion": "kvstrata.io/v1alpha1",
        "kind": "InferenceCluster",
        "metadata": {"name": "webhook-probe", "namespace": namespace},
        "spec": {"model": {"name": "meta-llama/Llama-3.1-8B-Instruct", "source": "hf://meta-llama/x"}},
    }

    def ok() -> bool:
        r = lc.kubectl("create", "--dry-run=server", "-f", "-", input=json.dumps(probe), check=False)
        return r.returncode == 0

    lc.wait_for("the validating webhook to answer", ok, timeout=timeout)
