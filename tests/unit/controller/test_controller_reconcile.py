"""Reconcile against an in-memory API: what is applied, in which order, and what status says."""

from __future__ import annotations

import copy

import pytest
from controller_fakes import FakeKube, example

from kvstrata.controller.apply import Applier, immutable_diff, pvcs_to_grow
from kvstrata.controller.kube import KubeError
from kvstrata.controller.reconcile import Fatal, Reconciler, Retry
from kvstrata.controller.statussync import StatusSync
from kvstrata.controller.store import Store

IC = "InferenceCluster"


class Rig:
    def __init__(self, monitoring: bool = False) -> None:
        self.kube = FakeKube()
        self.store = Store()
        self.sync = StatusSync(self.kube, self.store, now=lambda: "T")  # type: ignore[arg-type]
        self.events: list[tuple[str, str, str]] = []
        self.reconciler = Reconciler(
            Applier(self.kube, sleep=lambda _: None),  # type: ignore[arg-type]
            self.store,
            self.sync,
            lambda body, t, r, m: self.events.append((t, r, m)),
            served=lambda api_version, kind: monitoring,
        )

    def create(self, body: dict) -> dict:
        self.kube.objects[(IC, body["metadata"]["namespace"], body["metadata"]["name"])] = copy.deepcopy(body)
        return body

    def status(self, name: str, ns: str = "ns") -> dict:
        return self.kube.objects[(IC, ns, name)].get("status", {})

    def conds(self, name: str) -> dict[str, dict]:
        return {c["type"]: c for c in self.status(name)["conditions"]}


def applied_kinds(kube: FakeKube) -> list[str]:
    return [kind for verb, kind, _ in kube.calls if verb == "apply"]


