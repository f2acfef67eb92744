"""Server-side apply of an InferenceCluster's children, including the one change SSA cannot make.

Every rendered object is applied with field manager `kvstrata` and `force=True`: the rendered dict holds only
fields kvstrata owns (render never sets fields another controller or an autoscaler owns), so forcing takes
back our own fields after a manual edit and never touches anyone else's.

StatefulSet `volumeClaimTemplates` (and `serviceName`, `podManagementPolicy`, `selector`) are immutable. When
they change (the NVMe tier was added, removed or resized), the operator:

1. grows every existing PVC whose request is below the new size (the StorageClass must allow expansion;
   PVCs never shrink, so a smaller size only applies to PVCs created from now on);
2. deletes the StatefulSet with `propagationPolicy=Orphan`, which keeps its pods and PVCs running;
3. waits until it is gone and applies the new one, which adopts the orphaned pods (same selector) and rolls
   them to the new template; PVCs are matched to pods by name, so each pod keeps its warm cache.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvstrata.api.quantity import quantity_bytes
from kvstrata.controller.kube import Kube, KubeError, Obj

FIELD_MANAGER = "kvstrata"
# StatefulSet spec fields the apiserver refuses to update in place.
IMMUTABLE_STS_FIELDS = ("volumeClaimTemplates", "serviceName", "podManagementPolicy", "selector")


class WaitingError(Exception):
    """A step is in progress (an orphaning delete); try again shortly."""


@dataclass
class ApplyResult:
    applied: list[Obj] = field(default_factory=list)
    recreated_statefulset: bool = False
    expanded_pvcs: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def _vct_key(vct: Obj) -> tuple[Any, ...]:
    """What makes two claim templates the same claim: name, class, modes, size, labels."""
    spec = vct.get("spec", {})
    size = spec.get("resources", {}).get("requests", {}).get("storage")
    return (
        vct.get("metadata", {}).get("name"),
        spec.get("storageClassName"),
        tuple(spec.get("accessModes") or ()),
        quantity_bytes(size) if size is not None else None,
        tuple(sorted((vct.get("metadata", {}).get("labels") or {}).items())),
    )


def immutable_diff(live: Obj, desired: Obj) -> list[str]:
    """The immutable StatefulSet spec fields that differ between the live object and the desired one."""
    out = []
    ls, ds = live.get("spec", {}), desired.get("spec", {})
    live_vcts = sorted(_vct_key(v) for v in ls.get("volumeClaimTemplates") or [])
    want_vcts = sorted(_vct_key(v) for v in ds.get("volumeClaimTemplates") or [])
    if live_vcts != want_vcts:
        out.append("volumeClaimTemplates")
    if ls.get("serviceName") != ds.get("serviceName"):
        out.append("serviceName")
    if ls.get("podManagementPolicy", "OrderedReady") != ds.get("podManagementPolicy", "OrderedReady"):
        out.append("podManagementPolicy")
    if (ls.get("selector") or {}).get("matchLabels") != (ds.get("selector") or {}).get("matchLabels"):
        out.append("selector")
    return out


def pvcs_to_grow(desired_sts: Obj, pvcs: list[Obj]) -> list[tuple[str, str]]:
    """(claim name, new size) for the StatefulSet's existing claims that are smaller than the template."""
    sts_name = desired_sts["metadata"]["name"]
    out = []
    for vct in desired_sts.get("spec", {}).get("volumeClaimTemplates") or []:
        prefix = f"{vct['metadata']['name']}-{sts_name}-"
        size = vct["spec"]["resources"]["requests"]["storage"]
        for pvc in pvcs:
            name = pvc["metadata"]["name"]
            if not name.startswith(prefix) or not name.removeprefix(prefix).isdigit():
                continue
            have = pvc.get("spec", {}).get("resources", {}).get("requests", {}).get("storage")
            if have is None or quantity_bytes(have) < quantity_bytes(size):
                out.append((name, size))
    return sorted(out)


class Applier:
    def __init__(
        self,
        kube: Kube,
        manager: str = FIELD_MANAGER,
        orphan_wait: float = 15.0,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.kube = kube
        self.manager = manager
        self.orphan_wait = orphan_wait
        self.sleep = sleep

    def apply_all(self, objects: list[Obj]) -> ApplyResult:
        result = ApplyResult()
        for obj in objects:
            if obj["kind"] == "StatefulSet":
                self._replace_if_immutable_changed(obj, result)
            try:
                result.applied.append(self.kube.apply(obj, self.manager))
            except KubeError as err:
                if obj["kind"] == "StatefulSet" and err.immutable_field_change:
                    # An immutable field we did not foresee: same remedy as for claim templates.
                    self._orphan_delete(obj, result)
                    result.applied.append(self.kube.apply(obj, self.manager))
                else:
                    raise
        return result

    def _replace_if_immutable_changed(self, desired: Obj, result: ApplyResult) -> None:
        meta = desired["metadata"]
        live = self.kube.get("apps/v1", "StatefulSet", meta["namespace"], meta["name"])
        if live is None:
            return
        if live["metadata"].get("deletionTimestamp"):
            self._wait_gone(desired)
            return
        changed = immutable_diff(live, desired)
        if not changed:
            return
        if "volumeClaimTemplates" in changed:
            self._grow_pvcs(desired, result)
        self._orphan_delete(desired, result)

    def _grow_pvcs(self, desired: Obj, result: ApplyResult) -> None:
        ns = desired["metadata"]["namespace"]
        pvcs = self.kube.list("v1", "PersistentVolumeClaim", ns)
        for name, size in pvcs_to_grow(desired, pvcs):
            try:
                self.kube.merge_patch(
                    "v1",
                    "PersistentVolumeClaim",
                    ns,
                    name,
                    {"spec": {"resources": {"requests": {"storage": size}}}},
                    manager=self.manager,
                )
                result.expanded_pvcs.append(name)
            except KubeError as err:
                if err.status in (403, 422):
                    # The StorageClass does not allow expansion: the pod keeps its smaller cache.
                    result.warnings.append(f"could not grow PVC {name} to {size}: {err.message}")
                else:
                    raise

    def _orphan_delete(self, desired: Obj, result: ApplyResult) -> None:
        meta = desired["metadata"]
        self.kube.delete("apps/v1", "StatefulSet", meta["namespace"], meta["name"], propagation="Orphan")
        result.recreated_statefulset = True
        self._wait_gone(desired)

    def _wait_gone(self, desired: Obj) -> None:
        meta = desired["metadata"]
        deadline = time.monotonic() + self.orphan_wait
        while self.kube.get("apps/v1", "StatefulSet", meta["namespace"], meta["name"]) is not None:
            if time.monotonic() > deadline:
                raise WaitingError(
                    f"StatefulSet {meta['name']} is still being deleted (orphaning its pods); will retry"
                )
            self.sleep(0.2)
