"""(spec, plan) → the Kubernetes objects of one InferenceCluster. Pure: dicts in, dicts out, no I/O.

Objects are complete desired states for server-side apply: every field we set is a field we own.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from kvstrata.api.models import API_VERSION, KIND, InferenceClusterSpec
from kvstrata.api.router_config import (
    FS_JANITOR_PORT,
    KV_EVENTS_PORT,
    KV_EVENTS_TOPIC,
    KV_REPLAY_PORT,
    LABEL_COMPONENT,
    LABEL_INSTANCE,
    LABEL_MANAGED_BY,
    LABEL_NAME,
    LABEL_PART_OF,
    AdmissionSettings,
    Discovery,
    RouterSettings,
    TierWeights,
    Weights,
    default_tier_weights,
)
from kvstrata.planner.constants import (
    HF_HOME,
    LMCACHE_PORT,
    MODEL_MOUNT,
    NVME_MOUNT,
    engine_cpus,
)
from kvstrata.planner.flags import ENGINE_PYTHONPATH
from kvstrata.planner.plan import Plan

FLAGS_DIGEST_ANNOTATION = "kvstrata.io/flags-digest"
CONFIG_DIGEST_ANNOTATION = "kvstrata.io/config-digest"
ENGINE_CONTAINER = "vllm"
LMCACHE_CONTAINER = "lmcache"
JANITOR_CONTAINER = "fs-janitor"
ROUTER_CONTAINER = "router"
ENGINE_COMMAND = ["python3", "-m", "vllm.entrypoints.openai.api_server"]
ROUTER_CONFIG_DIR = "/etc/kvstrata"
UID = 1000
Obj = dict[str, Any]


def engine_name(name: str) -> str:
    return f"{name}-engine"


def router_name(name: str) -> str:
    return f"{name}-router"


def labels(name: str, component: str) -> dict[str, str]:
    return {
        LABEL_NAME: "kvstrata",
        LABEL_INSTANCE: name,
        LABEL_COMPONENT: component,
        LABEL_MANAGED_BY: "kvstrata",
        LABEL_PART_OF: "kvstrata",
    }


def selector(name: str, component: str) -> dict[str, str]:
    """The stable subset of labels used in selectors (selectors are immutable on StatefulSets)."""
    return {LABEL_INSTANCE: name, LABEL_COMPONENT: component}


def engine_selector(name: str) -> dict[str, str]:
    return selector(name, "engine")


def selector_string(sel: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(sel.items()))


def _meta(name: str, namespace: str, owner: str, component: str, uid: str | None) -> Obj:
    meta: Obj = {"name": name, "namespace": namespace, "labels": labels(owner, component)}
    if uid:
        meta["ownerReferences"] = [
            {
                "apiVersion": API_VERSION,
                "kind": KIND,
                "name": owner,
                "uid": uid,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
    return meta


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def _security_context() -> Obj:
    return {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "runAsNonRoot": True,
        "runAsUser": UID,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _mib(nbytes: int) -> str:
    return f"{-(-nbytes // (1 << 20))}Mi"


def _model_volume(spec: InferenceClusterSpec) -> tuple[Obj, Obj]:
    """The volume holding weights (and the tokenizer the router reads) and its mount."""
    source = spec.model.source
    if source.startswith("pvc://"):
        claim = source.removeprefix("pvc://").split("/", 1)[0]
        volume = {"name": "model", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}
        return volume, {"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True}
    return {"name": "model", "emptyDir": {}}, {"name": "model", "mountPath": HF_HOME}


def _tokenizer_dir(spec: InferenceClusterSpec) -> str | None:
    """The router tokenizes locally when it can mount the model; otherwise it asks an engine's /tokenize."""
    source = spec.model.source
    if not source.startswith("pvc://"):
        return None
    _, _, path = source.removeprefix("pvc://").partition("/")
    return f"{MODEL_MOUNT}/{path}".rstrip("/")


