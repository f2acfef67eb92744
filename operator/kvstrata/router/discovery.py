"""Where engines come from: a static list, or the engine Service's EndpointSlices.

The Kubernetes watch is plain aiohttp against the API server (list, then ``watch=1`` from the list's
resourceVersion, relist on 410 Gone or a dropped stream) rather than the ``kubernetes`` client's
blocking watch: it lives on the router's event loop with no thread hand-off, shares its connection
machinery, and a removed pod leaves the pool in the same loop iteration that sees the event. The
``kubernetes`` package is used only to read credentials (in-cluster service account or kubeconfig).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import ssl
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiohttp

from kvstrata.api.router_config import SERVICE_NAME_LABEL, Discovery, StaticEndpoint
from kvstrata.router.pool import EndpointSpec

log = logging.getLogger("kvstrata.router.discovery")

SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
SERVICE_LABEL = SERVICE_NAME_LABEL


class DiscoveryError(RuntimeError):
    pass


def static_specs(static: Iterable[StaticEndpoint]) -> list[EndpointSpec]:
    return [
        EndpointSpec(s.url.rstrip("/"), s.kv_events, s.kv_replay, s.fs_janitor and s.fs_janitor.rstrip("/"))
        for s in static
    ]


def _host(ip: str, address_type: str) -> str:
    return f"[{ip}]" if address_type == "IPv6" or ":" in ip else ip


def slice_endpoints(eps_slice: Mapping[str, Any], disc: Discovery) -> list[EndpointSpec]:
    """The engines of one EndpointSlice: ready, non-terminating endpoints, one spec per address.

    ``conditions.ready`` unset means "unknown", which Kubernetes asks consumers to treat as ready."""
    address_type = str(eps_slice.get("addressType", "IPv4"))
    if address_type == "FQDN":
        return []
    out = []
    for ep in eps_slice.get("endpoints") or []:
        cond = ep.get("conditions") or {}
        if cond.get("ready") is False or cond.get("terminating") is True:
            continue
        for ip in ep.get("addresses") or []:
            host = _host(ip, address_type)
            out.append(
                EndpointSpec(
                    url=f"http://{host}:{disc.engine_port}",
                    kv_events=f"tcp://{host}:{disc.kv_events_port}" if disc.kv_events_port else None,
                    kv_replay=f"tcp://{host}:{disc.kv_replay_port}" if disc.kv_replay_port else None,
                    fs_janitor=f"http://{host}:{disc.fs_janitor_port}" if disc.fs_janitor_port else None,
                )
            )
    return out


def union_specs(slices: Mapping[str, Mapping[str, Any]], disc: Discovery) -> list[EndpointSpec]:
    seen: dict[str, EndpointSpec] = {}
    for name in sorted(slices):
        for spec in slice_endpoints(slices[name], disc):
            seen.setdefault(spec.url, spec)
    return list(seen.values())


@dataclass(frozen=True)
class ApiAccess:
    server: str
    token: str | None = None
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    verify: bool = True

    def ssl_context(self) -> ssl.SSLContext | bool:
        if not self.server.startswith("https"):
            return False
        if not self.verify:
            return False
        ctx = ssl.create_default_context(cafile=self.ca_file)
        if self.cert_file and self.key_file:
            ctx.load_cert_chain(self.cert_file, self.key_file)
        return ctx


def in_cluster_namespace() -> str | None:
    with contextlib.suppress(OSError):
        return (SA_DIR / "namespace").read_text().strip()
    return None


def load_api_access(kubeconfig: str | None = None) -> ApiAccess:
    """In-cluster service account when present, else the kubeconfig's current context
    (``kubeconfig`` or ``$KUBECONFIG`` or ``~/.kube/config``)."""
    import os

    host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT")
    if kubeconfig is None and host and port and (SA_DIR / "token").exists():
        return ApiAccess(
            server=f"https://{_host(host, '')}:{port}",
            token=(SA_DIR / "token").read_text().strip(),
            ca_file=str(SA_DIR / "ca.crt"),
        )
    from kubernetes import client, config  # only for reading kubeconfig

    cfg = client.Configuration()
    try:
        config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)  # type: ignore[no-untyped-call]
    except (config.ConfigException, OSError, TypeError) as exc:
        raise DiscoveryError(
            f"EndpointSlice discovery needs in-cluster credentials or a kubeconfig: {exc}"
        ) from None
    token = None
    auth = cfg.api_key.get("authorization") if cfg.api_key else None
    if auth:
        token = auth.removeprefix("Bearer ").strip()
    return ApiAccess(
        server=cfg.host,
        token=token,
        ca_file=cfg.ssl_ca_cert,
        cert_file=cfg.cert_file,
        key_file=cfg.key_file,
        verify=bool(cfg.verify_ssl),
    )


class EndpointSliceWatcher:
    """Keeps ``on_change(specs)`` up to date with the engine Service's ready endpoints."""

    def __init__(
        self,
        disc: Discovery,
        namespace: str,
        access: ApiAccess,
        on_change: Callable[[list[EndpointSpec]], None],
    ) -> None:
        if not disc.service:
            raise ValueError("discovery.service is required for EndpointSlice discovery")
        self.disc = disc
        self.namespace = namespace
        self.access = access
        self.on_change = on_change
        self.slices: dict[str, dict[str, Any]] = {}
        self.synced = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        selector = quote(f"{SERVICE_LABEL}={disc.service}", safe="")
        self._url = (
            f"{access.server.rstrip('/')}/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices"
            f"?labelSelector={selector}"
        )

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="endpointslice-watch")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def _publish(self) -> None:
        self.on_change(union_specs(self.slices, self.disc))

    def apply_event(self, kind: str, obj: Mapping[str, Any]) -> None:
        name = str((obj.get("metadata") or {}).get("name", ""))
        if kind == "DELETED":
            self.slices.pop(name, None)
        elif kind in ("ADDED", "MODIFIED"):
            self.slices[name] = dict(obj)
        else:
            return
        self._publish()

    async def _run(self) -> None:
        headers = {"Accept": "application/json"}
        if self.access.token:
            headers["Authorization"] = f"Bearer {self.access.token}"
        connector = aiohttp.TCPConnector(ssl=self.access.ssl_context())
        backoff = 0.5
        async with aiohttp.ClientSession(connector=connector, headers=headers) as http:
            while True:
                try:
                    rv = await self._list(http)
                    await self._watch(http, rv)
                    backoff = 0.5
                except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                    log.warning("EndpointSlice watch: %s; retrying in %.1fs", exc, backoff)
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, 10.0)

    async def _list(self, http: aiohttp.ClientSession) -> str:
        async with http.get(self._url, timeout=aiohttp.ClientTimeout(total=30)) as resp:
            if resp.status != 200:
                raise aiohttp.ClientResponseError(
                    resp.request_info, (), status=resp.status, message=(await resp.text())[:200]
                )
            data = await resp.json()
        self.slices = {str(s["metadata"]["name"]): s for s in data.get("items") or []}
        self._publish()
        self.synced.set()
        return str(data.get("metadata", {}).get("resourceVersion", ""))

    async def _watch(self, http: aiohttp.ClientSession, rv: str) -> None:
        url = f"{self._url}&watch=1&allowWatchBookmarks=true&resourceVersion={rv}&timeoutSeconds=300"
        async with http.get(url, timeout=aiohttp.ClientTimeout(total=None, sock_read=330)) as resp:
            if resp.status != 200:
                raise aiohttp.ClientResponseError(resp.request_info, (), status=resp.status)
            async for line in resp.content:
                if not line.strip():
                    continue
                event = json.loads(line)
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    # 410 Gone (resourceVersion too old) and friends: relist.
                    log.info("EndpointSlice watch error %s; relisting", obj.get("message"))
                    return
                if kind == "BOOKMARK":
                    continue
                self.apply_event(str(kind), obj)
