"""What the webhook refuses and the reconciler reports: one pure check, shared by both.

`check` runs the API models (field-named errors), the name-length rule the children impose and the planner.
The webhook adds what needs the cluster (a default StorageClass); the reconciler re-checks because objects can
exist that no webhook saw (created while it was down or before it was installed).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvstrata.api.manifest import ManifestError, validate
from kvstrata.api.models import API_VERSION, KIND, InferenceClusterSpec
from kvstrata.planner import Plan, plan

# The engine StatefulSet is "<name>-engine"; its pods carry controller-revision-hash "<sts>-<hash of up to
# 10 chars>", a label value capped at 63 characters. 63 - 1 - 10 - len("-engine") = 45.
MAX_NAME = 45


@dataclass
class Verdict:
    spec: InferenceClusterSpec | None = None
    plan: Plan | None = None
    reason: str = ""  # InvalidSpec | Infeasible | "" (fine)
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def message(self) -> str:
        return "; ".join(self.problems)


def name_problem(name: str) -> str | None:
    if len(name) > MAX_NAME:
        return (
            f"metadata.name: {name!r} has {len(name)} characters; at most {MAX_NAME} fit the engine pods' "
            f"controller-revision-hash label ({name}-engine-<hash> must stay within 63): use a shorter name"
        )
    return None


def check(obj: dict[str, Any]) -> Verdict:
    """Validate an InferenceCluster as the apiserver hands it over (defaults applied, metadata filled in)."""
    meta = obj.get("metadata") or {}
    doc = {
        "apiVersion": obj.get("apiVersion", API_VERSION),
        "kind": obj.get("kind", KIND),
        "metadata": {"name": meta.get("name", ""), "namespace": meta.get("namespace")},
        "spec": obj.get("spec"),
    }
    try:
        ic = validate(doc)
    except ManifestError as err:
        return Verdict(reason="InvalidSpec", problems=[str(err)])
    out = Verdict(spec=ic.spec)
    if problem := name_problem(ic.metadata.name):
        out.reason = "InvalidSpec"
        out.problems.append(problem)
        return out
    out.plan = plan(ic.spec)
    out.warnings = list(out.plan.warnings)
    if not out.plan.feasible:
        out.reason = "Infeasible"
        out.problems += [p.message() for p in out.plan.problems]
    return out


def storage_class_problem(spec: InferenceClusterSpec, classes: list[tuple[str, bool]]) -> str | None:
    """An NVMe tier without storageClassName needs a default StorageClass. `classes`: (name, is_default)."""
    nvme = spec.kv_cache.tiers.nvme
    if nvme is None or nvme.storage_class_name:
        return None
    if any(default for _, default in classes):
        return None
    names = ", ".join(sorted(n for n, _ in classes)) or "none exist"
    return (
        "spec.kvCache.tiers.nvme.storageClassName: not set and the cluster has no default StorageClass, so the "
        f"cache PVCs would never bind: set storageClassName to one of the StorageClasses ({names}), or mark one "
        "default with the annotation storageclass.kubernetes.io/is-default-class=true"
    )


def storage_class_warning(spec: InferenceClusterSpec, classes: list[tuple[str, bool]]) -> str | None:
    nvme = spec.kv_cache.tiers.nvme
    if nvme is None or not nvme.storage_class_name:
        return None
    if any(n == nvme.storage_class_name for n, _ in classes):
        return None
    return (
        f"spec.kvCache.tiers.nvme.storageClassName: StorageClass {nvme.storage_class_name!r} does not exist (yet); "
        "the cache PVCs stay Pending until it does"
    )


def is_default_class(sc: dict[str, Any]) -> bool:
    ann = sc.get("metadata", {}).get("annotations") or {}
    return any(
        ann.get(k) == "true"
        for k in (
            "storageclass.kubernetes.io/is-default-class",
            "storageclass.beta.kubernetes.io/is-default-class",
        )
    )
