"""The router's EndpointSlice watch against a real kube-apiserver (the local cluster).

Slices are created directly (with their own managed-by label, so the EndpointSlice controller leaves
them alone; the API server refuses loopback addresses in slices, hence 10.88.0.x: no traffic goes
there), and the watcher must follow every change: ready endpoints in, not-ready and deleted out."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kvstrata.api.router_config import Discovery
from kvstrata.router.discovery import EndpointSliceWatcher, load_api_access
from kvstrata.router.pool import EndpointPool
from kvstrata_dev.localcluster.session import LocalCluster

pytestmark = pytest.mark.cluster

SERVICE = "demo-engine"


def eps_slice(name: str, ready: dict[str, bool]) -> dict[str, Any]:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": name,
            "labels": {
                "kubernetes.io/service-name": SERVICE,
                "endpointslice.kubernetes.io/managed-by": "kvstrata-tests",
            },
        },
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 8000, "protocol": "TCP"}],
        "endpoints": [{"addresses": [ip], "conditions": {"ready": r}} for ip, r in ready.items()],
    }


async def until(what: str, cond: Any, timeout: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.1)


async def test_watch_follows_endpointslices(local_cluster: LocalCluster, namespace: str) -> None:
    pool = EndpointPool()
    removed: list[str] = []
    pool.subscribe(lambda ep: None, lambda ep: removed.append(ep.url))
    local_cluster.apply(
        eps_slice("demo-engine-a", {"10.88.0.1": True, "10.88.0.2": False}), namespace=namespace
    )
    disc = Discovery(service=SERVICE, namespace=namespace)
    access = load_api_access(str(local_cluster.kubeconfig))
    watcher = EndpointSliceWatcher(disc, namespace, access, pool.replace)
    watcher.start()
    try:
        await asyncio.wait_for(watcher.synced.wait(), 20)
        assert [e.url for e in pool.all()] == ["http://10.88.0.1:8000"]
        assert pool.all()[0].spec.kv_events == "tcp://10.88.0.1:5557"
        # A second slice and a readiness change arrive through the watch.
        local_cluster.apply(eps_slice("demo-engine-b", {"10.88.0.3": True}), namespace=namespace)
        local_cluster.apply(
            eps_slice("demo-engine-a", {"10.88.0.1": True, "10.88.0.2": True}), namespace=namespace
        )
        await until("three ready endpoints", lambda: len(pool) == 3)
        # A pod going not-ready leaves the pool at once.
        local_cluster.apply(
            eps_slice("demo-engine-a", {"10.88.0.1": False, "10.88.0.2": True}), namespace=namespace
        )
        await until("10.88.0.1 removed", lambda: "http://10.88.0.1:8000" not in pool)
        local_cluster.kubectl("delete", "endpointslice", "demo-engine-b", "-n", namespace)
        await until("slice b removed", lambda: [e.url for e in pool.all()] == ["http://10.88.0.2:8000"])
        assert sorted(removed) == ["http://10.88.0.1:8000", "http://10.88.0.3:8000"]
    finally:
        await watcher.stop()
