"""A small synchronous Kubernetes REST client: get, list, server-side apply, merge patch, delete.

It borrows authentication and TLS from the official client (kubeconfig or in-cluster service account) and
speaks plain JSON dicts, because the operator's objects are dicts from `kvstrata.render` and the generated
model classes would only add a conversion step. Calls block; kopf runs sync handlers in worker threads.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast
from urllib.parse import quote

Obj = dict[str, Any]

# (apiVersion, kind) -> (API prefix, plural, namespaced). Only what the operator touches.
RESOURCES: dict[tuple[str, str], tuple[str, str, bool]] = {
    ("v1", "ConfigMap"): ("/api/v1", "configmaps", True),
    ("v1", "Service"): ("/api/v1", "services", True),
    ("v1", "ServiceAccount"): ("/api/v1", "serviceaccounts", True),
    ("v1", "PersistentVolumeClaim"): ("/api/v1", "persistentvolumeclaims", True),
    ("v1", "Pod"): ("/api/v1", "pods", True),
    ("v1", "Event"): ("/api/v1", "events", True),
    ("apps/v1", "StatefulSet"): ("/apis/apps/v1", "statefulsets", True),
    ("apps/v1", "Deployment"): ("/apis/apps/v1", "deployments", True),
    ("policy/v1", "PodDisruptionBudget"): ("/apis/policy/v1", "poddisruptionbudgets", True),
    ("rbac.authorization.k8s.io/v1", "Role"): ("/apis/rbac.authorization.k8s.io/v1", "roles", True),
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): (
        "/apis/rbac.authorization.k8s.io/v1",
        "rolebindings",
        True,
    ),
    ("storage.k8s.io/v1", "StorageClass"): ("/apis/storage.k8s.io/v1", "storageclasses", False),
    ("kvstrata.io/v1alpha1", "InferenceCluster"): ("/apis/kvstrata.io/v1alpha1", "inferenceclusters", True),
    ("monitoring.coreos.com/v1", "ServiceMonitor"): (
        "/apis/monitoring.coreos.com/v1",
        "servicemonitors",
        True,
    ),
    ("monitoring.coreos.com/v1", "PodMonitor"): ("/apis/monitoring.coreos.com/v1", "podmonitors", True),
}

APPLY = "application/apply-patch+yaml"
MERGE = "application/merge-patch+json"
# (connect, read) seconds: a hung apiserver must not pin a worker thread for long.
TIMEOUT = (5.0, 30.0)


# k8s.io/apimachinery/pkg/api/validation.FieldImmutableErrorMsg: a constant of the API, not free text.
FIELD_IMMUTABLE = "field is immutable"


@dataclass(frozen=True)
class Cause:
    """One entry of a Status's ``details.causes``: ``reason`` is a CauseType such as
    ``FieldValueForbidden`` or ``FieldValueInvalid``, ``field`` the JSON path it is about."""

    reason: str
    field: str = ""
    message: str = ""


def status_causes(status_obj: object) -> tuple[Cause, ...]:
    details = status_obj.get("details") if isinstance(status_obj, dict) else None
    causes = details.get("causes") if isinstance(details, dict) else None
    if not isinstance(causes, list):
        return ()
    return tuple(
        Cause(str(c.get("reason", "")), str(c.get("field", "")), str(c.get("message", "")))
        for c in causes
        if isinstance(c, dict)
    )


class KubeError(Exception):
    """An API call failed. `status` is the HTTP status, 0 when the apiserver could not be reached;
    `causes` are the Status's typed causes (empty when it gave none)."""

    def __init__(
        self,
        status: int,
        reason: str,
        message: str,
        verb: str = "",
        path: str = "",
        causes: tuple[Cause, ...] = (),
    ) -> None:
        super().__init__(f"{verb} {path}: {status} {reason}: {message}".strip())
        self.status = status
        self.reason = reason
        self.message = message
        self.causes = causes

    @property
    def immutable_field_change(self) -> bool:
        """422 because a field may not be changed once set. kube-apiserver 1.37 answers a StatefulSet
        change of serviceName, selector, podManagementPolicy or volumeClaimTemplates with a
        ``FieldValueInvalid`` cause on that field whose message is apimachinery's
        ``FieldImmutableErrorMsg`` (tests/integration/test_kube_errors.py); older servers answered one
        ``FieldValueForbidden`` cause on ``spec`` ("updates to statefulset spec for fields other than
        ... are forbidden"), which the previous text match looked for and 1.37 never sends."""
        return self.status == 422 and any(
            c.reason == "FieldValueForbidden"
            or (c.reason == "FieldValueInvalid" and c.message.endswith(FIELD_IMMUTABLE))
            for c in self.causes
        )

    @property
    def retryable(self) -> bool:
        """Worth trying again unchanged: unreachable, throttled, conflicting, server-side trouble.

        403 counts too: RBAC may be fixed by an upgrade, and a namespace being deleted answers 403.
        """
        return self.status in (0, 403, 404, 409, 429) or self.status >= 500

    @property
    def not_found(self) -> bool:
        return self.status == 404


@dataclass(frozen=True)
class Ref:
    api_version: str
    kind: str
    namespace: str | None
    name: str


def path_for(api_version: str, kind: str, namespace: str | None, name: str | None = None) -> str:
    try:
        prefix, plural, namespaced = RESOURCES[(api_version, kind)]
    except KeyError:
        raise ValueError(f"the operator does not handle {kind} ({api_version})") from None
    path = prefix
    if namespaced and namespace:
        path += f"/namespaces/{quote(namespace, safe='')}"
    path += f"/{plural}"
    if name:
        path += f"/{quote(name, safe='')}"
    return path