def test_feasible_spec_applies_every_child_in_order_and_writes_status() -> None:
    rig = Rig()
    body = rig.create(example("tiny-cpu.yaml"))
    out = rig.reconciler.reconcile(body)
    assert out.result == "applied"
    assert applied_kinds(rig.kube) == [
        "ConfigMap",
        "ServiceAccount",
        "Role",
        "RoleBinding",
        "Service",
        "StatefulSet",
        "PodDisruptionBudget",
        "Deployment",
        "Service",
    ]
    sts = rig.kube.objects[("StatefulSet", "ns", "tiny-engine")]
    assert sts["spec"]["replicas"] == 3
    assert sts["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    st = rig.status("tiny")
    assert st["observedGeneration"] == 1 and st["tiers"] == "gpu" and st["plan"]["verdict"] == "fits"
    assert st["selector"] == "app.kubernetes.io/component=engine,app.kubernetes.io/instance=tiny"
    assert rig.conds("tiny")["Planned"]["status"] == "True"
    assert rig.conds("tiny")["Ready"]["status"] == "False"  # no pods yet
    assert rig.events == []


def test_with_the_prometheus_operator_each_cluster_gets_its_monitors() -> None:
    rig = Rig(monitoring=True)
    rig.reconciler.reconcile(rig.create(example("tiny-cpu.yaml")))
    assert applied_kinds(rig.kube)[-1:] == ["ServiceMonitor"]
    sm = rig.kube.objects[("ServiceMonitor", "ns", "tiny")]
    assert sm["spec"]["endpoints"][0]["port"] == "http"
    # An NVMe tier's janitor is scraped per pod, on the port its native sidecar declares.
    rig = Rig(monitoring=True)
    rig.reconciler.reconcile(rig.create(example("tiny-cpu-tiered.yaml")))
    assert applied_kinds(rig.kube)[-2:] == ["ServiceMonitor", "PodMonitor"]
    pm = rig.kube.objects[("PodMonitor", "ns", "tiny-tiered-fs-janitor")]
    sts = rig.kube.objects[("StatefulSet", "ns", "tiny-tiered-engine")]
    (janitor,) = sts["spec"]["template"]["spec"]["initContainers"]
    assert pm["spec"]["podMetricsEndpoints"][0]["port"] == janitor["ports"][0]["name"]
    assert (
        pm["spec"]["selector"]["matchLabels"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
    )


def test_infeasible_spec_creates_nothing_and_says_why() -> None:
    rig = Rig()
    body = rig.create(example("infeasible-405b-one-gpu.yaml"))
    out = rig.reconciler.reconcile(body)
    assert out.result == "infeasible"
    assert applied_kinds(rig.kube) == []
    planned = rig.conds("too-big")["Planned"]
    assert planned["status"] == "False" and planned["reason"] == "Infeasible"
    assert "spec.engine" in planned["message"]
    assert rig.events and rig.events[0][:2] == ("Warning", "Infeasible")
    assert rig.status("too-big")["plan"]["verdict"] == "infeasible"
    rig.reconciler.reconcile(body)  # a resync of the same spec: no second Event
    assert len(rig.events) == 1


def test_infeasible_update_leaves_existing_children_alone() -> None:
    rig = Rig()
    body = rig.create(example("llama-8b-single-gpu.yaml"))
    rig.reconciler.reconcile(body)
    before = copy.deepcopy(rig.kube.objects[("StatefulSet", "ns", "llama-8b-engine")])
    bad = copy.deepcopy(body)
    bad["metadata"]["generation"] = 2
    bad["spec"]["engine"]["maxModelLen"] = 10_000_000
    rig.kube.calls.clear()
    assert rig.reconciler.reconcile(bad).result == "infeasible"
    assert applied_kinds(rig.kube) == []
    assert rig.kube.objects[("StatefulSet", "ns", "llama-8b-engine")] == before
    assert rig.status("llama-8b")["observedGeneration"] == 2


def test_second_reconcile_of_same_spec_writes_no_status() -> None:
    rig = Rig()
    body = rig.create(example("tiny-cpu.yaml"))
    rig.reconciler.reconcile(body)
    rig.kube.calls.clear()
    rig.reconciler.reconcile(body)
    assert not [c for c in rig.kube.calls if c[0] == "patch/status"]


def test_changed_flags_change_the_pod_template_digest() -> None:
    rig = Rig()
    body = rig.create(example("tiny-cpu.yaml"))
    rig.reconciler.reconcile(body)
    ann = "kvstrata.io/flags-digest"
    d1 = rig.kube.objects[("StatefulSet", "ns", "tiny-engine")]["spec"]["template"]["metadata"][
        "annotations"
    ][ann]
    body2 = copy.deepcopy(body)
    body2["metadata"]["generation"] = 2
    body2["spec"]["engine"]["maxNumSeqs"] = 4
    assert rig.reconciler.reconcile(body2).result == "applied"
    d2 = rig.kube.objects[("StatefulSet", "ns", "tiny-engine")]["spec"]["template"]["metadata"][
        "annotations"
    ][ann]
    assert d1 != d2


def test_api_errors_become_retry_or_fatal() -> None:
    rig = Rig()
    body = rig.create(example("tiny-cpu.yaml"))
    rig.kube.fail[("apply", "StatefulSet")] = KubeError(503, "ServiceUnavailable", "etcd down")
    with pytest.raises(Retry):
        rig.reconciler.reconcile(body)
    rig.kube.fail[("apply", "StatefulSet")] = KubeError(0, "ConnectionRefused", "no route")
    with pytest.raises(Retry):
        rig.reconciler.reconcile(body)
    rig.kube.fail[("apply", "Deployment")] = KubeError(422, "Invalid", "spec.template: bad")
    with pytest.raises(Fatal):
        rig.reconciler.reconcile(body)
    rig.reconciler.reconcile(body)  # and recovers


def test_nvme_resize_grows_pvcs_and_recreates_statefulset_orphaning_pods() -> None:
    rig = Rig()
    body = example("llama-70b-h100-tiered.yaml")
    rig.create(body)
    rig.reconciler.reconcile(body)
    for i in range(2):
        name = f"kv-cache-llama-70b-engine-{i}"
        rig.kube.objects[("PersistentVolumeClaim", "ns", name)] = {
            "metadata": {"name": name, "namespace": "ns"},
            "spec": {"resources": {"requests": {"storage": "2Ti"}}},
        }
    bigger = copy.deepcopy(body)
    bigger["metadata"]["generation"] = 2
    bigger["spec"]["kvCache"]["tiers"]["nvme"]["size"] = "3Ti"
    rig.kube.calls.clear()
    out = rig.reconciler.reconcile(bigger)
    verbs = [(v, k) for v, k, _ in rig.kube.calls]
    assert ("delete:Orphan", "StatefulSet") in verbs
    assert verbs.count(("patch", "PersistentVolumeClaim")) == 2
    pvc = rig.kube.objects[("PersistentVolumeClaim", "ns", "kv-cache-llama-70b-engine-1")]
    assert pvc["spec"]["resources"]["requests"]["storage"] == "3Ti"
    sts = rig.kube.objects[("StatefulSet", "ns", "llama-70b-engine")]
    assert sts["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"] == "3Ti"
    assert any("re-created StatefulSet" in n.text for n in out.notes)
    # A re-create is information, not trouble: a Normal Event.
    assert any(e[:2] == ("Normal", "Applied") and "re-created" in e[2] for e in rig.events)


def test_unchanged_claim_templates_do_not_recreate() -> None:
    rig = Rig()
    body = rig.create(example("llama-70b-h100-tiered.yaml"))
    rig.reconciler.reconcile(body)
    rig.kube.calls.clear()
    rig.reconciler.reconcile(body)
    assert not [c for c in rig.kube.calls if c[0].startswith("delete")]


def test_immutable_diff_ignores_server_defaults() -> None:
    desired = {
        "spec": {
            "serviceName": "x",
            "selector": {"matchLabels": {"a": "b"}},
            "volumeClaimTemplates": [
                {
                    "metadata": {"name": "kv"},
                    "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Ti"}}},
                }
            ],
        }
    }
    live = copy.deepcopy(desired)
    vct = live["spec"]["volumeClaimTemplates"][0]
    vct |= {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "status": {"phase": "Pending"}}
    vct["spec"]["volumeMode"] = "Filesystem"
    vct["spec"]["resources"]["requests"]["storage"] = "1024Gi"  # same quantity, other spelling
    assert immutable_diff(live, desired) == []
    desired["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"] = "2Ti"
    assert immutable_diff(live, desired) == ["volumeClaimTemplates"]