def _engine_resources(spec: InferenceClusterSpec, plan: Plan) -> Obj:
    eng = spec.engine
    memory = eng.resources.memory or _mib(plan.memory_bytes)
    cpu = engine_cpus(eng.device, eng.tensor_parallel_size, eng.resources.cpu)
    requests: Obj = {"cpu": cpu, "memory": memory}
    # Memory limit = request: a pod that outgrows its plan is a planning bug we want to see, not a noisy neighbour.
    limits: Obj = {"memory": memory}
    if plan.gpus:
        requests["nvidia.com/gpu"] = str(plan.gpus)
        limits["nvidia.com/gpu"] = str(plan.gpus)
    return {"requests": requests, "limits": limits}


def _probes(port_name: str, ready_path: str, live_path: str) -> Obj:
    return {
        "startupProbe": {
            "httpGet": {"path": live_path, "port": port_name},
            "periodSeconds": 10,
            # Loading weights can take many minutes; the startup probe protects that, not the liveness one.
            "failureThreshold": 180,
        },
        "readinessProbe": {"httpGet": {"path": ready_path, "port": port_name}, "periodSeconds": 5},
        "livenessProbe": {
            "httpGet": {"path": live_path, "port": port_name},
            "periodSeconds": 10,
            "failureThreshold": 6,
        },
    }


def _lmcache_container(spec: InferenceClusterSpec, plan: Plan) -> Obj:
    assert plan.lmcache is not None
    mem = _mib(plan.lmcache.memory_bytes)
    container: Obj = {
        "name": LMCACHE_CONTAINER,
        "image": spec.engine.image,
        "command": list(plan.lmcache.args),
        # A native sidecar: starts before the engine (which connects to it at start) and stops after it.
        "restartPolicy": "Always",
        "ports": [{"name": "lmcache", "containerPort": LMCACHE_PORT}],
        "resources": {"requests": {"cpu": "2", "memory": mem}, "limits": {"memory": mem}},
        "securityContext": _security_context(),
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
    }
    if spec.kv_cache.tiers.nvme is not None:
        container["volumeMounts"].append({"name": "kv-cache", "mountPath": NVME_MOUNT})
    return container


def _has_janitor(spec: InferenceClusterSpec, plan: Plan) -> bool:
    """vLLM's own fs tier (native offloading) needs the janitor; LMCache bounds its own disk tier."""
    return spec.kv_cache.tiers.nvme is not None and plan.offload_backend == "native"


def _janitor_container(spec: InferenceClusterSpec, plan: Plan) -> Obj:
    """Keeps vLLM's fs tier under the plan's NVMe budget (vLLM neither bounds nor evicts it):
    kvstrata.engine.fsjanitor, a native sidecar so it runs for as long as the pod, engine restarts too."""
    nvme = plan.tier("nvme")
    assert nvme is not None
    return {
        "name": JANITOR_CONTAINER,
        "image": spec.engine.image,
        "command": ["python3", "-m", "kvstrata.engine.fsjanitor"],
        "args": [
            "--root",
            NVME_MOUNT,
            "--budget-bytes",
            str(nvme.bytes),
            "--metrics-port",
            str(FS_JANITOR_PORT),
        ],
        "env": [{"name": "PYTHONPATH", "value": ENGINE_PYTHONPATH}],
        "restartPolicy": "Always",
        "ports": [{"name": JANITOR_CONTAINER, "containerPort": FS_JANITOR_PORT}],
        "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "256Mi"}},
        "securityContext": _security_context(),
        "volumeMounts": [{"name": "kv-cache", "mountPath": NVME_MOUNT}],
    }


