"""The validating admission webhook: the planner's verdict at `kubectl apply` time.

CEL rules in the CRD catch shape errors inside the apiserver; this webhook adds what needs code or the
cluster: the planner's feasibility verdict (with the field and the fixes), the name-length rule, and a
default StorageClass for an NVMe tier without storageClassName. Planner warnings come back to kubectl as
admission warnings.

An UPDATE that leaves the spec unchanged is always allowed, so metadata changes (labels, kopf's own
annotations, the garbage collector's bookkeeping) can never be blocked by a spec that became infeasible
later (say, the default StorageClass was removed).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from kvstrata.controller.kube import Kube, KubeError
from kvstrata.controller.validation import (
    check,
    is_default_class,
    storage_class_problem,
    storage_class_warning,
)

Obj = dict[str, Any]


@dataclass
class Decision:
    allowed: bool
    message: str = ""
    warnings: list[str] = field(default_factory=list)


def decide(new: Obj, old: Obj | None, operation: str, classes: list[tuple[str, bool]] | None) -> Decision:
    """Pure decision. `classes` is [(StorageClass name, is default)], None when they could not be listed."""
    if operation == "UPDATE" and old is not None and old.get("spec") == new.get("spec"):
        return Decision(True)
    verdict = check(new)
    if not verdict.ok:
        return Decision(False, verdict.message(), verdict.warnings)
    assert verdict.spec is not None
    warnings = list(verdict.warnings)
    if verdict.spec.kv_cache.tiers.nvme is not None:
        if classes is None:
            warnings.append("could not list StorageClasses to check spec.kvCache.tiers.nvme; not checked")
        else:
            if problem := storage_class_problem(verdict.spec, classes):
                return Decision(False, problem, warnings)
            if warning := storage_class_warning(verdict.spec, classes):
                warnings.append(warning)
    return Decision(True, "", warnings)


def _needs_classes(new: Obj) -> bool:
    tiers = ((new.get("spec") or {}).get("kvCache") or {}).get("tiers") or {}
    return bool(tiers.get("nvme"))


def list_classes(kube: Kube) -> list[tuple[str, bool]] | None:
    try:
        items = kube.list("storage.k8s.io/v1", "StorageClass", None)
    except KubeError:
        return None
    return [(sc["metadata"]["name"], is_default_class(sc)) for sc in items]


async def review(kube: Kube, new: Obj, old: Obj | None, operation: str) -> Decision:
    classes = await asyncio.to_thread(list_classes, kube) if _needs_classes(new) else []
    # The planner is pure CPU work of a millisecond or two: fine on the event loop.
    return decide(new, old, operation, classes)
