"""Pure parts of the local cluster: go.mod surgery, PV and EndpointSlice decisions, manifests, ports."""

from __future__ import annotations

import random
from pathlib import Path

from kvstrata_dev.localcluster import build, harness, layout, manifests
from kvstrata_dev.localcluster.layout import choose_ports, port_is_free, service_port

KUBERNETES_GO_MOD = """module k8s.io/kubernetes

go 1.26.0

require (
\tgithub.com/foo/bar v1.2.3
\tk8s.io/api v0.0.0
\tk8s.io/client-go v0.0.0 // indirect
\tk8s.io/utils v0.0.0-20260626114624-be93311217bd
)

require k8s.io/kubectl v0.0.0

replace (
\tk8s.io/api => ./staging/src/k8s.io/api
\tk8s.io/client-go => ./staging/src/k8s.io/client-go
\tk8s.io/kubectl => ./staging/src/k8s.io/kubectl
\tk8s.io/sample-cli-plugin => ./staging/src/k8s.io/sample-cli-plugin
)
"""


def test_staging_replaces_cover_required_staging_modules_only() -> None:
    got = build.staging_replaces(KUBERNETES_GO_MOD, "v0.37.2")
    assert got == {"k8s.io/api": "v0.37.2", "k8s.io/client-go": "v0.37.2", "k8s.io/kubectl": "v0.37.2"}


def test_wrapper_go_mod_requires_and_replaces() -> None:
    comp = build.Component("k", "k8s.io/kubernetes", "v1.37.2", {}, replaces={"k8s.io/api": "v0.37.2"})
    text = build.wrapper_go_mod(comp)
    assert "require k8s.io/kubernetes v1.37.2" in text
    assert "\tk8s.io/api => k8s.io/api v0.37.2" in text


def test_version_ldflags_name_the_release() -> None:
    flags = build.kubernetes_version_ldflags("v1.37.2")
    assert "-X k8s.io/component-base/version.gitVersion=v1.37.2" in flags
    assert "-X k8s.io/client-go/pkg/version.gitMinor=37" in flags


def _claim(phase: str = "Pending", sc: str | None = manifests.STORAGE_CLASS, volume: str = "") -> dict:
    return {
        "metadata": {"name": "kv-engine-0", "namespace": "ns", "uid": "0123456789abcdef"},
        "spec": {
            "storageClassName": sc,
            "volumeName": volume,
            "accessModes": ["ReadWriteOnce"],
            "resources": {"requests": {"storage": "5Gi"}},
        },
        "status": {"phase": phase},
    }


def test_only_pending_unbound_claims_of_our_class_want_a_volume() -> None:
    assert harness.wants_volume(_claim())
    assert not harness.wants_volume(_claim(phase="Bound"))
    assert not harness.wants_volume(_claim(sc="other"))
    assert not harness.wants_volume(_claim(volume="pv-1"))


def test_pv_is_prebound_sized_and_under_the_volumes_dir(tmp_path: Path) -> None:
    pv = harness.pv_for_claim(_claim(), tmp_path)
    spec = pv["spec"]
    assert spec["capacity"] == {"storage": "5Gi"}
    assert spec["claimRef"]["uid"] == "0123456789abcdef"
    assert spec["claimRef"]["name"] == "kv-engine-0"
    assert Path(spec["hostPath"]["path"]).parent == tmp_path
    assert pv["metadata"]["annotations"]["pv.kubernetes.io/provisioned-by"] == manifests.PROVISIONER


def _pod(name: str, ip: str, ready: bool, labels: dict[str, str]) -> dict:
    return {
        "metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}", "labels": labels},
        "spec": {
            "nodeName": "kwok-gpu-0",
            "containers": [{"ports": [{"name": "http", "containerPort": 8000}]}],
        },
        "status": {
            "phase": "Running",
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def test_slice_lists_selected_pods_with_readiness_and_resolves_named_ports() -> None:
    svc = {
        "metadata": {"name": "engine", "namespace": "ns", "uid": "svc-uid"},
        "spec": {"selector": {"app": "e"}, "ports": [{"name": "http", "port": 80, "targetPort": "http"}]},
    }
    pods = [
        _pod("e-1", "127.10.1.3", False, {"app": "e"}),
        _pod("e-0", "127.10.1.2", True, {"app": "e"}),
        _pod("other", "127.10.1.9", True, {"app": "x"}),
    ]
    s = harness.slice_for_service(svc, pods)
    assert s is not None
    assert s["addressType"] == "FQDN"
    assert s["metadata"]["labels"]["kubernetes.io/service-name"] == "engine"
    assert [(e["addresses"], e["conditions"]["ready"]) for e in s["endpoints"]] == [
        (["127.10.1.2"], True),
        (["127.10.1.3"], False),
    ]
    assert s["ports"] == [{"name": "http", "port": 8000, "protocol": "TCP"}]


def test_services_without_selector_get_no_slice() -> None:
    svc = {"metadata": {"name": "x", "namespace": "ns", "uid": "u"}, "spec": {"ports": [{"port": 1}]}}
    assert harness.slice_for_service(svc, []) is None


def test_nodes_have_distinct_loopback_pod_cidrs_and_gpu_capacity() -> None:
    nodes = manifests.nodes()
    cidrs = [n["spec"]["podCIDR"] for n in nodes]
    assert len(set(cidrs)) == len(nodes) == 4
    assert all(c.startswith("127.10.") for c in cidrs)
    gpu = [n for n in nodes if "nvidia.com/gpu" in n["status"]["capacity"]]
    assert [n["status"]["capacity"]["nvidia.com/gpu"] for n in gpu] == ["8", "8"]


def test_busy_preferred_port_is_replaced() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = s.getsockname()[1]
        ports = choose_ports({"a": busy, "b": busy})
    assert ports["a"] != busy
    assert ports["b"] not in (busy, ports["a"])
    assert all(port_is_free(p) for p in ports.values())


def test_service_ports_stay_below_the_ephemeral_range_and_skip_taken_ones() -> None:
    """A server's port chosen ahead of its bind must be one the kernel never hands out by itself."""
    low = layout._ephemeral_low()
    picks = [service_port(rng=random.Random(seed)) for seed in range(50)]
    assert all(layout._SERVICE_PORTS_FROM <= p < low for p in picks)
    first = service_port(rng=random.Random(7))
    again = service_port(taken=[first], rng=random.Random(7))
    assert again != first


def test_service_port_skips_a_port_bound_on_any_address() -> None:
    import socket

    rng_seed = 11
    wanted = service_port(rng=random.Random(rng_seed))
    with socket.socket() as s:
        s.bind(("127.10.1.2", wanted))  # another address than the check's own: still a conflict
        s.listen()
        assert service_port(rng=random.Random(rng_seed)) != wanted