def engine_statefulset(
    name: str, namespace: str, spec: InferenceClusterSpec, plan: Plan, uid: str | None
) -> Obj:
    eng, kv = spec.engine, spec.kv_cache
    model_volume, model_mount = _model_volume(spec)
    env: list[Obj] = [{"name": k, "value": v} for k, v in sorted(plan.engine_env.items())]
    env.append({"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}})
    mounts = [{"name": "dshm", "mountPath": "/dev/shm"}, model_mount, {"name": "tmp", "mountPath": "/tmp"}]
    if _has_janitor(spec, plan):
        mounts.append({"name": "kv-cache", "mountPath": NVME_MOUNT})
    container: Obj = {
        "name": ENGINE_CONTAINER,
        "image": eng.image,
        "command": ENGINE_COMMAND,
        "args": plan.engine_args,
        "env": env,
        "ports": [
            {"name": "http", "containerPort": eng.port},
            {"name": "kv-events", "containerPort": KV_EVENTS_PORT},
            {"name": "kv-replay", "containerPort": KV_REPLAY_PORT},
        ],
        "resources": _engine_resources(spec, plan),
        "securityContext": _security_context(),
        "volumeMounts": mounts,
        **_probes("http", "/health", "/health"),
    }
    volumes: list[Obj] = [
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": _mib(plan.shm_bytes)}},
        model_volume,
        {"name": "tmp", "emptyDir": {}},
    ]
    pod_spec: Obj = {
        "containers": [container],
        "volumes": volumes,
        "securityContext": {"runAsNonRoot": True, "runAsUser": UID, "fsGroup": UID},
        "terminationGracePeriodSeconds": 60,
        "affinity": {
            "podAntiAffinity": {
                "preferredDuringSchedulingIgnoredDuringExecution": [
                    {
                        "weight": 100,
                        "podAffinityTerm": {
                            "labelSelector": {"matchLabels": engine_selector(name)},
                            "topologyKey": "kubernetes.io/hostname",
                        },
                    }
                ]
            }
        },
        "enableServiceLinks": False,
    }
    if plan.gpus:
        pod_spec["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    if plan.lmcache is not None:
        pod_spec["initContainers"] = [_lmcache_container(spec, plan)]
    elif _has_janitor(spec, plan):
        pod_spec["initContainers"] = [_janitor_container(spec, plan)]
    sts_spec: Obj = {
        "replicas": spec.replicas,
        "serviceName": engine_name(name),
        "podManagementPolicy": "Parallel",
        "selector": {"matchLabels": engine_selector(name)},
        "updateStrategy": {"type": "RollingUpdate"},
        "template": {
            "metadata": {
                "labels": labels(name, "engine"),
                "annotations": {FLAGS_DIGEST_ANNOTATION: plan.flags_digest},
            },
            "spec": pod_spec,
        },
    }
    if kv.tiers.nvme is not None:
        pvc_spec: Obj = {
            "accessModes": ["ReadWriteOnce"],
            "resources": {"requests": {"storage": kv.tiers.nvme.size}},
        }
        if kv.tiers.nvme.storage_class_name:
            pvc_spec["storageClassName"] = kv.tiers.nvme.storage_class_name
        sts_spec["volumeClaimTemplates"] = [
            {"metadata": {"name": "kv-cache", "labels": labels(name, "kv-cache")}, "spec": pvc_spec}
        ]
        sts_spec["persistentVolumeClaimRetentionPolicy"] = {
            "whenDeleted": kv.tiers.nvme.retention,
            # Scaling down keeps a pod's warm cache for when it comes back.
            "whenScaled": "Retain",
        }
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": _meta(engine_name(name), namespace, name, "engine", uid),
        "spec": sts_spec,
    }


def engine_service(name: str, namespace: str, spec: InferenceClusterSpec, uid: str | None) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(engine_name(name), namespace, name, "engine", uid),
        "spec": {
            # Headless: the router needs every pod's own address, not a load-balanced VIP.
            "clusterIP": "None",
            "selector": engine_selector(name),
            "ports": [
                {"name": "http", "port": spec.engine.port, "targetPort": "http"},
                {"name": "kv-events", "port": KV_EVENTS_PORT, "targetPort": "kv-events"},
                {"name": "kv-replay", "port": KV_REPLAY_PORT, "targetPort": "kv-replay"},
            ],
        },
    }


def engine_pdb(name: str, namespace: str, uid: str | None) -> Obj:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _meta(engine_name(name), namespace, name, "engine", uid),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": engine_selector(name)}},
    }


