"""In-memory view of InferenceClusters and their children, fed by kopf's watch events.

Status is computed from this view instead of GETs, so a burst of pod readiness changes costs no API reads.
Keys are (namespace, InferenceCluster name); children find their owner through the
`app.kubernetes.io/instance` label that render puts on every child.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Any

from kvstrata.api.router_config import LABEL_COMPONENT, LABEL_INSTANCE
from kvstrata.controller.status import DeployView, Observed, PlanRecord, PvcView, StsView

Obj = dict[str, Any]
Key = tuple[str, str]
INSTANCE = LABEL_INSTANCE
COMPONENT = LABEL_COMPONENT


def owner_key(obj: Obj) -> Key | None:
    meta = obj.get("metadata") or {}
    instance = (meta.get("labels") or {}).get(INSTANCE)
    if not instance or not meta.get("namespace"):
        return None
    return meta["namespace"], instance


def _rv(obj: Obj | None) -> int:
    try:
        return int((obj or {}).get("metadata", {}).get("resourceVersion", "0"))
    except ValueError:
        return 0


@dataclass
class Entry:
    body_meta: Obj = field(default_factory=dict)
    status: Obj = field(default_factory=dict)
    resource_version: int = 0
    record: PlanRecord | None = None
    sts: StsView | None = None
    router: DeployView | None = None
    pvcs: dict[str, PvcView] = field(default_factory=dict)
    # resourceVersion of the newest observation of each child (kind, name)
    child_rvs: dict[tuple[str, str], int] = field(default_factory=dict)
    exists: bool = False


class Store:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[Key, Entry] = {}

    def _entry(self, key: Key) -> Entry:
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = Entry()
        return entry

    # ------------------------------------------------------------------------ InferenceClusters
    def observe_cluster(self, body: Obj, deleted: bool = False) -> Key:
        meta = body["metadata"]
        key = (meta["namespace"], meta["name"])
        with self._lock:
            if deleted:
                self._entries.pop(key, None)
                return key
            entry = self._entry(key)
            rv = _rv(body)
            # Watch events can trail our own patch responses: never step back to an older status.
            if rv >= entry.resource_version:
                entry.resource_version = rv
                entry.status = dict(body.get("status") or {})
                entry.body_meta = {
                    "uid": meta.get("uid"),
                    "generation": meta.get("generation", 0),
                    "deletionTimestamp": meta.get("deletionTimestamp"),
                }
            entry.exists = True
        return key

    def set_record(self, key: Key, record: PlanRecord) -> None:
        with self._lock:
            self._entry(key).record = record

    def snapshot(self, key: Key) -> tuple[PlanRecord | None, Observed, Obj, bool]:
        """(plan record, observed children, last known status, cluster still exists)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None, Observed(), {}, False
            observed = Observed(
                sts=entry.sts,
                router=entry.router,
                pvcs=tuple(sorted(entry.pvcs.values(), key=lambda p: p.name)),
            )
            alive = entry.exists and not entry.body_meta.get("deletionTimestamp")
            return entry.record, observed, dict(entry.status), alive

    def live_keys(self) -> list[Key]:
        with self._lock:
            return [k for k, e in self._entries.items() if e.exists]

    def keys(self) -> list[Key]:
        """The clusters that exist (the cache-status scraper iterates these)."""
        return self.live_keys()

    def __len__(self) -> int:
        with self._lock:
            return sum(1 for e in self._entries.values() if e.exists)

    # ---------------------------------------------------------------------------------- children
    def observe_child(self, kind: str, body: Obj, deleted: bool = False) -> Key | None:
        """Record a StatefulSet, Deployment or PVC; return its owner's key when the view changed."""
        key = owner_key(body)
        if key is None:
            return None
        component = (body["metadata"].get("labels") or {}).get(COMPONENT)
        name = body["metadata"]["name"]
        with self._lock:
            if deleted and key not in self._entries:
                return None
            entry = self._entry(key)
            # Watch events and our own apply responses race: never step back to an older object.
            rv_key, rv = (kind, name), _rv(body)
            if deleted:
                entry.child_rvs.pop(rv_key, None)
            elif rv < entry.child_rvs.get(rv_key, 0):
                return None
            else:
                entry.child_rvs[rv_key] = rv
            if kind == "StatefulSet" and component == "engine":
                new = None if deleted else StsView.of(body)
                changed, entry.sts = entry.sts != new, new
            elif kind == "Deployment" and component == "router":
                new_dep = None if deleted else DeployView.of(body)
                changed, entry.router = entry.router != new_dep, new_dep
            elif kind == "PersistentVolumeClaim":
                old = entry.pvcs.get(name)
                if deleted:
                    entry.pvcs.pop(name, None)
                    changed = old is not None
                else:
                    view = PvcView.of(body)
                    entry.pvcs[name] = view
                    changed = old != view
            else:
                return None
            if not entry.exists and entry.sts is None and entry.router is None and not entry.pvcs:
                # the owner is gone and so are its children: forget it
                self._entries.pop(key, None)
                return None
        return key if changed else None

    def set_status(self, key: Key, status: Obj, resource_version: str | None) -> None:
        """Remember what our own status patch produced (fresher than the watch, until it catches up)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return
            entry.status = dict(status)
            with contextlib.suppress(ValueError):
                entry.resource_version = max(entry.resource_version, int(resource_version or 0))
