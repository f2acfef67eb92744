"""The API server's refusals reach the controller as types: a change to an immutable StatefulSet field is
a 422 with a typed cause, which the applier answers by re-creating the StatefulSet."""

from __future__ import annotations

from typing import Any

import pytest

from kvstrata.controller.apply import Applier
from kvstrata.controller.kube import Kube, KubeError
from kvstrata_dev.localcluster.session import LocalCluster

MANAGER = "kvstrata-test"


def statefulset(namespace: str, service_name: str, policy: str = "OrderedReady") -> dict[str, Any]:
    labels = {"app": "t"}
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": "t", "namespace": namespace},
        "spec": {
            "serviceName": service_name,
            "podManagementPolicy": policy,
            "replicas": 0,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {"containers": [{"name": "c", "image": "busybox"}]},
            },
        },
    }


def test_an_immutable_statefulset_field_is_a_typed_cause_and_is_recreated(
    local_cluster: LocalCluster, namespace: str
) -> None:
    kube = Kube.from_environment(str(local_cluster.kubeconfig))
    kube.apply(statefulset(namespace, "a"), MANAGER)
    with pytest.raises(KubeError) as caught:
        kube.apply(statefulset(namespace, "b"), MANAGER)  # serviceName may not change
    err = caught.value  # FieldValueInvalid on spec.serviceName: "field is immutable"
    assert err.status == 422 and err.immutable_field_change, (err, err.causes)
    assert any(c.field == "spec.serviceName" for c in err.causes)
    with pytest.raises(KubeError) as forbidden:
        kube.apply(statefulset(namespace, "a", policy="Parallel"), MANAGER)
    assert forbidden.value.immutable_field_change, (forbidden.value, forbidden.value.causes)
    assert any(c.field == "spec.podManagementPolicy" for c in forbidden.value.causes)
    # Another 422 (an invalid value, not a forbidden change) is not mistaken for one.
    bad = statefulset(namespace, "a")
    bad["spec"]["replicas"] = -1
    with pytest.raises(KubeError) as invalid:
        kube.apply(bad, MANAGER)
    assert invalid.value.status == 422 and not invalid.value.immutable_field_change
    # The applier re-creates the StatefulSet with the new field instead of failing the reconcile.
    Applier(kube, MANAGER).apply_all([statefulset(namespace, "b", policy="Parallel")])
    live = kube.get("apps/v1", "StatefulSet", namespace, "t")
    assert live is not None and live["spec"]["serviceName"] == "b"
    assert live["spec"]["podManagementPolicy"] == "Parallel"