def router_settings(name: str, namespace: str, spec: InferenceClusterSpec, plan: Plan) -> RouterSettings:
    w = spec.router.weights
    return RouterSettings(
        model=spec.model.served_name or spec.model.name,
        tokenizer=_tokenizer_dir(spec),
        block_size=plan.block_size,
        hash_algo=spec.kv_cache.hash_algo,
        kv_events_topic=KV_EVENTS_TOPIC,
        policy=spec.router.policy,
        data_plane=spec.router.data_plane,
        weights=Weights(prefill=w.prefill, prefix=w.prefix, load=w.load, kv_usage=w.kv_usage),
        queue_weight=w.queue,
        tier_weights=_tier_weights(spec),
        connect_timeout_seconds=spec.router.timeouts.connect_seconds,
        first_byte_timeout_seconds=spec.router.timeouts.first_byte_seconds,
        stream_idle_timeout_seconds=spec.router.timeouts.stream_idle_seconds,
        upstream_timeout_seconds=spec.router.timeouts.response_seconds,
        ejection_consecutive_failures=spec.router.ejection.consecutive_failures,
        ejection_base_seconds=spec.router.ejection.base_seconds,
        ejection_max_seconds=spec.router.ejection.max_seconds,
        admission=AdmissionSettings(
            enabled=spec.router.admission.enabled, max_hold_seconds=spec.router.admission.max_hold_seconds
        ),
        discovery=Discovery(
            namespace=namespace,
            service=engine_name(name),
            engine_port=spec.engine.port,
            kv_events_port=KV_EVENTS_PORT,
            kv_replay_port=KV_REPLAY_PORT,
            fs_janitor_port=FS_JANITOR_PORT if _has_janitor(spec, plan) else None,
        ),
    )


def _tier_weights(spec: InferenceClusterSpec) -> TierWeights:
    """The cluster's tier credit: what it sets, else the default for its engines' device."""
    default, given = default_tier_weights(spec.engine.device), spec.router.tier_weights
    return TierWeights(
        gpu=default.gpu if given.gpu is None else given.gpu,
        cpu=default.cpu if given.cpu is None else given.cpu,
        storage=default.storage if given.nvme is None else given.nvme,
    )


def router_configmap(
    name: str, namespace: str, spec: InferenceClusterSpec, plan: Plan, uid: str | None
) -> Obj:
    settings = router_settings(name, namespace, spec, plan)
    body = json.dumps(settings.model_dump(by_alias=True, mode="json"), indent=2, sort_keys=True)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(router_name(name), namespace, name, "router", uid),
        "data": {"router.json": body},
    }


def router_rbac(name: str, namespace: str, uid: str | None) -> list[Obj]:
    """The router reads its engines' EndpointSlices, nothing else."""
    sa = {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": _meta(router_name(name), namespace, name, "router", uid),
    }
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": _meta(router_name(name), namespace, name, "router", uid),
        "rules": [
            {
                "apiGroups": ["discovery.k8s.io"],
                "resources": ["endpointslices"],
                "verbs": ["get", "list", "watch"],
            }
        ],
    }
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": _meta(router_name(name), namespace, name, "router", uid),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": router_name(name)},
        "subjects": [{"kind": "ServiceAccount", "name": router_name(name), "namespace": namespace}],
    }
    return [sa, role, binding]


