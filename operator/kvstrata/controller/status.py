"""The status the operator owns, as a pure function of the plan and the children it observed.

Owned keys: observedGeneration, conditions (Planned, CacheVolumesBound, EnginesReady, RouterReady, Ready),
plan, replicas, readyReplicas, ready, tiers, selector. Everything else under status (cache, router, other
conditions) belongs to other writers and is carried over untouched. A condition's lastTransitionTime changes
only when its status does, so repeated writes of the same facts never look like flapping.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvstrata.render import FLAGS_DIGEST_ANNOTATION

Obj = dict[str, Any]
OWNED_KEYS = (
    "observedGeneration",
    "conditions",
    "plan",
    "replicas",
    "readyReplicas",
    "ready",
    "tiers",
    "selector",
)
OWNED_CONDITIONS = ("Planned", "CacheVolumesBound", "EnginesReady", "RouterReady", "Ready")


# ------------------------------------------------------------------------------------ observations
@dataclass(frozen=True)
class StsView:
    generation: int
    observed_generation: int
    replicas: int
    ready_replicas: int
    updated_replicas: int
    current_revision: str
    update_revision: str
    flags_digest: str
    deleting: bool = False

    @classmethod
    def of(cls, obj: Obj) -> StsView:
        st = obj.get("status") or {}
        ann = obj.get("spec", {}).get("template", {}).get("metadata", {}).get("annotations") or {}
        return cls(
            generation=obj["metadata"].get("generation", 0),
            observed_generation=st.get("observedGeneration", 0),
            replicas=st.get("replicas", 0),
            ready_replicas=st.get("readyReplicas", 0),
            updated_replicas=st.get("updatedReplicas", 0),
            current_revision=st.get("currentRevision", ""),
            update_revision=st.get("updateRevision", ""),
            flags_digest=ann.get(FLAGS_DIGEST_ANNOTATION, ""),
            deleting=bool(obj["metadata"].get("deletionTimestamp")),
        )


@dataclass(frozen=True)
class DeployView:
    generation: int
    observed_generation: int
    replicas: int
    updated_replicas: int
    available_replicas: int
    spec_replicas: int

    @classmethod
    def of(cls, obj: Obj) -> DeployView:
        st = obj.get("status") or {}
        return cls(
            generation=obj["metadata"].get("generation", 0),
            observed_generation=st.get("observedGeneration", 0),
            replicas=st.get("replicas", 0),
            updated_replicas=st.get("updatedReplicas", 0),
            available_replicas=st.get("availableReplicas", 0),
            spec_replicas=obj.get("spec", {}).get("replicas", 1),
        )


@dataclass(frozen=True)
class PvcView:
    name: str
    phase: str
    requested: str
    capacity: str | None

    @classmethod
    def of(cls, obj: Obj) -> PvcView:
        st = obj.get("status") or {}
        return cls(
            name=obj["metadata"]["name"],
            phase=st.get("phase", "Pending"),
            requested=obj.get("spec", {}).get("resources", {}).get("requests", {}).get("storage", ""),
            capacity=(st.get("capacity") or {}).get("storage"),
        )


@dataclass(frozen=True)
class Observed:
    sts: StsView | None = None
    router: DeployView | None = None
    pvcs: tuple[PvcView, ...] = ()


@dataclass(frozen=True)
class PlanRecord:
    """What the last reconcile decided for one generation of the spec."""

    generation: int
    feasible: bool
    reason: str  # Planned condition reason
    message: str
    plan: Obj  # PlanStatus, wire form
    tiers: str
    selector: str
    replicas: int
    router_replicas: int
    flags_digest: str
    nvme_claim_prefix: str | None  # "kv-cache-<name>-engine-" when the NVMe tier exists


# -------------------------------------------------------------------------------------- conditions
@dataclass(frozen=True)
class Cond:
    type: str
    status: str
    reason: str
    message: str


def _engines(rec: PlanRecord, obs: Observed) -> Cond:
    want = rec.replicas
    sts = obs.sts
    if sts is None or sts.deleting:
        return Cond("EnginesReady", "False", "Pending", "waiting for the engine StatefulSet")
    if rec.feasible and sts.flags_digest != rec.flags_digest:
        return Cond(
            "EnginesReady", "False", "Progressing", "the engine StatefulSet has not got the new plan yet"
        )
    if sts.observed_generation < sts.generation:
        return Cond(
            "EnginesReady", "False", "Progressing", "the StatefulSet controller has not seen the update yet"
        )
    if want == 0 and sts.replicas == 0:
        return Cond("EnginesReady", "True", "ScaledToZero", "spec.replicas is 0")
    if sts.update_revision and sts.current_revision != sts.update_revision:
        return Cond(
            "EnginesReady",
            "False",
            "RollingUpdate",
            f"{sts.updated_replicas}/{want} engine pods updated, {sts.ready_replicas} ready",
        )
    if sts.ready_replicas < want or sts.replicas != want:
        return Cond("EnginesReady", "False", "PodsNotReady", f"{sts.ready_replicas}/{want} engine pods ready")
    return Cond("EnginesReady", "True", "AllReady", f"{sts.ready_replicas}/{want} engine pods ready")


def _router(rec: PlanRecord, obs: Observed) -> Cond:
    want = rec.router_replicas
    dep = obs.router
    if dep is None:
        return Cond("RouterReady", "False", "Pending", "waiting for the router Deployment")
    if dep.observed_generation < dep.generation:
        return Cond(
            "RouterReady", "False", "Progressing", "the Deployment controller has not seen the update yet"
        )
    if want == 0 and dep.replicas == 0:
        return Cond("RouterReady", "True", "ScaledToZero", "spec.router.replicas is 0")
    if dep.updated_replicas < want or dep.available_replicas < want or dep.replicas > want:
        return Cond(
            "RouterReady",
            "False",
            "PodsNotReady",
            f"{dep.available_replicas}/{want} router pods available, {dep.updated_replicas} updated",
        )
    return Cond(
        "RouterReady", "True", "AllAvailable", f"{dep.available_replicas}/{want} router pods available"
    )


def _volumes(rec: PlanRecord, obs: Observed) -> Cond:
    if rec.nvme_claim_prefix is None:
        return Cond("CacheVolumesBound", "True", "NotRequired", "no NVMe tier: no cache volumes")
    wanted = [f"{rec.nvme_claim_prefix}{i}" for i in range(rec.replicas)]
    by_name = {p.name: p for p in obs.pvcs}
    pending = [n for n in wanted if n not in by_name or by_name[n].phase != "Bound"]
    if pending:
        shown = ", ".join(pending[:5]) + (" ..." if len(pending) > 5 else "")
        return Cond(
            "CacheVolumesBound",
            "False",
            "Pending",
            f"{len(wanted) - len(pending)}/{len(wanted)} cache volumes bound; waiting for {shown}",
        )
    return Cond("CacheVolumesBound", "True", "AllBound", f"{len(wanted)}/{len(wanted)} cache volumes bound")


def conditions(rec: PlanRecord, obs: Observed) -> list[Cond]:
    planned = Cond("Planned", "True" if rec.feasible else "False", rec.reason, rec.message)
    parts = [_volumes(rec, obs), _engines(rec, obs), _router(rec, obs)]
    if not rec.feasible:
        ready = Cond("Ready", "False", "PlanInfeasible", rec.message)
    else:
        failing = next((c for c in parts if c.status != "True"), None)
        if failing is None:
            ready = Cond("Ready", "True", "Ready", f"{parts[1].message}; {parts[2].message}")
        else:
            ready = Cond("Ready", "False", f"{failing.type.removesuffix('Ready')}NotReady", failing.message)
            if failing.type == "CacheVolumesBound":
                ready = Cond("Ready", "False", "CacheVolumesPending", failing.message)
    return [planned, *parts, ready]


def merge_conditions(
    new: Sequence[Cond], previous: Sequence[Obj], generation: int | None, now: str, *, ours_last: bool = False
) -> list[Obj]:
    """KEP-1623 conditions: keep lastTransitionTime when the status is unchanged; keep others' conditions.

    Both status writers (the reconciler's conditions here, `MetricsAvailable` in cache_status) merge
    through this. `ours_last` puts the foreign conditions first (cache_status appends its one condition
    to the live list); `generation` None leaves observedGeneration out."""
    prev = {c.get("type"): c for c in previous or []}
    ours: list[Obj] = []
    for c in new:
        old = prev.get(c.type)
        since = old.get("lastTransitionTime") if old and old.get("status") == c.status else None
        cond: Obj = {
            "type": c.type,
            "status": c.status,
            "reason": c.reason,
            "message": c.message[:32000],
            "lastTransitionTime": since or now,
        }
        if generation is not None:
            cond["observedGeneration"] = generation
        ours.append(cond)
    owned = {c.type for c in new}
    foreign = [c for c in previous or [] if c.get("type") not in owned]
    return foreign + ours if ours_last else ours + foreign


def desired_status(rec: PlanRecord, obs: Observed, previous: Obj | None, now: str) -> Obj:
    """The owned part of status, as it should be now."""
    previous = previous or {}
    sts = obs.sts
    ready_replicas = sts.ready_replicas if sts else 0
    return {
        "observedGeneration": rec.generation,
        "conditions": merge_conditions(
            conditions(rec, obs), previous.get("conditions") or [], rec.generation, now
        ),
        "plan": rec.plan,
        "replicas": sts.replicas if sts else 0,
        "readyReplicas": ready_replicas,
        "ready": f"{ready_replicas}/{rec.replicas}",
        "tiers": rec.tiers,
        "selector": rec.selector,
    }


def status_patch(desired: Obj, previous: Obj | None) -> Obj | None:
    """The merge patch that takes `previous` to `desired` on the owned keys, or None if nothing changed."""
    previous = previous or {}
    patch = {k: v for k, v in desired.items() if previous.get(k) != v}
    return patch or None
