"""The operator on the real control plane, installed by the chart and running as the chart's ServiceAccount.

One release, one operator process and one namespace for the whole module (see kvs_operator_env).
"""

from __future__ import annotations

import copy
import json
import re
from typing import Any

import yaml
from kvs_operator_env import EXAMPLES, OperatorEnv, condition, example, operator_env_fixture, tracebacks  # noqa: F401

from kvstrata.api.manifest import validate
from kvstrata.planner import plan
from kvstrata.render import FLAGS_DIGEST_ANNOTATION, render

# A short resync so that children deleted behind the operator's back come back within the test.
OPERATOR_ARGS = ["--resync-interval=5"]
KINDS = "statefulsets,deployments,services,configmaps,poddisruptionbudgets,serviceaccounts,roles,rolebindings"


def instance(name: str) -> str:
    return f"app.kubernetes.io/instance={name}"


def pods_of(env: OperatorEnv, name: str, component: str = "engine") -> list[dict[str, Any]]:
    return env.items("pods", f"{instance(name)},app.kubernetes.io/component={component}")


def rendered(env: OperatorEnv, doc: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    ic = validate(doc)
    p = plan(ic.spec)
    objs = render(ic.metadata.name, env.ns, ic.spec, p, uid="x")
    return {(o["kind"], o["metadata"]["name"]): o for o in objs}


def test_operator_runs_with_the_charts_service_account(operator_env: OperatorEnv) -> None:
    env = operator_env
    status = json.loads(
        env.lc.helm("status", env.inst.release, "-n", env.inst.namespace, "-o", "json").stdout
    )
    assert status["info"]["status"] == "deployed"
    who = env.lc.kubectl("auth", "whoami", "-o", "json", f"--kubeconfig={env.op.kubeconfig}")
    user = json.loads(who.stdout)["status"]["userInfo"]["username"]
    assert user == f"system:serviceaccount:{env.inst.namespace}:{env.inst.service_account}"
    # The SA really is limited: it cannot read Secrets, which the operator never needs.
    denied = env.lc.kubectl(
        "get", "secrets", "-n", env.inst.namespace, f"--kubeconfig={env.op.kubeconfig}", check=False
    )
    assert denied.returncode != 0 and "forbidden" in denied.stderr.lower()
    assert env.op.healthy()


def test_tiny_cpu_example_becomes_ready_with_rendered_children(operator_env: OperatorEnv) -> None:
    env = operator_env
    doc = example("tiny-cpu.yaml")
    out = env.lc.kubectl("apply", "-n", env.ns, "-f", str(EXAMPLES / "tiny-cpu.yaml"))
    assert "created" in out.stdout
    obj = env.wait_ready("tiny")
    st = obj["status"]
    assert st["ready"] == "3/3" and st["replicas"] == 3 and st["readyReplicas"] == 3
    assert st["tiers"] == "gpu" and st["plan"]["verdict"] == "fits" and st["plan"]["kvBytesPerToken"] > 0
    assert st["selector"] == "app.kubernetes.io/component=engine,app.kubernetes.io/instance=tiny"
    for t in ("Planned", "CacheVolumesBound", "EnginesReady", "RouterReady", "Ready"):
        c = condition(obj, t)
        assert c["status"] == "True", c
        assert c["observedGeneration"] == obj["metadata"]["generation"] and c["lastTransitionTime"]

    want = rendered(env, doc)
    sts = env.get("statefulset", "tiny-engine")
    assert sts is not None
    assert (
        sts["spec"]["template"]["spec"]["containers"][0]["args"]
        == want[("StatefulSet", "tiny-engine")]["spec"]["template"]["spec"]["containers"][0]["args"]
    )
    assert sts["spec"]["replicas"] == 3
    owner = sts["metadata"]["ownerReferences"][0]
    assert (
        owner["kind"] == "InferenceCluster"
        and owner["controller"] is True
        and owner["uid"] == obj["metadata"]["uid"]
    )
    fields = env.lc.kubectl_json("get", "statefulset", "tiny-engine", "-n", env.ns, "--show-managed-fields")
    managers = {m["manager"] for m in fields["metadata"]["managedFields"] if m["operation"] == "Apply"}
    assert managers == {"kvstrata"}
    labels = sts["metadata"]["labels"]
    for key in ("name", "instance", "component", "managed-by", "part-of"):
        assert f"app.kubernetes.io/{key}" in labels
    cm = env.get("configmap", "tiny-router")
    assert cm is not None and cm["data"] == want[("ConfigMap", "tiny-router")]["data"]
    svc = env.get("service", "tiny-engine")
    assert svc is not None and svc["spec"]["clusterIP"] == "None"
    assert env.get("service", "tiny") is not None
    dep = env.get("deployment", "tiny-router")
    assert dep is not None and dep["status"].get("availableReplicas") == 1
    assert env.get("poddisruptionbudget", "tiny-engine") is not None
    pods = pods_of(env, "tiny")
    assert len(pods) == 3 and all(p["status"]["phase"] == "Running" for p in pods)


def test_get_ic_shows_printer_columns(operator_env: OperatorEnv) -> None:
    env = operator_env
    env.wait_ready("tiny")
    out = env.lc.kubectl("get", "ic", "tiny", "-n", env.ns).stdout.splitlines()
    header = out[0].split()
    assert header == ["NAME", "READY", "HIT%", "GPU%", "CPU%", "NVME%", "KV%", "TIERS", "VERDICT", "AGE"]
    row = out[1].split()
    assert row[0] == "tiny" and row[1] == "3/3" and "gpu" in row and "fits" in row


def test_scale_subresource(operator_env: OperatorEnv) -> None:
    env = operator_env
    env.wait_ready("tiny")
    env.lc.kubectl("scale", "ic", "tiny", "-n", env.ns, "--replicas=5")
    obj = env.wait_ready("tiny")
    assert obj["status"]["ready"] == "5/5"
    assert env.get("statefulset", "tiny-engine")["spec"]["replicas"] == 5
    scale = env.lc.kubectl_json("get", "ic", "tiny", "-n", env.ns, "--subresource=scale")
    assert scale["spec"]["replicas"] == 5 and scale["status"]["replicas"] == 5
    assert scale["status"]["selector"] == obj["status"]["selector"]
    env.lc.kubectl("scale", "ic", "tiny", "-n", env.ns, "--replicas=2")
    obj = env.wait_ready("tiny")
    assert obj["status"]["ready"] == "2/2"
    env.lc.wait_for("2 engine pods", lambda: len(pods_of(env, "tiny")) == 2, timeout=60)


def test_budget_edit_rolls_the_engines(operator_env: OperatorEnv) -> None:
    env = operator_env
    env.wait_ready("tiny")
    before = env.get("statefulset", "tiny-engine")
    old_digest = before["spec"]["template"]["metadata"]["annotations"][FLAGS_DIGEST_ANNOTATION]
    old_pods = {p["metadata"]["uid"] for p in pods_of(env, "tiny")}
    blocks = env.ic("tiny")["spec"]["kvCache"]["tiers"]["gpu"]["numBlocks"] + 32
    env.lc.kubectl(
        "patch",
        "ic",
        "tiny",
        "-n",
        env.ns,
        "--type=merge",
        "-p",
        json.dumps({"spec": {"kvCache": {"tiers": {"gpu": {"numBlocks": blocks}}}}}),
    )
    obj = env.wait_ready("tiny")
    after = env.get("statefulset", "tiny-engine")
    new_digest = after["spec"]["template"]["metadata"]["annotations"][FLAGS_DIGEST_ANNOTATION]
    assert new_digest != old_digest and obj["status"]["plan"]["flagsDigest"] == new_digest
    args = after["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--num-gpu-blocks-override") + 1] == str(blocks)

    def rolled() -> bool:
        pods = pods_of(env, "tiny")
        return (
            len(pods) == 2
            and not ({p["metadata"]["uid"] for p in pods} & old_pods)
            and all(p["metadata"]["annotations"].get(FLAGS_DIGEST_ANNOTATION) == new_digest for p in pods)
        )

    env.lc.wait_for("engine pods rolled to the new flags", rolled, timeout=90)
    env.wait_ready("tiny")


