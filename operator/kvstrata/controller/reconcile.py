"""One reconcile of one InferenceCluster: validate → plan → render → server-side apply → status.

Kept free of kopf so it can be unit-tested with a fake API: the handler module translates its outcome and
its exceptions into kopf's (TemporaryError with a delay for what may pass, PermanentError for what won't).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from kvstrata.controller import metrics
from kvstrata.controller.apply import Applier, WaitingError
from kvstrata.controller.kube import KubeError
from kvstrata.controller.status import PlanRecord
from kvstrata.controller.statussync import StatusSync
from kvstrata.controller.store import Store
from kvstrata.controller.validation import Verdict, check
from kvstrata.render import engine_name, engine_selector, monitors, render, selector_string

Obj = dict[str, Any]
# (body, type, reason, message): posts a Kubernetes Event about the InferenceCluster.
EmitFn = Callable[[Obj, str, str, str], None]
log = logging.getLogger("kvstrata.reconcile")


class Retry(Exception):
    """Try again after `delay` seconds: the cause may pass (API trouble, a delete in progress)."""

    def __init__(self, message: str, delay: float) -> None:
        super().__init__(message)
        self.delay = delay


class Fatal(Exception):
    """Retrying the same spec cannot help (the apiserver rejects what we render)."""


class Severity(Enum):
    INFO = "info"
    WARNING = "warning"


# Kubernetes Event types by severity.
EVENT_TYPE = {Severity.INFO: "Normal", Severity.WARNING: "Warning"}


@dataclass(frozen=True)
class Note:
    """Something an apply did besides applying, worth an Event."""

    severity: Severity
    text: str


@dataclass
class Outcome:
    result: str  # applied | infeasible
    record: PlanRecord
    notes: list[Note] = field(default_factory=list)


def _record(body: Obj, verdict: Verdict) -> PlanRecord:
    meta, spec = body["metadata"], body.get("spec") or {}
    name = meta["name"]
    p = verdict.plan
    nvme = verdict.spec is not None and verdict.spec.kv_cache.tiers.nvme is not None
    if not verdict.ok:
        reason, message = verdict.reason, verdict.message()
    else:
        assert p is not None
        reason = "PlanFitsWithOffload" if p.verdict == "fits-with-offload" else "PlanFits"
        message = p.summary() + (f" ({p.offload_reason})" if p.offload_reason else "")
    plan_status = p.to_status().wire() if p is not None else {}
    if not verdict.ok and plan_status:
        plan_status["summary"] = message[:1000]
    replicas = verdict.spec.replicas if verdict.spec else int(spec.get("replicas") or 0)
    router_replicas = verdict.spec.router.replicas if verdict.spec else 1
    return PlanRecord(
        generation=meta.get("generation", 0),
        feasible=verdict.ok,
        reason=reason,
        message=message,
        plan=plan_status,
        tiers=p.tier_names if p is not None and verdict.ok else "-",
        selector=selector_string(engine_selector(name)),
        replicas=replicas,
        router_replicas=router_replicas,
        flags_digest=p.flags_digest if p is not None and verdict.ok else "",
        nvme_claim_prefix=f"kv-cache-{engine_name(name)}-" if nvme else None,
    )


def classify(err: KubeError, what: str) -> Exception:
    metrics.ERRORS.labels(f"api-{err.status}" if err.status else "unreachable").inc()
    if err.retryable:
        # 403 is usually RBAC: a longer wait, the message says what was refused.
        delay = 30.0 if err.status == 403 else 10.0 if err.status == 429 else 3.0
        return Retry(f"{what}: {err}", delay)
    return Fatal(f"{what}: {err}")


class Reconciler:
    def __init__(
        self,
        applier: Applier,
        store: Store,
        sync: StatusSync,
        emit: EmitFn,
        served: Callable[[str, str], bool] = lambda api_version, kind: False,
    ) -> None:
        self.applier = applier
        self.store = store
        self.sync = sync
        self.emit = emit
        # Whether an optional kind is served (the Prometheus Operator's monitors): applied only then.
        self.served = served
        self._locks: dict[tuple[str, str], threading.Lock] = {}
        self._locks_guard = threading.Lock()

    def _lock(self, body: Obj) -> threading.Lock:
        key = (body["metadata"]["namespace"], body["metadata"]["name"])
        with self._locks_guard:
            return self._locks.setdefault(key, threading.Lock())

    def reconcile(self, body: Obj) -> Outcome:
        """kopf's handlers, the drift repair and the periodic resync may ask at once: one at a time."""
        with self._lock(body):
            return self._timed(body)

    def forget(self, key: tuple[str, str]) -> None:
        with self._locks_guard:
            self._locks.pop(key, None)

    def _timed(self, body: Obj) -> Outcome:
        started = time.monotonic()
        try:
            outcome = self._reconcile(body)
        except Retry:
            metrics.RECONCILES.labels("retry").inc()
            raise
        except Fatal:
            metrics.RECONCILES.labels("error").inc()
            raise
        metrics.RECONCILES.labels(outcome.result).inc()
        metrics.RECONCILE_SECONDS.observe(time.monotonic() - started)
        return outcome

    def _reconcile(self, body: Obj) -> Outcome:
        meta = body["metadata"]
        key = self.store.observe_cluster(body)
        verdict = check(body)
        record = _record(body, verdict)
        if not verdict.ok:
            # Leave existing children alone: they keep serving the last feasible spec. One Event per
            # verdict, not one per resync.
            previous, *_ = self.store.snapshot(key)
            if previous != record:
                self.emit(body, "Warning", verdict.reason, verdict.message()[:1024])
            self.store.set_record(key, record)
            self._write_status(key)
            return Outcome("infeasible", record)
        assert verdict.spec is not None and verdict.plan is not None
        objects = render(meta["name"], meta["namespace"], verdict.spec, verdict.plan, uid=meta["uid"])
        optional = monitors(meta["name"], meta["namespace"], verdict.spec, verdict.plan, meta["uid"])
        objects += [o for o in optional if self.served(o["apiVersion"], o["kind"])]
        try:
            result = self.applier.apply_all(objects)
        except KubeError as err:
            raise classify(err, "applying children") from None
        except WaitingError as err:
            metrics.ERRORS.labels("waiting").inc()
            raise Retry(str(err), 2.0) from None
        # The applier's warnings are what it could not do (e.g. grow a PVC).
        notes = [Note(Severity.WARNING, w) for w in result.warnings]
        if result.recreated_statefulset:
            text = (
                f"re-created StatefulSet {engine_name(meta['name'])} (orphaning its pods) to change its "
                "volumeClaimTemplates"
                + (f"; grew PVCs {', '.join(result.expanded_pvcs)}" if result.expanded_pvcs else "")
            )
            notes.append(Note(Severity.INFO, text))
        for note in notes:
            self.emit(body, EVENT_TYPE[note.severity], "Applied", note.text[:1024])
        for obj in result.applied:
            if obj.get("kind") in ("StatefulSet", "Deployment"):
                self.store.observe_child(obj["kind"], obj)
        self.store.set_record(key, record)
        self._write_status(key)
        return Outcome("applied", record, notes)

    def _write_status(self, key: tuple[str, str]) -> None:
        try:
            self.sync.sync(key)
        except KubeError as err:
            if err.not_found:
                return
            # The children are applied; the status loop retries the write on its own.
            log.warning("status of %s/%s not written yet: %s", key[0], key[1], err)
            self.sync.mark(key)
