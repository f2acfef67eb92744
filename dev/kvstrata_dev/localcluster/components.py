"""Command lines of the control-plane processes: pure functions of the layout and ports."""

from __future__ import annotations

from pathlib import Path

from kvstrata_dev.localcluster.build import KWOK_STAGES
from kvstrata_dev.localcluster.layout import SERVICE_CIDR, Layout

SA_ISSUER = "https://kubernetes.default.svc.cluster.local"
# kwok's fallback pool for a node without spec.podCIDR (ours all have one).
KWOK_FALLBACK_CIDR = "127.10.0.0/24"


def etcd(bin_dir: Path, layout: Layout, ports: dict[str, int]) -> list[str]:
    client = f"http://127.0.0.1:{ports['etcd']}"
    peer = f"http://127.0.0.1:{ports['etcd-peer']}"
    return [
        str(bin_dir / "etcd"),
        "--name=kvstrata",
        f"--data-dir={layout.etcd_data}",
        f"--listen-client-urls={client}",
        f"--advertise-client-urls={client}",
        f"--listen-peer-urls={peer}",
        f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster=kvstrata={peer}",
        # a throw-away test store: durability buys nothing and fsync costs seconds on a busy disk
        "--unsafe-no-fsync",
        "--log-level=warn",
    ]


def kube_apiserver(bin_dir: Path, layout: Layout, ports: dict[str, int]) -> list[str]:
    pki = layout.pki
    return [
        str(bin_dir / "kube-apiserver"),
        f"--etcd-servers=http://127.0.0.1:{ports['etcd']}",
        "--bind-address=127.0.0.1",
        "--advertise-address=127.0.0.1",
        f"--secure-port={ports['apiserver']}",
        f"--tls-cert-file={pki.serving_crt}",
        f"--tls-private-key-file={pki.serving_key}",
        f"--client-ca-file={pki.ca_crt}",
        f"--service-account-key-file={pki.sa_pub}",
        f"--service-account-signing-key-file={pki.sa_key}",
        f"--service-account-issuer={SA_ISSUER}",
        f"--service-cluster-ip-range={SERVICE_CIDR}",
        "--authorization-mode=Node,RBAC",
        # webhooks and aggregated APIs are reached through EndpointSlices (pod IPs), never ClusterIPs
        "--enable-aggregator-routing=true",
        f"--proxy-client-cert-file={pki.client_crt('apiserver-client')}",
        f"--proxy-client-key-file={pki.client_key('apiserver-client')}",
        f"--requestheader-client-ca-file={pki.ca_crt}",
        "--requestheader-allowed-names=kube-apiserver",
        "--requestheader-username-headers=X-Remote-User",
        "--requestheader-group-headers=X-Remote-Group",
        "--requestheader-extra-headers-prefix=X-Remote-Extra-",
        # The `kubernetes` Endpoints would hold 127.0.0.1, which Endpoints validation forbids.
        "--endpoint-reconciler-type=none",
        "--allow-privileged=true",
        "--profiling=false",
        "--event-ttl=30m",
        "--v=1",
    ]


def kube_controller_manager(bin_dir: Path, layout: Layout, ports: dict[str, int]) -> list[str]:
    pki = layout.pki
    kc = layout.component_kubeconfig("controller-manager")
    return [
        str(bin_dir / "kube-controller-manager"),
        f"--kubeconfig={kc}",
        f"--authentication-kubeconfig={kc}",
        f"--authorization-kubeconfig={kc}",
        "--bind-address=127.0.0.1",
        f"--secure-port={ports['controller-manager']}",
        "--controllers=*",
        # with a signing key the service-account token controller runs (token Secrets, root CA)
        f"--service-account-private-key-file={pki.sa_key}",
        f"--root-ca-file={pki.ca_crt}",
        "--use-service-account-credentials=true",
        f"--cluster-signing-cert-file={pki.ca_crt}",
        f"--cluster-signing-key-file={pki.ca_key}",
        f"--service-cluster-ip-range={SERVICE_CIDR}",
        "--leader-elect=false",
        "--v=1",
    ]


def kube_scheduler(bin_dir: Path, layout: Layout, ports: dict[str, int]) -> list[str]:
    kc = layout.component_kubeconfig("scheduler")
    return [
        str(bin_dir / "kube-scheduler"),
        f"--kubeconfig={kc}",
        f"--authentication-kubeconfig={kc}",
        f"--authorization-kubeconfig={kc}",
        "--bind-address=127.0.0.1",
        f"--secure-port={ports['scheduler']}",
        "--leader-elect=false",
        "--v=1",
    ]


def kwok(bin_dir: Path, layout: Layout, ports: dict[str, int]) -> list[str]:
    return [
        str(bin_dir / "kwok"),
        f"--kubeconfig={layout.component_kubeconfig('kwok')}",
        f"--config={bin_dir / KWOK_STAGES}",
        "--manage-all-nodes=true",
        f"--cidr={KWOK_FALLBACK_CIDR}",
        # the node address (also each pod's hostIP) stays on loopback: nothing may dial elsewhere
        "--node-ip=127.0.0.1",
        "--node-lease-duration-seconds=40",
    ]
