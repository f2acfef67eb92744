"""Owned status: conditions from observations, stable lastTransitionTime, minimal patches."""

from __future__ import annotations

from kvstrata.controller.status import (
    DeployView,
    Observed,
    PlanRecord,
    PvcView,
    StsView,
    conditions,
    desired_status,
    merge_conditions,
    status_patch,
)


def record(**kw: object) -> PlanRecord:
    base = dict(
        generation=3,
        feasible=True,
        reason="PlanFits",
        message="fits: gpu 1,000 tokens",
        plan={"verdict": "fits"},
        tiers="gpu",
        selector="app.kubernetes.io/component=engine,app.kubernetes.io/instance=x",
        replicas=3,
        router_replicas=1,
        flags_digest="abc",
        nvme_claim_prefix=None,
    )
    base.update(kw)
    return PlanRecord(**base)  # type: ignore[arg-type]


def sts(
    ready: int = 3, replicas: int = 3, cur: str = "r1", upd: str = "r1", digest: str = "abc", gen: int = 2
) -> StsView:
    return StsView(gen, gen, replicas, ready, replicas, cur, upd, digest)


def router(available: int = 1) -> DeployView:
    return DeployView(1, 1, 1, 1, available, 1)


def by_type(conds: list) -> dict:
    return {c.type: c for c in conds}


def test_all_ready() -> None:
    c = by_type(conditions(record(), Observed(sts=sts(), router=router())))
    assert [
        c[t].status for t in ("Planned", "CacheVolumesBound", "EnginesReady", "RouterReady", "Ready")
    ] == ["True"] * 5
    assert c["Ready"].reason == "Ready"
    assert "3/3 engine pods ready" in c["Ready"].message


def test_engines_not_ready_names_counts() -> None:
    c = by_type(conditions(record(), Observed(sts=sts(ready=1), router=router())))
    assert c["EnginesReady"].status == "False"
    assert c["EnginesReady"].message == "1/3 engine pods ready"
    assert (c["Ready"].status, c["Ready"].reason) == ("False", "EnginesNotReady")


def test_rolling_update_and_stale_digest_are_not_ready() -> None:
    rolling = by_type(conditions(record(), Observed(sts=sts(upd="r2"), router=router())))
    assert rolling["EnginesReady"].reason == "RollingUpdate"
    stale = by_type(conditions(record(), Observed(sts=sts(digest="old"), router=router())))
    assert stale["EnginesReady"].reason == "Progressing"


def test_missing_children_pending() -> None:
    c = by_type(conditions(record(), Observed()))
    assert c["EnginesReady"].reason == "Pending"
    assert c["RouterReady"].reason == "Pending"
    assert c["Ready"].status == "False"


def test_router_unavailable() -> None:
    c = by_type(conditions(record(), Observed(sts=sts(), router=router(available=0))))
    assert (c["RouterReady"].status, c["Ready"].reason) == ("False", "RouterNotReady")


def test_nvme_volumes_bound_and_pending() -> None:
    rec = record(nvme_claim_prefix="kv-cache-x-engine-", replicas=2)
    pvcs = (
        PvcView("kv-cache-x-engine-0", "Bound", "1Gi", "1Gi"),
        PvcView("kv-cache-x-engine-1", "Pending", "1Gi", None),
    )
    c = by_type(conditions(rec, Observed(sts=sts(ready=2, replicas=2), router=router(), pvcs=pvcs)))
    assert c["CacheVolumesBound"].status == "False"
    assert "kv-cache-x-engine-1" in c["CacheVolumesBound"].message
    assert c["Ready"].reason == "CacheVolumesPending"
    bound = (pvcs[0], PvcView("kv-cache-x-engine-1", "Bound", "1Gi", "1Gi"))
    c = by_type(conditions(rec, Observed(sts=sts(ready=2, replicas=2), router=router(), pvcs=bound)))
    assert c["CacheVolumesBound"].status == "True"
    assert c["Ready"].status == "True"


def test_infeasible_is_not_ready_with_planner_message() -> None:
    rec = record(feasible=False, reason="Infeasible", message="spec.engine.maxModelLen: too long: lower it")
    c = by_type(conditions(rec, Observed(sts=sts(), router=router())))
    assert (c["Planned"].status, c["Planned"].reason) == ("False", "Infeasible")
    assert (c["Ready"].status, c["Ready"].reason) == ("False", "PlanInfeasible")
    assert "spec.engine.maxModelLen" in c["Ready"].message


def test_transition_time_only_moves_when_status_changes() -> None:
    first = merge_conditions(conditions(record(), Observed(sts=sts(ready=1), router=router())), [], 3, "T1")
    # same status, different message: time stays
    second = merge_conditions(
        conditions(record(), Observed(sts=sts(ready=2), router=router())), first, 3, "T2"
    )
    eng = {c["type"]: c for c in second}["EnginesReady"]
    assert (eng["lastTransitionTime"], eng["message"]) == ("T1", "2/3 engine pods ready")
    third = merge_conditions(conditions(record(), Observed(sts=sts(), router=router())), second, 3, "T3")
    assert {c["type"]: c for c in third}["EnginesReady"]["lastTransitionTime"] == "T3"
    assert {c["type"]: c for c in third}["Planned"]["lastTransitionTime"] == "T1"


def test_foreign_conditions_and_keys_survive() -> None:
    previous = {
        "conditions": [
            {"type": "MetricsAvailable", "status": "True", "reason": "Scraped", "lastTransitionTime": "T0"}
        ],
        "cache": {"hitRate": 0.5},
    }
    desired = desired_status(record(), Observed(sts=sts(), router=router()), previous, "T1")
    assert "cache" not in desired  # never written by this module
    assert desired["conditions"][-1]["type"] == "MetricsAvailable"
    assert desired["ready"] == "3/3" and desired["readyReplicas"] == 3 and desired["observedGeneration"] == 3


def test_patch_is_none_when_nothing_changed() -> None:
    obs = Observed(sts=sts(), router=router())
    desired = desired_status(record(), obs, {}, "T1")
    assert status_patch(desired, desired) is None
    again = desired_status(record(), obs, desired, "T9")
    assert status_patch(again, desired) is None
    moved = desired_status(record(), Observed(sts=sts(ready=2), router=router()), desired, "T9")
    patch = status_patch(moved, desired)
    assert patch is not None and set(patch) == {"conditions", "readyReplicas", "ready"}
