"""The local control plane does what the operator's tests rely on, checked against the real thing:
kube-apiserver + controller-manager + scheduler + etcd, kwok nodes, the PV provisioner and the
loopback EndpointSlices of the harness, RBAC, helm and kubectl."""

from __future__ import annotations

import base64
import ipaddress
import json
import ssl
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from kvstrata_dev.localcluster import versions
from kvstrata_dev.localcluster.pki import serving_certs
from kvstrata_dev.localcluster.session import CommandError, LocalCluster

pytestmark = pytest.mark.cluster


def _ready(obj: dict[str, Any]) -> bool:
    conds = obj.get("status", {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conds)


def test_nodes_are_ready_with_advertised_capacity(local_cluster: LocalCluster) -> None:
    nodes = {n["metadata"]["name"]: n for n in local_cluster.kubectl_json("get", "nodes")["items"]}
    gpu = [n for n in nodes.values() if n["metadata"]["labels"].get("nvidia.com/gpu.present") == "true"]
    cpu = [n for n in nodes.values() if "nvidia.com/gpu" not in n["status"]["capacity"]]
    assert len(gpu) >= 2
    assert len(cpu) >= 2
    for n in gpu:
        cap = n["status"]["capacity"]
        assert (cap["nvidia.com/gpu"], cap["cpu"], cap["memory"]) == ("8", "64", "512Gi")
        assert n["status"]["allocatable"]["nvidia.com/gpu"] == "8"
    for n in cpu:
        cap = n["status"]["capacity"]
        assert (cap["cpu"], cap["memory"]) == ("32", "128Gi")
        assert "nvidia.com/gpu.present" not in n["metadata"]["labels"]
    not_ready = [name for name, n in nodes.items() if not _ready(n)]
    assert not_ready == []


def _statefulset(name: str, replicas: int, gpus: int, storage: str) -> list[dict[str, Any]]:
    labels = {"app": name}
    resources = {"cpu": "4", "memory": "16Gi"}
    if gpus:
        resources["nvidia.com/gpu"] = str(gpus)
    return [
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": name},
            "spec": {"clusterIP": "None", "selector": labels, "ports": [{"name": "http", "port": 8000}]},
        },
        {
            "apiVersion": "apps/v1",
            "kind": "StatefulSet",
            "metadata": {"name": name},
            "spec": {
                "serviceName": name,
                "replicas": replicas,
                "selector": {"matchLabels": labels},
                "template": {
                    "metadata": {"labels": labels},
                    "spec": {
                        "nodeSelector": {"nvidia.com/gpu.present": "true"} if gpus else {},
                        "containers": [
                            {
                                "name": "engine",
                                "image": "example.invalid/engine:never-pulled",
                                "ports": [{"name": "http", "containerPort": 8000}],
                                "resources": {"requests": resources, "limits": resources},
                                "volumeMounts": [{"name": "kv", "mountPath": "/kv-cache"}],
                            }
                        ],
                    },
                },
                "volumeClaimTemplates": [
                    {
                        "metadata": {"name": "kv"},
                        "spec": {
                            "accessModes": ["ReadWriteOnce"],
                            "resources": {"requests": {"storage": storage}},
                        },
                    }
                ],
            },
        },
    ]


def _pods(lc: LocalCluster, ns: str, app: str) -> list[dict[str, Any]]:
    return lc.kubectl_json("get", "pods", "-n", ns, "-l", f"app={app}")["items"]


def _running_ready(lc: LocalCluster, ns: str, app: str, count: int) -> list[dict[str, Any]] | None:
    pods = [p for p in _pods(lc, ns, app) if p["status"].get("phase") == "Running" and _ready(p)]
    return pods if len(pods) == count else None


def test_statefulset_gets_running_pods_on_loopback_ips_and_bound_pvcs(
    local_cluster: LocalCluster, namespace: str
) -> None:
    lc = local_cluster
    lc.apply(*_statefulset("engine", replicas=2, gpus=4, storage="5Gi"), namespace=namespace)
    pods = lc.wait_for("2 running pods", lambda: _running_ready(lc, namespace, "engine", 2), timeout=90)

    cidr = ipaddress.ip_network(lc.pod_ip_cidr)
    assert cidr.subnet_of(ipaddress.ip_network("127.0.0.0/8"))
    ips = [p["status"]["podIP"] for p in pods]
    assert all(ipaddress.ip_address(ip) in cidr for ip in ips), ips
    assert len(set(ips)) == 2
    nodes = {p["spec"]["nodeName"] for p in pods}
    assert all(n.startswith("kwok-gpu-") for n in nodes), nodes

    claims = lc.kubectl_json("get", "pvc", "-n", namespace)["items"]
    assert sorted(c["metadata"]["name"] for c in claims) == ["kv-engine-0", "kv-engine-1"]
    for c in claims:
        assert c["status"]["phase"] == "Bound"
        assert c["status"]["capacity"]["storage"] == "5Gi"
        assert c["spec"]["storageClassName"] == "kvstrata-local"
        pv = lc.kubectl_json("get", "pv", c["spec"]["volumeName"])
        assert Path(pv["spec"]["hostPath"]["path"]).is_dir()
        assert Path(pv["spec"]["hostPath"]["path"]).is_relative_to(lc.state_dir)

    # The harness publishes the pods' loopback IPs as an FQDN EndpointSlice of the Service.
    def slice_addresses() -> list[str] | None:
        items = lc.kubectl_json(
            "get", "endpointslices", "-n", namespace, "-l", "kubernetes.io/service-name=engine"
        )
        got = sorted(
            a
            for s in items["items"]
            if s["addressType"] == "FQDN"
            for e in s["endpoints"]
            for a in e["addresses"]
        )
        return got if got == sorted(ips) else None

    lc.wait_for("EndpointSlice with the pod IPs", slice_addresses, timeout=30)


