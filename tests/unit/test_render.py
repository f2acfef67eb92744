"""Rendering: the objects, their ownership, and the fields the operator and launcher depend on."""

from __future__ import annotations

import json

from helpers import example, with_changes

from kvstrata.api.manifest import validate
from kvstrata.api.router_config import RouterSettings
from kvstrata.planner import plan
from kvstrata.render import FLAGS_DIGEST_ANNOTATION, render


def objects(doc, uid="uid-1"):
    ic = validate(doc)
    p = plan(ic.spec)
    return {
        (o["kind"], o["metadata"]["name"]): o for o in render(ic.metadata.name, "ns1", ic.spec, p, uid)
    }, p


def test_tiny_renders_every_child_with_owner_and_labels() -> None:
    objs, _ = objects(example("tiny-cpu.yaml"))
    assert set(objs) == {
        ("ConfigMap", "tiny-router"),
        ("ServiceAccount", "tiny-router"),
        ("Role", "tiny-router"),
        ("RoleBinding", "tiny-router"),
        ("Service", "tiny-engine"),
        ("StatefulSet", "tiny-engine"),
        ("PodDisruptionBudget", "tiny-engine"),
        ("Deployment", "tiny-router"),
        ("Service", "tiny"),
    }
    for obj in objs.values():
        meta = obj["metadata"]
        assert meta["namespace"] == "ns1"
        assert meta["ownerReferences"][0]["uid"] == "uid-1" and meta["ownerReferences"][0]["controller"]
        assert meta["labels"]["app.kubernetes.io/managed-by"] == "kvstrata"


def test_engine_statefulset_runs_the_planned_flags() -> None:
    objs, p = objects(example("tiny-cpu.yaml"))
    sts = objs[("StatefulSet", "tiny-engine")]
    pod = sts["spec"]["template"]
    container = pod["spec"]["containers"][0]
    assert container["args"] == p.engine_args
    assert {"name": "VLLM_CPU_KVCACHE_SPACE", "value": "1"} in container["env"]
    assert pod["metadata"]["annotations"][FLAGS_DIGEST_ANNOTATION] == p.flags_digest
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert container["securityContext"]["runAsNonRoot"] is True
    assert sts["spec"]["replicas"] == 3
    model = next(v for v in pod["spec"]["volumes"] if v["name"] == "model")
    assert model["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
    assert "volumeClaimTemplates" not in sts["spec"]
    assert "nvidia.com/gpu" not in container["resources"]["limits"]


def test_nvme_tier_gets_pvc_template_retention_and_lmcache_sidecar() -> None:
    objs, _ = objects(example("llama-70b-h100-tiered.yaml"))
    sts = objs[("StatefulSet", "llama-70b-engine")]
    vct = sts["spec"]["volumeClaimTemplates"][0]
    assert vct["spec"]["resources"]["requests"]["storage"] == "2Ti"
    assert vct["spec"]["storageClassName"] == "nvme-local"
    assert sts["spec"]["persistentVolumeClaimRetentionPolicy"]["whenDeleted"] == "Retain"
    pod = sts["spec"]["template"]["spec"]
    sidecar = pod["initContainers"][0]
    assert sidecar["restartPolicy"] == "Always" and sidecar["command"][:2] == ["lmcache", "server"]
    assert {"name": "kv-cache", "mountPath": "/kv-cache"} in sidecar["volumeMounts"]
    engine = pod["containers"][0]
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == "4"
    shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"]["medium"] == "Memory"


def test_router_config_is_valid_settings_matching_the_engines() -> None:
    objs, p = objects(example("tiny-cpu.yaml"))
    settings = RouterSettings.model_validate(
        json.loads(objs[("ConfigMap", "tiny-router")]["data"]["router.json"])
    )
    assert settings.block_size == p.block_size == 32
    assert settings.hash_algo == "sha256"
    assert settings.discovery.service == "tiny-engine" and settings.discovery.namespace == "ns1"
    assert settings.tokenizer == "/models/tiny-llama"
    assert settings.model == "tiny"
    assert settings.discovery.fs_janitor_port is None  # no NVMe tier, no janitor
    # device cpu: the tier credit measured on CPUs (bench-tier-credit), not the accelerator default.
    assert (settings.tier_weights.cpu, settings.tier_weights.storage) == (0.99, 0.98)


def test_tier_weights_set_in_the_cluster_reach_the_router() -> None:
    doc = with_changes(example("tiny-cpu.yaml"), {"spec.router.tierWeights": {"nvme": 0.3}})
    objs, _ = objects(doc)
    settings = RouterSettings.model_validate(
        json.loads(objs[("ConfigMap", "tiny-router")]["data"]["router.json"])
    )
    assert (settings.tier_weights.gpu, settings.tier_weights.cpu, settings.tier_weights.storage) == (
        1.0,
        0.99,
        0.3,
    )


def test_admission_set_in_the_cluster_reaches_the_router() -> None:
    default, _ = objects(example("tiny-cpu.yaml"))
    changed, _ = objects(
        with_changes(
            example("tiny-cpu.yaml"), {"spec.router.admission": {"enabled": False, "maxHoldSeconds": 4}}
        )
    )
    on, off = (
        RouterSettings.model_validate(json.loads(o[("ConfigMap", "tiny-router")]["data"]["router.json"]))
        for o in (default, changed)
    )
    assert on.admission.enabled and on.admission.max_hold_seconds is None
    assert not off.admission.enabled and off.admission.max_hold_seconds == 4


def test_router_fetches_evictions_from_the_janitor_on_the_port_the_pod_serves_it() -> None:
    objs, _ = objects(example("tiny-cpu-tiered.yaml"))
    settings = RouterSettings.model_validate(
        json.loads(objs[("ConfigMap", "tiny-tiered-router")]["data"]["router.json"])
    )
    pod = objs[("StatefulSet", "tiny-tiered-engine")]["spec"]["template"]["spec"]
    (janitor,) = pod["initContainers"]
    assert janitor["ports"][0]["containerPort"] == settings.discovery.fs_janitor_port


def test_router_config_change_rolls_the_router() -> None:
    a, _ = objects(example("tiny-cpu.yaml"))
    b, _ = objects(with_changes(example("tiny-cpu.yaml"), {"spec.router.policy": "round-robin"}))
    ann = "kvstrata.io/config-digest"
    da = a[("Deployment", "tiny-router")]["spec"]["template"]["metadata"]["annotations"][ann]
    db = b[("Deployment", "tiny-router")]["spec"]["template"]["metadata"]["annotations"][ann]
    assert da != db


def test_selectors_use_only_stable_labels() -> None:
    objs, _ = objects(example("tiny-cpu.yaml"))
    sel = objs[("StatefulSet", "tiny-engine")]["spec"]["selector"]["matchLabels"]
    assert sel == {"app.kubernetes.io/instance": "tiny", "app.kubernetes.io/component": "engine"}
    assert objs[("Service", "tiny-engine")]["spec"]["clusterIP"] == "None"
