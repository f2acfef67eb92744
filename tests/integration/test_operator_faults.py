"""Faults with 20 InferenceClusters: the operator killed mid-reconcile, kube-apiserver restarted, the operator
restarted gracefully. Afterwards every cluster is Ready, no child is duplicated, no status is lost, and no
condition flapped."""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path
from typing import Any

import yaml
from kvs_operator_env import OperatorEnv, condition, example, operator_env_fixture  # noqa: F401

from kvstrata.controller.status import OWNED_CONDITIONS
from kvstrata_dev.localcluster import cluster, components, procs
from kvstrata_dev.localcluster.layout import Layout, State

N = 20
# Two reconcile threads: the burst of 20 takes long enough that the kill lands in the middle of it.
OPERATOR_ARGS = ["--workers=2"]
# kinds (kubectl names) and how many objects of each one InferenceCluster owns
CHILDREN = {
    "statefulsets": 1,
    "deployments": 1,
    "services": 2,
    "configmaps": 1,
    "poddisruptionbudgets": 1,
    "serviceaccounts": 1,
    "roles": 1,
    "rolebindings": 1,
}


def names() -> list[str]:
    return [f"fault-{i:02d}" for i in range(N)]


def manifests() -> str:
    docs = []
    for name in names():
        doc = example("tiny-cpu.yaml")
        doc["metadata"]["name"] = name
        doc["spec"]["replicas"] = 1
        docs.append(doc)
    return yaml.safe_dump_all(docs)


def all_ics(env: OperatorEnv) -> dict[str, dict[str, Any]]:
    items = env.lc.kubectl_json("get", "ic", "-n", env.ns)["items"]
    return {i["metadata"]["name"]: i for i in items if i["metadata"]["name"].startswith("fault-")}


def all_ready(env: OperatorEnv) -> dict[str, dict[str, Any]] | None:
    ics = all_ics(env)
    if len(ics) != N:
        return None
    for obj in ics.values():
        st = obj.get("status") or {}
        if (
            condition(obj, "Ready").get("status") != "True"
            or st.get("observedGeneration") != obj["metadata"]["generation"]
        ):
            return None
    return ics


def restart_apiserver(env: OperatorEnv) -> None:
    layout = Layout(env.lc.state_dir)
    state = State.load(layout)
    assert state is not None
    assert procs.stop(layout, "kube-apiserver")
    procs.start(layout, "kube-apiserver", components.kube_apiserver(Path(state.bin_dir), layout, state.ports))
    ctx = cluster.admin_ssl_context(layout)

    def ready() -> bool:
        try:
            return cluster._http_ok(f"{state.server}/readyz", ctx)
        except OSError:
            return False

    env.lc.wait_for("kube-apiserver /readyz after the restart", ready, timeout=120)


def metric(text: str, name: str, labels: str) -> float:
    m = re.search(rf"^{name}\{{{labels}\}} ([0-9.e+]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def transitions(ics: dict[str, dict[str, Any]]) -> dict[tuple[str, str], str]:
    """lastTransitionTime of the operator's own conditions (MetricsAvailable is the scraper's)."""
    return {
        (name, c["type"]): c["lastTransitionTime"]
        for name, obj in ics.items()
        for c in obj["status"]["conditions"]
        if c["type"] in OWNED_CONDITIONS
    }


def test_faults_leave_every_cluster_ready_without_duplicates(operator_env: OperatorEnv) -> None:
    env = operator_env
    # 1. Kill the operator (SIGKILL, no clean-up) while it works through a burst of 20 new clusters.
    env.lc.kubectl("apply", "-n", env.ns, "-f", "-", input=manifests())
    env.lc.wait_for(
        "the first reconciles",
        lambda: (
            sum(1 for o in all_ics(env).values() if (o.get("status") or {}).get("observedGeneration")) >= 1
        ),
        timeout=60,
        interval=0.05,
    )
    done_at_kill = sum(1 for o in all_ics(env).values() if (o.get("status") or {}).get("observedGeneration"))
    env.op.stop(signal.SIGKILL)
    print(f"killed the operator with {done_at_kill}/{N} clusters reconciled")
    time.sleep(1)
    env.op.start()
    ics = env.lc.wait_for("all 20 Ready after the kill", lambda: all_ready(env), timeout=180, interval=1)
    before = transitions(ics)

    # 2. Restart kube-apiserver under the running operator.
    restart_apiserver(env)
    ics = env.lc.wait_for(
        "all 20 Ready after the apiserver restart", lambda: all_ready(env), timeout=180, interval=1
    )
    assert env.op.proc is not None and env.op.proc.poll() is None, (
        "the operator survived the apiserver restart"
    )

    # 3. Restart the operator gracefully: resuming must rewrite no status at all.
    env.op.stop(signal.SIGTERM)
    env.op.start()
    env.lc.wait_for(
        "the resumed reconciles",
        lambda: metric(env.op.metrics(), "kvstrata_operator_reconciles_total", 'result="applied"') >= N,
        timeout=120,
    )
    time.sleep(3)  # let the status loop drain
    text = env.op.metrics()
    assert metric(text, "kvstrata_operator_status_writes_total", 'outcome="written"') == 0
    after = transitions(all_ready(env) or {})
    assert after == before, "no condition changed its lastTransitionTime: nothing flapped"

    # No duplicates, nothing lost.
    for name, obj in ics.items():
        st = obj["status"]
        assert st["plan"]["verdict"] == "fits" and st["ready"] == "1/1" and st["tiers"] == "gpu", name
        assert st["selector"].endswith(f"instance={name}")
    for kind, per_cluster in CHILDREN.items():
        items = env.lc.kubectl_json("get", kind, "-n", env.ns)["items"]
        for name in names():
            mine = [
                i
                for i in items
                if (i["metadata"].get("labels") or {}).get("app.kubernetes.io/instance") == name
            ]
            assert len(mine) == per_cluster, (kind, name, [i["metadata"]["name"] for i in mine])
    pods = env.lc.kubectl_json("get", "pods", "-n", env.ns, "-l", "app.kubernetes.io/component=engine")[
        "items"
    ]
    by_owner: dict[str, int] = {}
    for p in pods:
        by_owner[p["metadata"]["labels"]["app.kubernetes.io/instance"]] = (
            by_owner.get(p["metadata"]["labels"]["app.kubernetes.io/instance"], 0) + 1
        )
    assert {n: by_owner.get(n) for n in names()} == dict.fromkeys(names(), 1)