def router_deployment(
    name: str, namespace: str, spec: InferenceClusterSpec, plan: Plan, uid: str | None
) -> Obj:
    r = spec.router
    config = router_configmap(name, namespace, spec, plan, None)["data"]
    mounts = [{"name": "config", "mountPath": ROUTER_CONFIG_DIR, "readOnly": True}]
    volumes: list[Obj] = [{"name": "config", "configMap": {"name": router_name(name)}}]
    if _tokenizer_dir(spec):
        model_volume, model_mount = _model_volume(spec)
        volumes.append(model_volume)
        mounts.append(model_mount)
    container: Obj = {
        "name": ROUTER_CONTAINER,
        "image": r.image,
        "command": ["kvstrata"],
        "args": ["router", "--config", f"{ROUTER_CONFIG_DIR}/router.json", "--port", str(r.port)],
        "env": [{"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}],
        "ports": [{"name": "http", "containerPort": r.port}],
        "resources": {"requests": {"cpu": "1", "memory": "512Mi"}, "limits": {"memory": "2Gi"}},
        "securityContext": {**_security_context(), "readOnlyRootFilesystem": True},
        "volumeMounts": mounts,
        **_probes("http", "/ready", "/health"),
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(router_name(name), namespace, name, "router", uid),
        "spec": {
            "replicas": r.replicas,
            "selector": {"matchLabels": selector(name, "router")},
            "template": {
                "metadata": {
                    "labels": labels(name, "router"),
                    # The router reads router.json at start: a changed config must roll it.
                    "annotations": {CONFIG_DIGEST_ANNOTATION: _digest(config)},
                },
                "spec": {
                    "serviceAccountName": router_name(name),
                    "containers": [container],
                    "volumes": volumes,
                    "securityContext": {"runAsNonRoot": True, "runAsUser": UID},
                    "enableServiceLinks": False,
                },
            },
        },
    }


def router_service(name: str, namespace: str, spec: InferenceClusterSpec, uid: str | None) -> Obj:
    """`<name>`: what clients call. It fronts the router, never the engines directly."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(name, namespace, name, "router", uid),
        "spec": {
            "selector": selector(name, "router"),
            "ports": [{"name": "http", "port": 80, "targetPort": "http"}],
        },
    }


MONITORING_API = "monitoring.coreos.com/v1"


def service_monitor(name: str, namespace: str, uid: str | None) -> Obj:
    """Scrape engines and router (their Services' `http` ports): the hit-rate and KV-usage alerts of the
    chart's PrometheusRule read these series."""
    return {
        "apiVersion": MONITORING_API,
        "kind": "ServiceMonitor",
        "metadata": _meta(name, namespace, name, "metrics", uid),
        "spec": {
            "selector": {"matchLabels": {LABEL_INSTANCE: name}},
            "endpoints": [{"port": "http", "path": "/metrics", "interval": "15s"}],
        },
    }


def janitor_pod_monitor(name: str, namespace: str, uid: str | None) -> Obj:
    """Scrape each engine pod's fs-janitor (NVMe tier bytes used and evicted). A PodMonitor: the
    janitor's port is the pod's, not the engine Service's."""
    return {
        "apiVersion": MONITORING_API,
        "kind": "PodMonitor",
        "metadata": _meta(f"{name}-fs-janitor", namespace, name, "metrics", uid),
        "spec": {
            "selector": {"matchLabels": engine_selector(name)},
            "podMetricsEndpoints": [{"port": JANITOR_CONTAINER, "path": "/metrics", "interval": "15s"}],
        },
    }


def monitors(name: str, namespace: str, spec: InferenceClusterSpec, plan: Plan, uid: str | None) -> list[Obj]:
    """The Prometheus Operator objects of a cluster: applied only where its CRDs are served."""
    out = [service_monitor(name, namespace, uid)]
    if _has_janitor(spec, plan):
        out.append(janitor_pod_monitor(name, namespace, uid))
    return out


def render(
    name: str, namespace: str, spec: InferenceClusterSpec, plan: Plan, uid: str | None = None
) -> list[Obj]:
    """Every child object, in apply order (config before its readers). Only for a feasible plan."""
    if not plan.feasible:
        raise ValueError(f"cannot render an infeasible plan: {plan.summary()}")
    return [
        router_configmap(name, namespace, spec, plan, uid),
        *router_rbac(name, namespace, uid),
        engine_service(name, namespace, spec, uid),
        engine_statefulset(name, namespace, spec, plan, uid),
        engine_pdb(name, namespace, uid),
        router_deployment(name, namespace, spec, plan, uid),
        router_service(name, namespace, spec, uid),
    ]