def ref_of(obj: Obj) -> Ref:
    meta = obj["metadata"]
    return Ref(obj["apiVersion"], obj["kind"], meta.get("namespace"), meta["name"])


class Kube:
    """Thread-safe (the underlying urllib3 pool is); one instance per operator process."""

    def __init__(self, api_client: Any) -> None:
        self.api = api_client

    @classmethod
    def from_environment(cls, kubeconfig: str | None = None, pool_size: int = 32) -> Kube:
        from kubernetes import client, config

        cfg = client.Configuration()
        path = kubeconfig or os.environ.get("KUBECONFIG")
        # The kubernetes client is untyped: its two loaders, named with the signature we use.
        load_file = cast(Callable[..., None], config.load_kube_config)
        load_incluster = cast(Callable[..., None], config.load_incluster_config)
        if path or not os.environ.get("KUBERNETES_SERVICE_HOST"):
            load_file(config_file=path, client_configuration=cfg)
        else:
            load_incluster(client_configuration=cfg)
        cfg.connection_pool_maxsize = pool_size
        return cls(client.ApiClient(cfg))

    def credentials(self) -> dict[str, Any]:
        """Server, CA and token or client certificate, for kopf's own connection (re-read each login)."""
        cfg = self.api.configuration
        if cfg.refresh_api_key_hook is not None:
            cfg.refresh_api_key_hook(cfg)  # in-cluster: re-reads the projected, rotating token
        header = cfg.get_api_key_with_prefix("BearerToken") or cfg.get_api_key_with_prefix("authorization")
        scheme, _, token = (header or "").partition(" ")
        if header and not token:
            scheme, token = "Bearer", header
        return {
            "server": cfg.host,
            "ca_path": cfg.ssl_ca_cert,
            "insecure": not cfg.verify_ssl,
            "scheme": scheme or None,
            "token": token or None,
            "certificate_path": cfg.cert_file,
            "private_key_path": cfg.key_file,
        }

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        query: list[tuple[str, str]] | None = None,
        content_type: str | None = None,
    ) -> Obj:
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = content_type or "application/json"
        try:
            params = self.api.param_serialize(
                method=method,
                resource_path=path,
                query_params=query or [],
                header_params=headers,
                body=body,
                auth_settings=["BearerToken"],
            )
            resp = self.api.call_api(*params, _request_timeout=TIMEOUT)
            resp.read()
        except Exception as err:  # urllib3/SSL/socket errors: the apiserver is unreachable
            status = getattr(err, "status", None)
            if isinstance(status, int) and status:
                raise KubeError(status, getattr(err, "reason", "") or "", str(err), method, path) from None
            raise KubeError(0, type(err).__name__, str(err), method, path) from None
        data = resp.data or b"{}"
        if not 200 <= resp.status < 300:
            message = data.decode(errors="replace")
            reason = resp.reason or ""
            causes: tuple[Cause, ...] = ()
            try:
                status_obj = json.loads(data)
                message = status_obj.get("message", message)
                reason = status_obj.get("reason", reason)
                causes = status_causes(status_obj)
            except ValueError:
                pass
            raise KubeError(resp.status, reason, message, method, path, causes)
        return json.loads(data) if data else {}

    # ------------------------------------------------------------------------------------- verbs
    def get(self, api_version: str, kind: str, namespace: str | None, name: str) -> Obj | None:
        try:
            return self.request("GET", path_for(api_version, kind, namespace, name))
        except KubeError as err:
            if err.not_found:
                return None
            raise

    def list(
        self, api_version: str, kind: str, namespace: str | None, label_selector: str | None = None
    ) -> list[Obj]:
        query = [("labelSelector", label_selector)] if label_selector else []
        items: list[Obj] = self.request("GET", path_for(api_version, kind, namespace), query=query).get(
            "items", []
        )
        return items

    def serves(self, api_version: str, kind: str) -> bool:
        """Whether the API server serves ``kind`` (discovery; e.g. an optional CRD is installed)."""
        prefix, plural, _ = RESOURCES[(api_version, kind)]
        try:
            listing = self.request("GET", prefix)
        except KubeError as err:
            if err.not_found:
                return False
            raise
        return any(r.get("name") == plural for r in listing.get("resources", []))

    def apply(self, obj: Obj, manager: str, force: bool = True) -> Obj:
        """Server-side apply: the object is the complete set of fields `manager` owns."""
        r = ref_of(obj)
        query = [("fieldManager", manager)]
        if force:
            query.append(("force", "true"))
        return self.request(
            "PATCH",
            path_for(r.api_version, r.kind, r.namespace, r.name),
            body=obj,
            query=query,
            content_type=APPLY,
        )

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
        path = path_for(api_version, kind, namespace, name)
        if subresource:
            path += f"/{subresource}"
        query = [("fieldManager", manager)] if manager else []
        return self.request("PATCH", path, body=patch, query=query, content_type=MERGE)

    def delete(
        self, api_version: str, kind: str, namespace: str | None, name: str, propagation: str | None = None
    ) -> bool:
        body = {"kind": "DeleteOptions", "apiVersion": "v1"}
        if propagation:
            body["propagationPolicy"] = propagation
        try:
            self.request("DELETE", path_for(api_version, kind, namespace, name), body=body)
        except KubeError as err:
            if err.not_found:
                return False
            raise
        return True
