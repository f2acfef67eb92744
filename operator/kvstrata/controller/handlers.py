"""kopf wiring: which events call what. The logic lives in reconcile, statussync and webhook.

- InferenceCluster create / spec update / operator resume → `Reconciler.reconcile` (in a worker thread).
- Watch events of InferenceClusters and of their StatefulSets, Deployments and PVCs → the in-memory store,
  which marks the owner dirty for the status loop.
- Validating admission → `webhook.review`.

No finalizers: children carry ownerReferences, so the garbage collector deletes them, and a CR can always
be deleted, even with the operator down. (kopf adds its finalizer only for deletion handlers, daemons and
timers; none are registered here.)
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, cast

import kopf

from kvstrata.api.models import API_VERSION, GROUP, KIND, PLURAL, VERSION
from kvstrata.api.router_config import LABEL_MANAGED_BY
from kvstrata.controller import cache_status, metrics, webhook
from kvstrata.controller.apply import Applier
from kvstrata.controller.kube import Kube, KubeError
from kvstrata.controller.optional_apis import ServedKinds
from kvstrata.controller.reconcile import Fatal, Reconciler, Retry
from kvstrata.controller.settings import OperatorConfig
from kvstrata.controller.statussync import StatusSync
from kvstrata.controller.store import Store

MANAGED = {LABEL_MANAGED_BY: "kvstrata"}
WEBHOOK_ID = "validate-inferencecluster"
ANNOTATION_PREFIX = "kvstrata.io"
log = logging.getLogger("kvstrata.operator")


@dataclass
class Runtime:
    config: OperatorConfig
    kube: Kube
    store: Store
    sync: StatusSync
    reconciler: Reconciler
    tasks: list[asyncio.Task[Any]]


def repair(rt: Runtime, key: tuple[str, str]) -> None:
    """Re-apply one cluster's children from its current spec (a child was deleted, or the periodic
    resync). Skipped while kopf has a newer generation to handle: its own handler applies then."""
    namespace, name = key
    try:
        body = rt.kube.get(API_VERSION, KIND, namespace, name)
    except KubeError as err:
        log.warning("re-apply of %s/%s skipped: %s", namespace, name, err)
        return
    if body is None or body["metadata"].get("deletionTimestamp"):
        return
    record, *_ = rt.store.snapshot(key)
    if record is None or record.generation != body["metadata"].get("generation"):
        return
    try:
        rt.reconciler.reconcile(body)
    except (Retry, Fatal) as err:
        log.warning("re-apply of %s/%s failed (the next resync retries): %s", namespace, name, err)


async def resync_forever(rt: Runtime) -> None:
    """Level-triggered safety net: every cluster is re-applied every `resync_interval` seconds, one at a
    time, which restores children deleted or edited behind the operator's back."""
    while True:
        await asyncio.sleep(rt.config.resync_interval)
        for key in rt.store.live_keys():
            await asyncio.to_thread(repair, rt, key)


def _emit(body: dict[str, Any], type_: str, reason: str, message: str) -> None:
    # kopf.Body wraps the raw dict it reads; a plain dict is what it is made from.
    kopf.event(kopf.Body(cast(kopf.RawBody, body)), type=type_, reason=reason, message=message)


def _object(event: kopf.RawEvent) -> dict[str, Any]:
    """The watched object of a raw watch event, as the plain dict the store keeps."""
    return cast(dict[str, Any], event.get("object") or {})


def build_runtime(config: OperatorConfig, kube: Kube) -> Runtime:
    store = Store()
    sync = StatusSync(kube, store, min_interval=config.status_min_interval)
    reconciler = Reconciler(Applier(kube), store, sync, _emit, served=ServedKinds(kube))
    return Runtime(config, kube, store, sync, reconciler, tasks=[])


def kopf_settings(config: OperatorConfig) -> kopf.OperatorSettings:
    s = kopf.OperatorSettings()
    # Progress and the last handled spec live in annotations: status stays ours and the other writers'.
    s.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=ANNOTATION_PREFIX)
    s.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=ANNOTATION_PREFIX, key="last-handled-configuration"
    )
    s.persistence.finalizer = f"{ANNOTATION_PREFIX}/finalizer"
    # kopf would post an Event for every "handler succeeded" line; only warnings are worth an Event.
    s.posting.level = logging.WARNING
    s.execution.max_workers = config.workers
    # Resources are discovered once at start: no CRD watch, so no RBAC on customresourcedefinitions.
    s.scanning.disabled = True
    if config.webhook:
        assert config.webhook_cert_dir is not None
        s.admission.server = kopf.WebhookServer(
            addr=config.webhook_addr,
            port=config.webhook_port,
            certfile=str(config.webhook_cert_dir / "tls.crt"),
            pkeyfile=str(config.webhook_cert_dir / "tls.key"),
            # Re-read the files when the mounted Secret changes (certificate rotation).
            file_check_interval=60,
        )
    return s