def test_deleted_children_come_back(operator_env: OperatorEnv) -> None:
    """A deleted workload is re-applied at once (watch event); other children at the next resync."""
    env = operator_env
    env.wait_ready("tiny")
    env.lc.kubectl("delete", "deployment", "tiny-router", "-n", env.ns, "--wait=true")
    env.lc.kubectl("delete", "service", "tiny-engine", "-n", env.ns, "--wait=true")
    env.lc.kubectl("delete", "configmap", "tiny-router", "-n", env.ns, "--wait=true")
    env.lc.wait_for(
        "the router Deployment, engine Service and router ConfigMap re-applied",
        lambda: all(
            env.get(k, n)
            for k, n in (
                ("deployment", "tiny-router"),
                ("service", "tiny-engine"),
                ("configmap", "tiny-router"),
            )
        ),
        timeout=60,
    )
    env.wait_ready("tiny")


def test_gpu_example_llama_8b(operator_env: OperatorEnv) -> None:
    env = operator_env
    env.lc.kubectl("apply", "-n", env.ns, "-f", str(EXAMPLES / "llama-8b-single-gpu.yaml"))
    obj = env.wait_ready("llama-8b")
    assert obj["status"]["ready"] == "3/3"
    sts = env.get("statefulset", "llama-8b-engine")
    res = sts["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert res["limits"]["nvidia.com/gpu"] == "1"
    pods = pods_of(env, "llama-8b")
    assert all(p["spec"]["nodeName"].startswith("kwok-gpu") for p in pods)


def test_gpu_example_with_nvme_tier_gets_bound_volumes(operator_env: OperatorEnv) -> None:
    env = operator_env
    # As shipped, the example names StorageClass nvme-local, which this cluster lacks: the webhook warns
    # and the claims stay Pending, which status must say.
    out = env.lc.kubectl("apply", "-n", env.ns, "-f", str(EXAMPLES / "llama-70b-h100-tiered.yaml"))
    assert "nvme-local" in out.stderr  # kubectl prints admission warnings on stderr
    obj = env.wait_condition("llama-70b", "CacheVolumesBound", "False", "Pending")
    assert condition(obj, "Ready")["reason"] == "CacheVolumesPending"
    pvcs = env.items("pvc", instance("llama-70b"))
    assert sorted(p["metadata"]["name"] for p in pvcs) == [
        "kv-cache-llama-70b-engine-0",
        "kv-cache-llama-70b-engine-1",
    ]
    assert all(p["status"]["phase"] == "Pending" for p in pvcs)
    env.lc.kubectl("delete", "ic", "llama-70b", "-n", env.ns, "--wait=true")
    env.lc.kubectl("delete", "pvc", "-n", env.ns, "-l", instance("llama-70b"), "--wait=true")

    # With the cluster's default class the claims bind and the cluster becomes Ready.
    doc = example("llama-70b-h100-tiered.yaml")
    doc["metadata"]["name"] = "llama-70b-local"
    del doc["spec"]["kvCache"]["tiers"]["nvme"]["storageClassName"]
    doc["spec"]["kvCache"]["tiers"]["nvme"]["retention"] = "Delete"
    env.apply(doc)
    obj = env.wait_ready("llama-70b-local")
    assert condition(obj, "CacheVolumesBound")["reason"] == "AllBound"
    assert (
        obj["status"]["tiers"] == "gpu+cpu+nvme" and obj["status"]["plan"]["verdict"] == "fits-with-offload"
    )
    pvcs = env.items("pvc", instance("llama-70b-local"))
    assert len(pvcs) == 2 and all(p["status"]["phase"] == "Bound" for p in pvcs)
    assert all(p["spec"]["resources"]["requests"]["storage"] == "2Ti" for p in pvcs)
    sts = env.get("statefulset", "llama-70b-local-engine")
    init = sts["spec"]["template"]["spec"]["initContainers"][0]
    assert init["name"] == "lmcache" and init["restartPolicy"] == "Always"

    # Growing the NVMe tier re-creates the StatefulSet (claim templates are immutable), grows the claims
    # and keeps the pods' claims (same names) bound.
    env.lc.kubectl(
        "patch",
        "ic",
        "llama-70b-local",
        "-n",
        env.ns,
        "--type=merge",
        "-p",
        json.dumps({"spec": {"kvCache": {"tiers": {"nvme": {"size": "3Ti"}}}}}),
    )
    env.lc.wait_for(
        "claim template at 3Ti",
        lambda: (
            (s := env.get("statefulset", "llama-70b-local-engine")) is not None
            and s["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"] == "3Ti"
        ),
        timeout=60,
    )
    pvcs = env.items("pvc", instance("llama-70b-local"))
    assert all(p["spec"]["resources"]["requests"]["storage"] == "3Ti" for p in pvcs)
    env.wait_ready("llama-70b-local")
    events = env.lc.kubectl_json(
        "get", "events", "-n", env.ns, "--field-selector", "involvedObject.name=llama-70b-local"
    )
    assert any("re-created StatefulSet" in e.get("message", "") for e in events["items"])


def test_infeasible_spec_that_bypassed_the_webhook_creates_nothing(operator_env: OperatorEnv) -> None:
    """An object created while the webhook was not looking (disabled, or before install) still gets the
    planner's verdict in status, a Warning event and no children."""
    env = operator_env
    vwc = f"{env.inst.fullname}-webhook"
    exclude = {
        "webhooks": [
            {
                "name": "validate.inferenceclusters.kvstrata.io",
                "namespaceSelector": {
                    "matchExpressions": [
                        {"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": [env.ns]}
                    ]
                },
            }
        ]
    }
    env.lc.kubectl(
        "patch", "validatingwebhookconfiguration", vwc, "--type=strategic", "-p", json.dumps(exclude)
    )
    try:
        env.lc.wait_for(
            "the webhook to skip the namespace",
            lambda: (
                env.lc.kubectl(
                    "create",
                    "--dry-run=server",
                    "-n",
                    env.ns,
                    "-f",
                    "-",
                    input=yaml.safe_dump(example("infeasible-405b-one-gpu.yaml")),
                    check=False,
                ).returncode
                == 0
            ),
            timeout=30,
        )
        env.apply(example("infeasible-405b-one-gpu.yaml"))
    finally:
        restore = copy.deepcopy(exclude)
        restore["webhooks"][0]["namespaceSelector"] = {}
        env.lc.kubectl(
            "patch", "validatingwebhookconfiguration", vwc, "--type=strategic", "-p", json.dumps(restore)
        )
    obj = env.wait_condition("too-big", "Planned", "False", "Infeasible")
    msg = condition(obj, "Planned")["message"]
    assert "spec.engine." in msg
    assert condition(obj, "Ready")["reason"] == "PlanInfeasible"
    assert obj["status"]["plan"]["verdict"] == "infeasible"
    env.lc.wait_for(
        "a Warning event",
        lambda: any(
            e["type"] == "Warning" and e["reason"] == "Infeasible"
            for e in env.lc.kubectl_json(
                "get", "events", "-n", env.ns, "--field-selector", "involvedObject.name=too-big"
            )["items"]
        ),
        timeout=30,
    )
    for kind in KINDS.split(","):
        assert env.items(kind, instance("too-big")) == [], kind
    env.lc.kubectl("delete", "ic", "too-big", "-n", env.ns, "--wait=true")


def _monitor_crd(plural: str, kind: str) -> dict[str, Any]:
    """The Prometheus Operator's CRD reduced to its name and kind: enough for the API server to serve it."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.monitoring.coreos.com"},
        "spec": {
            "group": "monitoring.coreos.com",
            "scope": "Namespaced",
            "names": {"plural": plural, "singular": kind.lower(), "kind": kind, "listKind": f"{kind}List"},
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
                    },
                }
            ],
        },
    }


def test_with_the_prometheus_operator_crds_each_cluster_gets_its_monitors(operator_env: OperatorEnv) -> None:
    """Installed after the operator started: picked up within its discovery cache's life, and applied
    with the chart's RBAC (a ServiceMonitor for engines and router; a PodMonitor for an NVMe tier's janitor)."""
    env = operator_env
    crds = [_monitor_crd("servicemonitors", "ServiceMonitor"), _monitor_crd("podmonitors", "PodMonitor")]
    names = [f"crd/{c['metadata']['name']}" for c in crds]
    env.lc.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(crds))
    try:
        env.lc.kubectl("wait", "--for=condition=Established", *names, "--timeout=60s")
        doc = copy.deepcopy(example("tiny-cpu-tiered.yaml"))
        doc["metadata"]["name"] = "monitored"
        env.apply(doc)
        env.lc.wait_for(
            "ServiceMonitor and PodMonitor applied",
            lambda: env.get("servicemonitor", "monitored") and env.get("podmonitor", "monitored-fs-janitor"),
            timeout=60,
        )
        uid = env.ic("monitored")["metadata"]["uid"]
        for kind, name in (("servicemonitor", "monitored"), ("podmonitor", "monitored-fs-janitor")):
            obj = env.get(kind, name)
            assert obj is not None and obj["metadata"]["ownerReferences"][0]["uid"] == uid, (kind, obj)
        assert (
            env.get("podmonitor", "monitored-fs-janitor")["spec"]["podMetricsEndpoints"][0]["port"]
            == "fs-janitor"
        )  # type: ignore[index]
    finally:
        env.lc.kubectl(
            "delete", "ic", "monitored", "-n", env.ns, "--ignore-not-found", "--wait=true", timeout=60
        )
        env.lc.kubectl("delete", *names, "--ignore-not-found", timeout=60)


def test_deleting_the_cluster_leaves_nothing_behind(operator_env: OperatorEnv) -> None:
    env = operator_env
    for name in ("tiny", "llama-8b", "llama-70b-local"):
        assert env.items("statefulsets", instance(name)), name
    env.lc.kubectl(
        "delete", "ic", "tiny", "llama-8b", "llama-70b-local", "-n", env.ns, "--wait=true", timeout=60
    )

    def gone() -> bool:
        for name in ("tiny", "llama-8b", "llama-70b-local"):
            for kind in (*KINDS.split(","), "pods", "pvc"):
                if env.items(kind, instance(name)):
                    return False
        return True

    env.lc.wait_for("every child garbage-collected", gone, timeout=90)
    ics = env.lc.kubectl_json("get", "ic", "-n", env.ns)["items"]
    assert ics == []


def test_metrics_and_logs(operator_env: OperatorEnv) -> None:
    env = operator_env
    text = env.op.metrics()
    applied = re.search(r'kvstrata_operator_reconciles_total\{result="applied"\} ([0-9.e+]+)', text)
    assert applied and float(applied.group(1)) >= 5
    assert "kvstrata_operator_reconcile_duration_seconds_bucket" in text
    assert re.search(r'kvstrata_operator_admission_reviews_total\{decision="allowed"\} [1-9]', text)
    log = env.op.log_text()
    records = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    assert records, "the operator logs JSON"
    assert tracebacks(log) == []
