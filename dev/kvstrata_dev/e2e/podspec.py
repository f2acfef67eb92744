"""A kwok pod's container → the local process that stands in for it (pure: dicts in, a plan out).

kwok gives pods a node, an IP (127.10.x.y) and a Running phase but runs nothing. The launcher runs
each container's own command line on this machine, with exactly three substitutions, all listed in
`LaunchSpec.substitutions` so a log shows what changed:

1. the image: `python3` of the vLLM image is the vLLM venv's python; `kvstrata` of the router image is
   this venv's `kvstrata` (the same software, installed locally instead of in an image);
2. volumes: a path under a volume's mountPath becomes the local directory that holds that volume's
   contents (a PVC's bound hostPath PV, a materialised ConfigMap, a per-pod emptyDir);
3. the HTTP bind address: `--host ADDR` becomes `--host POD_IP` (added when absent: a wildcard bind
   would collide with the other pods, which all share this kernel and these ports).

ZMQ endpoints (`tcp://*:5557`) are left as rendered: vLLM binds only wildcard endpoints (it *connects*
to a concrete address), so the launcher instead puts `podnet/` on PYTHONPATH, whose sitecustomize
turns a wildcard ZMQ bind into a bind on the pod IP — what the pod's own network namespace would do.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

Obj = dict[str, Any]

# mountPaths the host already provides: /dev/shm is shared memory either way.
HOST_PROVIDED_MOUNTS = frozenset({"/dev/shm"})


class PodSpecError(ValueError):
    """The pod cannot be run locally; the message says which field and why."""


@dataclass(frozen=True)
class Probe:
    path: str
    port: int
    period_seconds: float = 10.0
    timeout_seconds: float = 1.0
    failure_threshold: int = 3
    success_threshold: int = 1


@dataclass(frozen=True)
class LaunchSpec:
    pod: str
    namespace: str
    uid: str
    container: str
    pod_ip: str
    argv: list[str]
    env: dict[str, str]
    readiness: Probe | None
    ports: dict[str, int]
    substitutions: list[str] = field(default_factory=list)
    mounts: dict[str, Path] = field(default_factory=dict)


def container_named(pod: Obj, name: str | None = None) -> Obj:
    """The pod's first container, or the container or init container called `name`."""
    containers = pod.get("spec", {}).get("containers") or []
    if not containers:
        raise PodSpecError(f"pod {pod['metadata']['name']} has no containers")
    if name is None:
        return containers[0]
    for c in [*containers, *(pod.get("spec", {}).get("initContainers") or [])]:
        if c.get("name") == name:
            return c
    raise PodSpecError(f"pod {pod['metadata']['name']} has no container {name!r}")


def native_sidecars(pod: Obj) -> list[str]:
    """Names of the pod's native sidecars: init containers with `restartPolicy: Always`, which a kubelet
    starts before the main containers and keeps running (restarting them) for the pod's lifetime. A
    plain init container (run to completion) is an error here: the launcher does not run those, and
    silently skipping one would run a pod the operator did not render."""
    out = []
    for c in pod.get("spec", {}).get("initContainers") or []:
        if c.get("restartPolicy") != "Always":
            raise PodSpecError(
                f"pod {pod['metadata']['name']}: init container {c.get('name')!r} runs to completion; "
                "the local launcher runs only native sidecars (restartPolicy Always)"
            )
        out.append(str(c["name"]))
    return out


def _port(container: Obj, port: Any) -> int:
    if isinstance(port, int) or (isinstance(port, str) and port.isdigit()):
        return int(port)
    for p in container.get("ports") or []:
        if p.get("name") == port:
            return int(p["containerPort"])
    raise PodSpecError(f"container {container.get('name')}: no port named {port!r}")


def readiness_probe(container: Obj) -> Probe | None:
    probe = container.get("readinessProbe")
    if not probe:
        return None
    http = probe.get("httpGet")
    if not http:
        raise PodSpecError(f"container {container.get('name')}: only httpGet readiness probes are supported")
    return Probe(
        path=http.get("path", "/"),
        port=_port(container, http["port"]),
        period_seconds=float(probe.get("periodSeconds", 10)),
        timeout_seconds=float(probe.get("timeoutSeconds", 1)),
        failure_threshold=int(probe.get("failureThreshold", 3)),
        success_threshold=int(probe.get("successThreshold", 1)),
    )


def _field_ref(pod: Obj, path: str) -> str:
    meta, spec, status = pod["metadata"], pod.get("spec", {}), pod.get("status", {})
    values = {
        "metadata.name": meta.get("name"),
        "metadata.namespace": meta.get("namespace"),
        "metadata.uid": meta.get("uid"),
        "spec.nodeName": spec.get("nodeName"),
        "spec.serviceAccountName": spec.get("serviceAccountName"),
        "status.podIP": status.get("podIP"),
        "status.hostIP": status.get("hostIP"),
    }
    if path not in values:
        raise PodSpecError(f"env fieldRef {path!r} is not supported by the local launcher")
    return str(values[path] or "")


def _rewrite_path(value: str, mounts: Mapping[str, Path]) -> str:
    # Longest mountPath first so /models/x beats /models.
    for mount in sorted(mounts, key=len, reverse=True):
        if value == mount or value.startswith(mount.rstrip("/") + "/"):
            return str(mounts[mount]) + value[len(mount.rstrip("/")) :]
    return value


def _rewrite_json(value: Any, mounts: Mapping[str, Path]) -> Any:
    if isinstance(value, str):
        return _rewrite_path(value, mounts)
    if isinstance(value, list):
        return [_rewrite_json(v, mounts) for v in value]
    if isinstance(value, dict):
        return {k: _rewrite_json(v, mounts) for k, v in value.items()}
    return value


