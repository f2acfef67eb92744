"""An in-memory stand-in for `kvstrata.controller.kube.Kube`, recording every call."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from kvstrata.controller.kube import KubeError

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
Obj = dict[str, Any]


def example(name: str, namespace: str = "ns", uid: str = "uid-1", generation: int = 1) -> Obj:
    doc = yaml.safe_load((EXAMPLES / name).read_text())
    doc["metadata"] |= {"namespace": namespace, "uid": uid, "generation": generation, "resourceVersion": "1"}
    return doc


class FakeKube:
    def __init__(self) -> None:
        self.objects: dict[tuple[str, str | None, str], Obj] = {}
        self.calls: list[tuple[str, str, str]] = []
        self.fail: dict[tuple[str, str], KubeError] = {}  # (verb, kind) -> error to raise once
        self.rv = 100
        self.storage_classes: list[Obj] = []

    def _maybe_fail(self, verb: str, kind: str) -> None:
        err = self.fail.pop((verb, kind), None)
        if err is not None:
            raise err

    def _bump(self, obj: Obj) -> None:
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)

    def get(self, api_version: str, kind: str, namespace: str | None, name: str) -> Obj | None:
        self.calls.append(("get", kind, name))
        self._maybe_fail("get", kind)
        obj = self.objects.get((kind, namespace, name))
        return copy.deepcopy(obj) if obj else None

    def list(
        self, api_version: str, kind: str, namespace: str | None, label_selector: str | None = None
    ) -> list[Obj]:
        self.calls.append(("list", kind, namespace or ""))
        self._maybe_fail("list", kind)
        if kind == "StorageClass":
            return copy.deepcopy(self.storage_classes)
        return [copy.deepcopy(o) for (k, ns, _), o in self.objects.items() if k == kind and ns == namespace]

    def apply(self, obj: Obj, manager: str, force: bool = True) -> Obj:
        meta = obj["metadata"]
        self.calls.append(("apply", obj["kind"], meta["name"]))
        self._maybe_fail("apply", obj["kind"])
        key = (obj["kind"], meta.get("namespace"), meta["name"])
        live = copy.deepcopy(obj)
        old = self.objects.get(key)
        live["metadata"]["generation"] = (old["metadata"]["generation"] + 1) if old else 1
        live["status"] = copy.deepcopy(old.get("status", {})) if old else {}
        self._bump(live)
        self.objects[key] = live
        return copy.deepcopy(live)

    def merge_patch(
        self,
        api_version: str,
        kind: str,
        namespace: str | None,
        name: str,
        patch: Obj,
        subresource: str | None = None,
        manager: str | None = None,
    ) -> Obj:
        self.calls.append(("patch" + (f"/{subresource}" if subresource else ""), kind, name))
        self._maybe_fail("patch", kind)
        key = (kind, namespace, name)
        obj = self.objects.setdefault(
            key, {"apiVersion": api_version, "kind": kind, "metadata": {"name": name}}
        )
        _merge(obj, copy.deepcopy(patch))
        self._bump(obj)
        return copy.deepcopy(obj)

    def delete(
        self, api_version: str, kind: str, namespace: str | None, name: str, propagation: str | None = None
    ) -> bool:
        self.calls.append(("delete:" + (propagation or ""), kind, name))
        self._maybe_fail("delete", kind)
        return self.objects.pop((kind, namespace, name), None) is not None


def _merge(target: Obj, patch: Obj) -> None:
    for k, v in patch.items():
        if v is None:
            target.pop(k, None)
        elif isinstance(v, dict) and isinstance(target.get(k), dict):
            _merge(target[k], v)
        else:
            target[k] = v
