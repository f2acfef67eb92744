"""Background helper that `up` starts next to the control plane; it stands in for two things a
real cluster's add-ons do and this one lacks:

1. A static provisioner for the default StorageClass `kvstrata-local`: for each Pending PVC of
   that class it creates a hostPath PV (under the state dir) of the requested size, pre-bound
   through `claimRef`; kube-controller-manager's PV controller then binds the pair. Released PVs
   are deleted with their directory (reclaimPolicy Delete).
2. EndpointSlices for pods on loopback IPs: the API server rejects 127.0.0.0/8 addresses in
   IPv4/IPv6 EndpointSlices (and Endpoints), so the built-in controller can publish none for our
   kwok pods. This loop writes one `addressType: FQDN` slice per selector Service whose addresses
   are the ready pods' IPs, managed-by `localcluster.kvstrata.io`. The API server's webhook and
   aggregator resolver (`--enable-aggregator-routing`) take `addresses[0]` of any slice type, so
   Service-referenced webhooks reach a process bound to the pod's 127.x IP.

The decisions are pure functions (`pv_for_claim`, `slice_for_service`); `run` does the I/O.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

from kvstrata_dev.localcluster.manifests import MANAGED_BY, PROVISIONER, STORAGE_CLASS

log = logging.getLogger("kvstrata_dev.localcluster.harness")

Obj = dict[str, Any]
SLICE_SUFFIX = "-kvstrata-local"


def pv_name(claim: Obj) -> str:
    return f"pvc-{claim['metadata']['uid']}"


def wants_volume(claim: Obj) -> bool:
    spec, status = claim.get("spec", {}), claim.get("status", {})
    return (
        spec.get("storageClassName") == STORAGE_CLASS
        and not spec.get("volumeName")
        and status.get("phase", "Pending") == "Pending"
        and not claim["metadata"].get("deletionTimestamp")
    )


def pv_for_claim(claim: Obj, volumes_dir: Path) -> Obj:
    meta, spec = claim["metadata"], claim["spec"]
    size = spec.get("resources", {}).get("requests", {}).get("storage", "1Gi")
    path = volumes_dir / f"{meta['namespace']}_{meta['name']}_{meta['uid'][:8]}"
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {
            "name": pv_name(claim),
            # tells kube-controller-manager that deletion is ours (an external provisioner)
            "annotations": {"pv.kubernetes.io/provisioned-by": PROVISIONER},
            "labels": {"app.kubernetes.io/managed-by": "kvstrata-localcluster"},
        },
        "spec": {
            "capacity": {"storage": size},
            "accessModes": spec.get("accessModes") or ["ReadWriteOnce"],
            "volumeMode": spec.get("volumeMode") or "Filesystem",
            "persistentVolumeReclaimPolicy": "Delete",
            "storageClassName": STORAGE_CLASS,
            "claimRef": {
                "apiVersion": "v1",
                "kind": "PersistentVolumeClaim",
                "namespace": meta["namespace"],
                "name": meta["name"],
                "uid": meta["uid"],
            },
            "hostPath": {"path": str(path), "type": "DirectoryOrCreate"},
        },
    }


def _selected(pod: Obj, selector: dict[str, str]) -> bool:
    labels = pod["metadata"].get("labels") or {}
    return all(labels.get(k) == v for k, v in selector.items())


def _pod_ready(pod: Obj) -> bool:
    conds = pod.get("status", {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conds)


def _target_port(svc_port: Obj, pods: list[Obj]) -> int | None:
    target = svc_port.get("targetPort", svc_port["port"])
    if isinstance(target, int):
        return target
    if isinstance(target, str) and target.isdigit():
        return int(target)
    for pod in pods:
        for c in pod["spec"].get("containers", []):
            for p in c.get("ports") or []:
                if p.get("name") == target:
                    return int(p["containerPort"])
    return None


def slice_for_service(svc: Obj, pods: list[Obj]) -> Obj | None:
    """The FQDN EndpointSlice for `svc` given all pods of its namespace, or None if not ours to do."""
    selector = svc.get("spec", {}).get("selector")
    if not selector:
        return None
    meta = svc["metadata"]
    members = [
        p
        for p in pods
        if _selected(p, selector)
        and p.get("status", {}).get("podIP")
        and not p["metadata"].get("deletionTimestamp")
        and p.get("status", {}).get("phase") not in {"Succeeded", "Failed"}
    ]
    members.sort(key=lambda p: p["metadata"]["name"])
    ports = []
    for sp in svc["spec"].get("ports") or []:
        port = _target_port(sp, members)
        if port is not None:
            ports.append({"name": sp.get("name", ""), "port": port, "protocol": sp.get("protocol", "TCP")})
    publish_unready = bool(svc["spec"].get("publishNotReadyAddresses"))
    endpoints = []
    for p in members:
        ready = _pod_ready(p)
        ep: Obj = {
            "addresses": [p["status"]["podIP"]],
            "conditions": {"ready": ready or publish_unready, "serving": ready, "terminating": False},
            "targetRef": {
                "kind": "Pod",
                "namespace": p["metadata"]["namespace"],
                "name": p["metadata"]["name"],
                "uid": p["metadata"]["uid"],
            },
        }
        if p["spec"].get("nodeName"):
            ep["nodeName"] = p["spec"]["nodeName"]
        if svc["spec"].get("clusterIP") == "None" and p["spec"].get("hostname"):
            ep["hostname"] = p["spec"]["hostname"]
        endpoints.append(ep)
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": f"{meta['name']}{SLICE_SUFFIX}",
            "namespace": meta["namespace"],
            "labels": {
                "kubernetes.io/service-name": meta["name"],
                "endpointslice.kubernetes.io/managed-by": MANAGED_BY,
            },
            "ownerReferences": [
                {
                    "apiVersion": "v1",
                    "kind": "Service",
                    "name": meta["name"],
                    "uid": meta["uid"],
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        # FQDN is the one address type whose validation accepts a 127.x string
        "addressType": "FQDN",
        "endpoints": endpoints,
        "ports": ports,
    }


def _same_slice(a: Obj, b: Obj) -> bool:
    return all(a.get(k) == b.get(k) for k in ("endpoints", "ports")) and a["metadata"].get("labels") == b[
        "metadata"
    ].get("labels")


class Harness:
    """The I/O half: lists objects every `interval` seconds and converges them."""

    def __init__(self, kubeconfig: Path, volumes_dir: Path) -> None:
        from kubernetes import client, config

        self.api_client = config.new_client_from_config(config_file=str(kubeconfig))
        self.core = client.CoreV1Api(self.api_client)
        self.discovery = client.DiscoveryV1Api(self.api_client)
        self.exc = client.exceptions.ApiException
        self.volumes_dir = volumes_dir

    def _list(self, fn: Any, **kw: Any) -> list[Obj]:
        resp = fn(_preload_content=False, **kw)
        return json.loads(resp.data)["items"]

    def provision(self) -> None:
        claims = self._list(self.core.list_persistent_volume_claim_for_all_namespaces)
        for claim in claims:
            if not wants_volume(claim):
                continue
            pv = pv_for_claim(claim, self.volumes_dir)
            Path(pv["spec"]["hostPath"]["path"]).mkdir(parents=True, exist_ok=True)
            try:
                self.core.create_persistent_volume(pv)
                log.info(
                    "created %s for %s/%s",
                    pv["metadata"]["name"],
                    claim["metadata"]["namespace"],
                    claim["metadata"]["name"],
                )
            except self.exc as e:
                if e.status != 409:
                    raise
        for pv in self._list(self.core.list_persistent_volume):
            ann = pv["metadata"].get("annotations") or {}
            if ann.get("pv.kubernetes.io/provisioned-by") != PROVISIONER:
                continue
            if pv.get("status", {}).get("phase") in {"Released", "Failed"}:
                self._delete_pv(pv)

    def _delete_pv(self, pv: Obj) -> None:
        path = Path(pv["spec"].get("hostPath", {}).get("path", ""))
        try:
            self.core.delete_persistent_volume(pv["metadata"]["name"])
        except self.exc as e:
            if e.status != 404:
                raise
        if path.is_relative_to(self.volumes_dir):
            shutil.rmtree(path, ignore_errors=True)
        log.info("deleted released %s", pv["metadata"]["name"])

    def mirror_endpoints(self) -> None:
        services = self._list(self.core.list_service_for_all_namespaces)
        pods = self._list(self.core.list_pod_for_all_namespaces)
        pods_by_ns: dict[str, list[Obj]] = {}
        for p in pods:
            pods_by_ns.setdefault(p["metadata"]["namespace"], []).append(p)
        existing = {
            (s["metadata"]["namespace"], s["metadata"]["name"]): s
            for s in self._list(
                self.discovery.list_endpoint_slice_for_all_namespaces,
                label_selector=f"endpointslice.kubernetes.io/managed-by={MANAGED_BY}",
            )
        }
        for svc in services:
            want = slice_for_service(svc, pods_by_ns.get(svc["metadata"]["namespace"], []))
            if want is None:
                continue
            key = (want["metadata"]["namespace"], want["metadata"]["name"])
            have = existing.get(key)
            try:
                if have is None:
                    self.discovery.create_namespaced_endpoint_slice(key[0], want)
                elif not _same_slice(have, want):
                    want["metadata"]["resourceVersion"] = have["metadata"]["resourceVersion"]
                    self.discovery.replace_namespaced_endpoint_slice(key[1], key[0], want)
            except self.exc as e:
                # 404/409: namespace going away or a race with ourselves; the next pass converges
                if e.status not in (404, 409, 403):
                    raise

    def run(self, interval: float, stop: list[bool]) -> None:
        while not stop:
            started = time.monotonic()
            for step in (self.provision, self.mirror_endpoints):
                try:
                    step()
                except self.exc as e:  # keep serving: the apiserver may restart or be slow
                    log.warning(
                        "%s failed: %s %s: %s", step.__name__, e.status, e.reason, (e.body or "")[:300]
                    )
                except Exception as e:
                    log.warning("%s failed: %r", step.__name__, e)
            time.sleep(max(0.0, interval - (time.monotonic() - started)))


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m kvstrata_dev.localcluster.harness")
    p.add_argument("--kubeconfig", type=Path, required=True)
    p.add_argument("--volumes-dir", type=Path, required=True)
    p.add_argument("--interval", type=float, default=1.0)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    stop: list[bool] = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    args.volumes_dir.mkdir(parents=True, exist_ok=True)
    Harness(args.kubeconfig, args.volumes_dir.resolve()).run(args.interval, stop)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