def test_deleting_a_statefulset_collects_its_pods_and_released_volumes(
    local_cluster: LocalCluster, namespace: str
) -> None:
    lc = local_cluster
    lc.apply(*_statefulset("gc", replicas=2, gpus=0, storage="1Gi"), namespace=namespace)
    lc.wait_for("2 running pods", lambda: _running_ready(lc, namespace, "gc", 2), timeout=90)
    claims = lc.kubectl_json("get", "pvc", "-n", namespace)["items"]
    volumes = [c["spec"]["volumeName"] for c in claims]
    dirs = [Path(lc.kubectl_json("get", "pv", v)["spec"]["hostPath"]["path"]) for v in volumes]
    assert len(volumes) == 2
    assert all(d.is_dir() for d in dirs)

    lc.kubectl("delete", "statefulset", "gc", "-n", namespace, "--wait=false")
    lc.wait_for("pods to be garbage-collected", lambda: _pods(lc, namespace, "gc") == [], timeout=90)

    # StatefulSets keep their PVCs; deleting them releases the PVs, which the provisioner removes.
    lc.kubectl("delete", "pvc", "--all", "-n", namespace, "--wait=false")

    def volumes_gone() -> bool:
        left = lc.kubectl("get", "pv", *volumes, "--ignore-not-found", "-o", "name").stdout.strip()
        return not left and not any(d.exists() for d in dirs)

    lc.wait_for("released PVs and their directories to be deleted", volumes_gone, timeout=60)


def _as_token(lc: LocalCluster, token: str, *args: str) -> Any:
    """kubectl with only a bearer token (no admin client cert in play)."""
    ca = lc.kubectl_json("config", "view", "--raw")["clusters"][0]["cluster"]["certificate-authority"]
    return lc.kubectl(
        "--kubeconfig=/dev/null",
        f"--server={lc.server}",
        f"--certificate-authority={ca}",
        f"--token={token}",
        *args,
        check=False,
    )


def test_rbac_denies_a_service_account_without_a_binding(local_cluster: LocalCluster, namespace: str) -> None:
    lc = local_cluster
    lc.kubectl("create", "serviceaccount", "nobody", "-n", namespace)
    token = lc.kubectl("create", "token", "nobody", "-n", namespace).stdout.strip()

    denied = _as_token(lc, token, "get", "pods", "-n", namespace)
    assert denied.returncode != 0
    assert "forbidden" in denied.stderr.lower()
    assert f"system:serviceaccount:{namespace}:nobody" in denied.stderr

    # The same token works once RBAC allows it: the denial was authorization, not a bad token.
    lc.kubectl(
        "create",
        "rolebinding",
        "nobody-view",
        "--clusterrole=view",
        f"--serviceaccount={namespace}:nobody",
        "-n",
        namespace,
    )
    allowed = lc.wait_for(
        "the RoleBinding to take effect",
        lambda: (r := _as_token(lc, token, "get", "pods", "-n", namespace)).returncode == 0 and r,
        timeout=30,
    )
    assert allowed.returncode == 0


def test_kubectl_and_helm_report_their_versions(local_cluster: LocalCluster) -> None:
    v = json.loads(local_cluster.kubectl("version", "-o", "json").stdout)
    assert v["clientVersion"]["gitVersion"] == versions.KUBERNETES
    assert v["serverVersion"]["gitVersion"] == versions.KUBERNETES
    helm = local_cluster.helm("version", "--short").stdout
    assert helm.startswith(versions.HELM), helm
    # helm talks to the cluster through the same kubeconfig
    assert local_cluster.helm("list", "--all-namespaces").returncode == 0


