"""Shared set-up for the operator's integration modules: chart installed, operator running as its SA.

Each module that imports `operator_env` gets one Helm release and one operator process for all its tests
(module scope), torn down at the end: InferenceClusters deleted, operator stopped, release uninstalled
(the CRD stays, as it would for a user).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvstrata_dev.localcluster.session import LocalCluster, fresh_namespace
from kvstrata_dev.localrun import (
    Install,
    OperatorProcess,
    ensure_model_claim,
    install_chart,
    run_operator,
    uninstall_chart,
    wait_webhook_serving,
)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
READY_TIMEOUT = 90


@dataclass
class OperatorEnv:
    lc: LocalCluster
    inst: Install
    op: OperatorProcess
    ns: str

    # ------------------------------------------------------------------------------------ reads
    def ic(self, name: str, ns: str | None = None) -> dict[str, Any]:
        return self.lc.kubectl_json("get", "inferencecluster", name, "-n", ns or self.ns)

    def get(self, kind: str, name: str, ns: str | None = None) -> dict[str, Any] | None:
        r = self.lc.kubectl("get", kind, name, "-n", ns or self.ns, "-o", "json", check=False)
        return json.loads(r.stdout) if r.returncode == 0 else None

    def items(self, kind: str, selector: str, ns: str | None = None) -> list[dict[str, Any]]:
        return self.lc.kubectl_json("get", kind, "-n", ns or self.ns, "-l", selector)["items"]

    def apply(self, doc: dict[str, Any], ns: str | None = None, check: bool = True) -> Any:
        return self.lc.kubectl(
            "apply", "-n", ns or self.ns, "-f", "-", input=yaml.safe_dump(doc), check=check
        )

    def wait_ready(self, name: str, ns: str | None = None, timeout: float = READY_TIMEOUT) -> dict[str, Any]:
        def ready() -> dict[str, Any] | None:
            obj = self.ic(name, ns)
            st = obj.get("status") or {}
            ok = (
                condition(obj, "Ready").get("status") == "True"
                and st.get("observedGeneration") == obj["metadata"]["generation"]
            )
            return obj if ok else None

        return self.lc.wait_for(f"InferenceCluster {name} Ready", ready, timeout=timeout, interval=0.3)

    def wait_condition(self, name: str, type_: str, status: str, reason: str | None = None) -> dict[str, Any]:
        def check() -> dict[str, Any] | None:
            obj = self.ic(name)
            c = condition(obj, type_)
            gen_ok = (obj.get("status") or {}).get("observedGeneration") == obj["metadata"]["generation"]
            return (
                obj
                if gen_ok and c.get("status") == status and (reason is None or c.get("reason") == reason)
                else None
            )

        return self.lc.wait_for(f"{name} {type_}={status}", check, timeout=READY_TIMEOUT, interval=0.3)


def condition(obj: dict[str, Any], type_: str) -> dict[str, Any]:
    for c in (obj.get("status") or {}).get("conditions") or []:
        if c.get("type") == type_:
            return c
    return {}


def example(name: str) -> dict[str, Any]:
    return yaml.safe_load((EXAMPLES / name).read_text())


def tracebacks(log: str) -> list[str]:
    """Log records that carry a Python traceback (JSON logs put it in exc_info; text logs print it)."""
    out = []
    for line in log.splitlines():
        if "Traceback (most recent call last)" in line or '"exc_info"' in line:
            out.append(line[:2000])
    return out


@pytest.fixture(scope="module", name="operator_env")
def operator_env_fixture(
    local_cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[OperatorEnv]:
    """A module may set OPERATOR_ARGS = [...] for extra `kvstrata operator` flags."""
    # Its own release and namespace: a demo or e2e run sharing the cluster keeps its own release.
    inst = install_chart(local_cluster, release="kvstrata-it", namespace="kvstrata-it")
    op: OperatorProcess | None = None
    try:
        extra = list(getattr(request.module, "OPERATOR_ARGS", []))
        op = run_operator(inst, tmp_path_factory.mktemp("operator"), extra_args=extra)
        with fresh_namespace(local_cluster, "kvs-op") as ns:
            ensure_model_claim(local_cluster, ns)
            wait_webhook_serving(local_cluster, ns)
            env = OperatorEnv(local_cluster, inst, op, ns)
            try:
                yield env
            finally:
                # Delete while the operator runs, so nothing waits on it; GC removes the children.
                local_cluster.kubectl(
                    "delete", "inferenceclusters", "--all", "-n", ns, "--wait=true", check=False
                )
    finally:
        if op is not None:
            op.stop()
            print(f"operator log: {op.log_path}")
        uninstall_chart(inst, delete_namespace=True)
        time.sleep(0.1)