def test_pvcs_to_grow_matches_only_this_statefulsets_claims() -> None:
    sts = {
        "metadata": {"name": "a-engine"},
        "spec": {
            "volumeClaimTemplates": [
                {"metadata": {"name": "kv"}, "spec": {"resources": {"requests": {"storage": "2Gi"}}}}
            ]
        },
    }
    pvcs = [
        {"metadata": {"name": n}, "spec": {"resources": {"requests": {"storage": s}}}}
        for n, s in [
            ("kv-a-engine-0", "1Gi"),
            ("kv-a-engine-1", "2Gi"),
            ("kv-ab-engine-0", "1Gi"),
            ("kv-a-engine-x", "1Gi"),
        ]
    ]
    assert pvcs_to_grow(sts, pvcs) == [("kv-a-engine-0", "2Gi")]


def test_status_loop_rate_limit() -> None:
    rig = Rig()
    clock = [100.0]
    rig.sync.clock = lambda: clock[0]
    rig.sync.min_interval = 1.0
    rig.sync._last_write[("ns", "a")] = 99.5
    rig.sync.mark(("ns", "a"))
    rig.sync.mark(("ns", "b"))
    due, later = rig.sync._take_due()
    assert due == [("ns", "b")] and later == pytest.approx(0.5)
    clock[0] = 100.6
    due, later = rig.sync._take_due()
    assert due == [("ns", "a")] and later is None


def test_store_ignores_an_older_child_than_it_has_seen() -> None:
    store = Store()
    body = {
        "metadata": {"name": "a", "namespace": "ns", "uid": "u", "generation": 1, "resourceVersion": "5"},
    }
    store.observe_cluster(body)

    def sts(rv: str, observed: int) -> dict:
        return {
            "metadata": {
                "name": "a-engine",
                "namespace": "ns",
                "generation": 1,
                "resourceVersion": rv,
                "labels": {"app.kubernetes.io/instance": "a", "app.kubernetes.io/component": "engine"},
            },
            "status": {"observedGeneration": observed, "replicas": 1, "readyReplicas": observed},
        }

    assert store.observe_child("StatefulSet", sts("20", 1)) == ("ns", "a")
    # the apply response from before the controller's status update arrives late
    assert store.observe_child("StatefulSet", sts("10", 0)) is None
    _, observed, _, _ = store.snapshot(("ns", "a"))
    assert observed.sts is not None and observed.sts.observed_generation == 1


def test_immutable_field_changes_are_read_from_typed_causes() -> None:
    from kvstrata.controller.kube import FIELD_IMMUTABLE, Cause, status_causes

    status = {
        "kind": "Status",
        "code": 422,
        "details": {"causes": [{"reason": "FieldValueInvalid", "field": "spec.selector", "message": f"x: {FIELD_IMMUTABLE}"}]},
    }  # fmt: skip
    causes = status_causes(status)
    assert causes == (Cause("FieldValueInvalid", "spec.selector", f"x: {FIELD_IMMUTABLE}"),)
    assert KubeError(422, "Invalid", "m", causes=causes).immutable_field_change
    assert KubeError(
        422, "Invalid", "m", causes=(Cause("FieldValueForbidden", "spec"),)
    ).immutable_field_change
    # The text alone decides nothing, and other 422s are not immutability.
    assert not KubeError(422, "Invalid", f"Forbidden: {FIELD_IMMUTABLE}").immutable_field_change
    assert not KubeError(
        422, "Invalid", "m", causes=(Cause("FieldValueInvalid", "spec.replicas", "must be >= 0"),)
    ).immutable_field_change
    assert not KubeError(409, "Conflict", "m", causes=causes).immutable_field_change
    assert status_causes({"details": {"causes": "no"}}) == () and status_causes(None) == ()