def test_helm_installs_and_uninstalls_a_chart(
    local_cluster: LocalCluster, namespace: str, tmp_path: Path
) -> None:
    chart = tmp_path / "hello"
    (chart / "templates").mkdir(parents=True)
    (chart / "Chart.yaml").write_text("apiVersion: v2\nname: hello\nversion: 0.1.0\n")
    (chart / "values.yaml").write_text("greeting: hi\n")
    (chart / "templates" / "cm.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {{ .Release.Name }}-cm\n"
        "data:\n  greeting: {{ .Values.greeting | quote }}\n"
    )
    lc = local_cluster
    lc.helm(
        "install",
        "demo",
        str(chart),
        "-n",
        namespace,
        "--set",
        "greeting=hello",
        "--wait",
        "--timeout",
        "60s",
    )
    assert lc.kubectl_json("get", "configmap", "demo-cm", "-n", namespace)["data"] == {"greeting": "hello"}
    lc.helm("uninstall", "demo", "-n", namespace, "--wait")
    gone = lc.kubectl("get", "configmap", "demo-cm", "-n", namespace, check=False)
    assert gone.returncode != 0
    assert "NotFound" in gone.stderr


class _DenyLabelled(BaseHTTPRequestHandler):
    """A validating webhook that refuses ConfigMaps labelled deny=yes."""

    def do_POST(self) -> None:
        review = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        obj = review["request"]["object"]
        deny = (obj["metadata"].get("labels") or {}).get("deny") == "yes"
        body = {
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "response": {"uid": review["request"]["uid"], "allowed": not deny},
        }
        if deny:
            body["response"]["status"] = {"code": 403, "message": "denied by the pod-IP webhook"}
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def webhook_pod_ip(local_cluster: LocalCluster, namespace: str) -> str:
    lc = local_cluster
    lc.apply(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "webhook", "labels": {"app": "webhook"}},
            "spec": {"containers": [{"name": "w", "image": "example.invalid/webhook:never-pulled"}]},
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "webhook"},
            "spec": {
                "selector": {"app": "webhook"},
                "ports": [{"name": "https", "port": 443, "targetPort": 8443}],
            },
        },
        namespace=namespace,
    )
    pods = lc.wait_for("webhook pod", lambda: _running_ready(lc, namespace, "webhook", 1), timeout=60)
    return str(pods[0]["status"]["podIP"])


@pytest.fixture
def webhook_server(webhook_pod_ip: str, namespace: str, tmp_path: Path) -> Iterator[str]:
    """A real HTTPS server bound to the pod's loopback IP; yields the CA bundle (base64)."""
    certs = serving_certs(tmp_path, [f"webhook.{namespace}.svc"])
    server = ThreadingHTTPServer((webhook_pod_ip, 8443), _DenyLabelled)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(str(certs.crt), str(certs.key))
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield base64.b64encode(certs.ca_crt.read_bytes()).decode()
    finally:
        server.shutdown()
        server.server_close()


def test_a_service_webhook_reaches_a_process_on_the_pod_ip(
    local_cluster: LocalCluster, namespace: str, webhook_server: str
) -> None:
    lc = local_cluster
    name = f"deny-labelled-{namespace}"
    lc.apply(
        {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingWebhookConfiguration",
            "metadata": {"name": name},
            "webhooks": [
                {
                    "name": "deny.kvstrata.io",
                    "clientConfig": {
                        "service": {
                            "namespace": namespace,
                            "name": "webhook",
                            "port": 443,
                            "path": "/validate",
                        },
                        "caBundle": webhook_server,
                    },
                    "rules": [
                        {
                            "apiGroups": [""],
                            "apiVersions": ["v1"],
                            "operations": ["CREATE"],
                            "resources": ["configmaps"],
                        }
                    ],
                    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
                    "failurePolicy": "Fail",
                    "sideEffects": "None",
                    "admissionReviewVersions": ["v1"],
                    "timeoutSeconds": 5,
                }
            ],
        }
    )
    try:

        def denied() -> str | None:
            manifest = {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": "bad", "labels": {"deny": "yes"}},
            }
            r = lc.kubectl(
                "create",
                "-n",
                namespace,
                "--dry-run=server",
                "-f",
                "-",
                input=json.dumps(manifest),
                check=False,
            )
            return r.stderr if "denied by the pod-IP webhook" in r.stderr else None

        message = lc.wait_for("the webhook to deny", denied, timeout=60)
        assert "deny.kvstrata.io" in message
        ok = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "good"}}
        lc.kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(ok))
    finally:
        lc.kubectl("delete", "validatingwebhookconfiguration", name, "--ignore-not-found", check=False)


def test_kubectl_errors_are_reported_with_stderr(local_cluster: LocalCluster) -> None:
    with pytest.raises(CommandError, match=r"NotFound|not found"):
        local_cluster.kubectl("get", "namespace", "does-not-exist-kvstrata")