def register(registry: kopf.OperatorRegistry, rt: Runtime) -> None:
    ic: dict[str, Any] = {"group": GROUP, "version": VERSION, "plural": PLURAL, "registry": registry}

    @kopf.on.login(registry=registry, id="login")
    def login(**_: Any) -> kopf.ConnectionInfo:
        # kopf's watches use the very credentials of the operator's own client (--kubeconfig or in-cluster).
        c = rt.kube.credentials()
        return kopf.ConnectionInfo(
            server=c["server"],
            ca_path=c["ca_path"],
            insecure=c["insecure"],
            scheme=c["scheme"],
            token=c["token"],
            certificate_path=c["certificate_path"],
            private_key_path=c["private_key_path"],
        )

    @kopf.on.startup(registry=registry, id="status-loop-start")
    async def start_status_loop(**_: Any) -> None:
        rt.tasks.append(asyncio.create_task(rt.sync.run(), name="kvstrata-status"))
        if rt.config.resync_interval > 0:
            rt.tasks.append(asyncio.create_task(resync_forever(rt), name="kvstrata-resync"))

    @kopf.on.cleanup(registry=registry, id="status-loop-stop")
    async def stop_status_loop(**_: Any) -> None:
        for task in rt.tasks:
            task.cancel()

    @kopf.on.resume(**ic, id="reconcile")
    @kopf.on.create(**ic, id="reconcile")
    @kopf.on.update(**ic, id="reconcile", field="spec")
    def reconcile(*, body: kopf.Body, logger: kopf.Logger, **kwargs: Any) -> None:
        try:
            outcome = rt.reconciler.reconcile(dict(body))
        except Retry as err:
            raise kopf.TemporaryError(str(err), delay=err.delay) from None
        except Fatal as err:
            raise kopf.PermanentError(str(err)) from None
        if outcome.result == "infeasible":
            logger.warning(f"not applied: {outcome.record.reason}: {outcome.record.message}")
        else:
            logger.info(f"applied: {outcome.record.message}")

    @kopf.on.event(**ic, id="cluster-status")
    async def cluster_event(*, event: kopf.RawEvent, **kwargs: Any) -> None:
        obj = _object(event)
        if not obj.get("metadata", {}).get("name"):
            return
        if event.get("type") == "DELETED":
            key = rt.store.observe_cluster(obj, deleted=True)
            rt.sync.forget(key)
            rt.reconciler.forget(key)
        else:
            rt.sync.mark(rt.store.observe_cluster(obj))
        metrics.CLUSTERS.set(len(rt.store))

    def child_handler(kind: str) -> Any:
        async def child_event(*, event: kopf.RawEvent, **kwargs: Any) -> None:
            obj = _object(event)
            if not obj.get("metadata", {}).get("name"):
                return
            deleted = event.get("type") == "DELETED"
            key = rt.store.observe_child(kind, obj, deleted=deleted)
            rt.sync.mark(key)
            if deleted and key is not None and kind in ("StatefulSet", "Deployment"):
                # Someone deleted a workload we own (not the garbage collector: the owner is alive).
                _, _, _, alive = rt.store.snapshot(key)
                if alive:
                    await asyncio.to_thread(repair, rt, key)

        child_event.__name__ = f"{kind.lower()}_event"
        return child_event

    for group, version, plural, kind in (
        ("apps", "v1", "statefulsets", "StatefulSet"),
        ("apps", "v1", "deployments", "Deployment"),
        ("", "v1", "persistentvolumeclaims", "PersistentVolumeClaim"),
    ):
        kopf.on.event(group, version, plural, id=f"{kind.lower()}-status", labels=MANAGED, registry=registry)(
            child_handler(kind)
        )

    if rt.config.webhook:

        @kopf.on.validate(**ic, id=WEBHOOK_ID, operations=["CREATE", "UPDATE"])
        async def validate(*, body: kopf.Body, warnings: list[str], **kwargs: Any) -> None:
            # kopf passes these to validating handlers beyond its WebhookFn protocol.
            old: Any = kwargs.get("old")
            operation = str(kwargs.get("operation") or "")
            decision = await webhook.review(rt.kube, dict(body), dict(old) if old else None, operation)
            warnings.extend(decision.warnings)
            metrics.ADMISSIONS.labels("allowed" if decision.allowed else "denied").inc()
            if not decision.allowed:
                raise kopf.AdmissionError(decision.message, code=422)

    cache_status.register(registry, rt)  # live hit rates in status.cache (cache_status.py)