def rewrite_token(token: str, mounts: Mapping[str, Path]) -> str:
    """A path token, or a path inside a JSON-object token (e.g. --kv-transfer-config root_dir)."""
    if token.startswith("{"):
        try:
            parsed = json.loads(token)
        except ValueError:
            return token
        rewritten = _rewrite_json(parsed, mounts)
        return token if rewritten == parsed else json.dumps(rewritten, separators=(",", ":"))
    return _rewrite_path(token, mounts)


def local_mounts(container: Obj, volume_dirs: Mapping[str, Path]) -> dict[str, Path]:
    """mountPath → local directory, for the container's mounts whose volume has one.

    `volume_dirs` maps a volume name to the local directory holding its contents."""
    out: dict[str, Path] = {}
    for m in container.get("volumeMounts") or []:
        path = m["mountPath"]
        if path in HOST_PROVIDED_MOUNTS or m["name"] not in volume_dirs:
            continue
        local = volume_dirs[m["name"]]
        out[path] = local / m["subPath"] if m.get("subPath") else local
    return out


def set_flag(argv: list[str], flag: str, value: str) -> tuple[list[str], str | None]:
    """argv with `flag value` set (replacing `flag X` or `flag=X`), and the old value."""
    out, old, i = [], None, 0
    while i < len(argv):
        arg = argv[i]
        if arg == flag and i + 1 < len(argv):
            old = argv[i + 1]
            i += 2
            continue
        if arg.startswith(flag + "="):
            old = arg.split("=", 1)[1]
            i += 1
            continue
        out.append(arg)
        i += 1
    return [*out, flag, value], old


def launch_spec(
    pod: Obj,
    *,
    container_name: str | None = None,
    programs: Mapping[str, str],
    volume_dirs: Mapping[str, Path],
    bind_flag: str = "--host",
) -> LaunchSpec:
    """The command, environment and readiness probe that run `pod`'s container here.

    `programs` maps an image's program (`python3`, `kvstrata`) to the local executable that provides
    it; an unmapped program is an error (nothing from an image may run by accident)."""
    meta = pod["metadata"]
    pod_ip = pod.get("status", {}).get("podIP")
    if not pod_ip:
        raise PodSpecError(f"pod {meta['name']} has no IP yet")
    c = container_named(pod, container_name)
    command = list(c.get("command") or [])
    args = list(c.get("args") or [])
    if not command:
        raise PodSpecError(
            f"container {c.get('name')}: no command (the image's entrypoint is unknown locally)"
        )
    subs: list[str] = []
    program = command[0]
    if program not in programs:
        raise PodSpecError(
            f"container {c.get('name')}: program {program!r} has no local stand-in (known: {', '.join(programs)})"
        )
    command[0] = programs[program]
    subs.append(f"image program {program} -> {command[0]}")

    mounts = local_mounts(c, volume_dirs)
    argv = []
    for token in [*command, *args]:
        new = rewrite_token(token, mounts)
        if new != token:
            subs.append(f"volume path {token} -> {new}")
        argv.append(new)
    argv, old = set_flag(argv, bind_flag, pod_ip)
    subs.append(f"bind {bind_flag} {old or '(default wildcard)'} -> {pod_ip}")

    env: dict[str, str] = {}
    for e in c.get("env") or []:
        if "valueFrom" in e:
            ref = e["valueFrom"].get("fieldRef")
            if not ref:
                raise PodSpecError(f"env {e['name']}: only fieldRef valueFrom is supported locally")
            env[e["name"]] = _field_ref(pod, ref["fieldPath"])
        else:
            env[e["name"]] = rewrite_token(str(e.get("value", "")), mounts)
    ports = {p.get("name") or str(p["containerPort"]): int(p["containerPort"]) for p in c.get("ports") or []}
    return LaunchSpec(
        pod=meta["name"],
        namespace=meta.get("namespace", "default"),
        uid=meta.get("uid", ""),
        container=c["name"],
        pod_ip=pod_ip,
        argv=argv,
        env=env,
        readiness=readiness_probe(c),
        ports=ports,
        substitutions=subs,
        mounts=mounts,
    )


def rewrite_paths(doc: Any, mounts: Mapping[str, Path]) -> Any:
    """Paths under a mount inside a config file the container reads (e.g. router.json's tokenizer)."""
    return _rewrite_json(doc, mounts)


def static_discovery(router_json: Mapping[str, Any], engine_ips: list[str]) -> dict[str, Any]:
    """router.json with its EndpointSlice discovery replaced by the engine pods' addresses.

    Locally the API server can only hold FQDN EndpointSlices for 127.x pod IPs, which the router
    rightly ignores; the launcher therefore derives the same endpoints from the pods themselves."""
    cfg = json.loads(json.dumps(router_json))
    disc = dict(cfg.get("discovery") or {})
    port = int(disc.get("enginePort", 8000))
    events = disc.get("kvEventsPort")
    replay = disc.get("kvReplayPort")
    janitor = disc.get("fsJanitorPort")
    disc.pop("service", None)
    disc["static"] = [
        {
            "url": f"http://{ip}:{port}",
            "kvEvents": f"tcp://{ip}:{events}" if events else None,
            "kvReplay": f"tcp://{ip}:{replay}" if replay and events else None,
            "fsJanitor": f"http://{ip}:{janitor}" if janitor else None,
        }
        for ip in sorted(engine_ips)
    ]
    cfg["discovery"] = disc
    return cfg
