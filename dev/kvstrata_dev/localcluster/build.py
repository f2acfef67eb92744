"""Build the control-plane binaries from source through the Go module proxy, once.

Each upstream project gets a tiny generated wrapper module (a go.mod that requires it) so that
`go build <its main package>` resolves dependencies exactly as the release pinned them. Kubernetes
needs more: its go.mod points every `k8s.io/<staging>` module at `./staging/...`, which does not
exist in the published module, so the wrapper replaces each of those with the published
`v0.<minor>.<patch>` release instead.

The result lands in `$KVSTRATA_CACHE/<versions>/bin` with a stamp file; a second run is a no-op.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvstrata_dev.localcluster import versions

STAMP = ".stamp.json"
BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl", "kwok", "helm")
# The kwok binary ships no default behaviour: without Stage objects it refuses to start. These are
# the stages `kwokctl` uses (fast node init, heartbeat with leases, fast pod lifecycle), copied
# from the kwok module that the Go proxy served for the build.
KWOK_STAGES = "kwok-stages.yaml"
KWOK_STAGE_FILES = (
    "kustomize/stage/node/fast/node-initialize.yaml",
    "kustomize/stage/node/heartbeat-with-lease/node-heartbeat-with-lease.yaml",
    "kustomize/stage/pod/fast/pod-ready.yaml",
    "kustomize/stage/pod/fast/pod-complete.yaml",
    "kustomize/stage/pod/fast/pod-delete.yaml",
)


class BuildError(RuntimeError):
    """A build step failed; the message names the step and its log."""


@dataclass(frozen=True)
class Component:
    """One wrapper module: the upstream module it requires and the main packages it builds."""

    name: str
    module: str
    version: str
    # binary name -> main package path
    packages: dict[str, str]
    ldflags: tuple[str, ...] = ()
    replaces: dict[str, str] = field(default_factory=dict)


def kubernetes_version_ldflags(version: str) -> tuple[str, ...]:
    """`-X` flags that the Kubernetes Makefile injects, so `kubectl version` and `/version` tell the truth."""
    major, minor = version.lstrip("v").split(".")[:2]
    flags = []
    for pkg in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
        flags += [
            f"-X {pkg}.gitVersion={version}",
            f"-X {pkg}.gitMajor={major}",
            f"-X {pkg}.gitMinor={minor}",
            f"-X {pkg}.gitTreeState=clean",
            f"-X {pkg}.buildDate=1970-01-01T00:00:00Z",
        ]
    return tuple(flags)


def parse_go_mod_blocks(text: str) -> tuple[set[str], set[str]]:
    """Return (required module paths, replaced module paths) of a go.mod."""
    required: set[str] = set()
    replaced: set[str] = set()
    block: str | None = None
    for raw in text.splitlines():
        line = raw.split("//", 1)[0].strip()
        if not line:
            continue
        if block:
            if line == ")":
                block = None
                continue
            target = required if block == "require" else replaced if block == "replace" else None
            if target is not None:
                target.add(line.split()[0])
            continue
        m = re.match(r"^(require|replace|exclude|retract)\s*\($", line)
        if m:
            block = m.group(1)
            continue
        m = re.match(r"^(require|replace)\s+(\S+)", line)
        if m:
            (required if m.group(1) == "require" else replaced).add(m.group(2))
    return required, replaced


def staging_replaces(kubernetes_go_mod: str, staging_version: str) -> dict[str, str]:
    """Map every staging module that kubernetes requires to its published release.

    Only required modules are replaced: some staging modules (sample-cli-plugin, ...) are
    replaced upstream but never required, and the proxy does not serve every one of them.
    """
    required, replaced = parse_go_mod_blocks(kubernetes_go_mod)
    return {mod: staging_version for mod in sorted(required & replaced) if mod.startswith("k8s.io/")}


def go_env(gocache_dir: Path | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        GOTOOLCHAIN="local",  # never download another toolchain; etcd asks for a newer patch release
        CGO_ENABLED="0",
        GOFLAGS="-mod=mod -buildvcs=false",
        GOMAXPROCS=env.get("GOMAXPROCS", "2"),
    )
    env["PATH"] = f"{versions.GO.parent}:{env.get('PATH', '')}"
    if gocache_dir is not None:
        env["GOCACHE"] = str(gocache_dir)
    return env


def run(cmd: list[str], cwd: Path, log: Path, env: dict[str, str]) -> str:
    with log.open("a") as fh:
        fh.write(f"\n$ (cd {cwd}) {' '.join(cmd)}\n")
        fh.flush()
        proc = subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=fh, text=True)
        fh.write(proc.stdout)
    if proc.returncode != 0:
        raise BuildError(f"`{' '.join(cmd[:3])} ...` failed in {cwd} (exit {proc.returncode}); see {log}")
    return proc.stdout


def module_download(module: str, version: str, log: Path, env: dict[str, str], cwd: Path) -> dict[str, str]:
    """`go mod download -json`: paths of the module's go.mod (GoMod) and unpacked source (Dir)."""
    out = run([str(versions.GO), "mod", "download", "-json", f"{module}@{version}"], cwd, log, env)
    return dict(json.loads(out))


def write_kwok_stages(out: Path, log: Path, env: dict[str, str], cwd: Path) -> Path:
    src = Path(module_download("sigs.k8s.io/kwok", versions.KWOK, log, env, cwd)["Dir"])
    docs = [(src / f).read_text().strip() for f in KWOK_STAGE_FILES]
    target = out / KWOK_STAGES
    target.write_text("\n---\n".join(docs) + "\n")
    return target


def components(kubernetes_go_mod: str) -> list[Component]:
    k8s_cmd = "k8s.io/kubernetes/cmd"
    return [
        Component(
            name="kubernetes",
            module="k8s.io/kubernetes",
            version=versions.KUBERNETES,
            packages={
                "kube-apiserver": f"{k8s_cmd}/kube-apiserver",
                "kube-controller-manager": f"{k8s_cmd}/kube-controller-manager",
                "kube-scheduler": f"{k8s_cmd}/kube-scheduler",
                "kubectl": f"{k8s_cmd}/kubectl",
            },
            ldflags=kubernetes_version_ldflags(versions.KUBERNETES),
            replaces=staging_replaces(kubernetes_go_mod, versions.KUBERNETES_STAGING),
        ),
        Component(
            name="etcd",
            module="go.etcd.io/etcd/server/v3",
            version=versions.ETCD,
            packages={"etcd": "go.etcd.io/etcd/server/v3"},
        ),
        Component(
            name="kwok",
            module="sigs.k8s.io/kwok",
            version=versions.KWOK,
            packages={"kwok": "sigs.k8s.io/kwok/cmd/kwok"},
            ldflags=(f"-X sigs.k8s.io/kwok/pkg/consts.Version={versions.KWOK}",),
        ),
        Component(
            name="helm",
            module="helm.sh/helm/v3",
            version=versions.HELM,
            packages={"helm": "helm.sh/helm/v3/cmd/helm"},
            ldflags=(f"-X helm.sh/helm/v3/internal/version.version={versions.HELM}",),
        ),
    ]


def wrapper_go_mod(c: Component) -> str:
    lines = [
        f"module kvstrata.local/build/{c.name}",
        "",
        "go 1.26",
        "",
        f"require {c.module} {c.version}",
        "",
    ]
    if c.replaces:
        lines.append("replace (")
        lines += [f"\t{mod} => {mod} {ver}" for mod, ver in c.replaces.items()]
        lines += [")", ""]
    return "\n".join(lines)


def build_component(c: Component, src: Path, out: Path, log: Path, env: dict[str, str]) -> float:
    wdir = src / c.name
    wdir.mkdir(parents=True, exist_ok=True)
    (wdir / "go.mod").write_text(wrapper_go_mod(c))
    start = time.monotonic()
    ldflags = " ".join(("-s", "-w", *c.ldflags))
    for binary, pkg in c.packages.items():
        print(f"  go build {pkg} -> {binary}", file=sys.stderr, flush=True)
        run(
            [
                str(versions.GO),
                "build",
                "-p",
                "2",
                "-trimpath",
                f"-ldflags={ldflags}",
                "-o",
                str(out / binary),
                pkg,
            ],
            wdir,
            log,
            env,
        )
    return time.monotonic() - start


def is_built(bin_dir: Path) -> bool:
    return (bin_dir / STAMP).is_file() and all((bin_dir / b).is_file() for b in (*BINARIES, KWOK_STAGES))


def _read_json(path: Path) -> dict | None:
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return None


def du_bytes(path: Path) -> int:
    if not path.exists():
        return 0
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def build(force: bool = False, keep_gocache: bool = False) -> Path:
    """Build all binaries into `versions.bin_dir()` unless already there. Returns that directory."""
    root = versions.build_dir()
    out = versions.bin_dir()
    if is_built(out) and not force:
        print(f"control-plane binaries cached in {out}", file=sys.stderr)
        return out
    if not versions.GO.exists():
        raise BuildError(f"go not found at {versions.GO} (set KVSTRATA_GO)")
    src = root / "src"
    log = root / "build.log"
    src.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    # A private GOCACHE keeps the ~GBs of objects out of the shared one and lets us drop it after.
    gocache = root / "gocache"
    env = go_env(gocache)
    print(
        f"building control plane ({versions.build_key()}) into {out}; log {log}", file=sys.stderr, flush=True
    )
    started = time.monotonic()
    k8s_mod = Path(
        module_download("k8s.io/kubernetes", versions.KUBERNETES, log, env, src)["GoMod"]
    ).read_text()
    timings: dict[str, float] = {}
    for comp in components(k8s_mod):
        if (
            all((out / b).is_file() for b in comp.packages)
            and (src / comp.name / ".done").is_file()
            and not force
        ):
            continue
        timings[comp.name] = round(build_component(comp, src, out, log, env), 1)
        partial = _read_json(root / "partial-timings.json") or {"seconds_by_component": {}}
        partial["seconds_by_component"][comp.name] = timings[comp.name]
        (root / "partial-timings.json").write_text(json.dumps(partial) + "\n")
        (src / comp.name / ".done").write_text("ok\n")
    write_kwok_stages(out, log, env, src)
    gocache_bytes = du_bytes(gocache)
    if not keep_gocache:
        shutil.rmtree(gocache, ignore_errors=True)
    previous = _read_json(out / STAMP) or _read_json(root / "partial-timings.json") or {}
    timings = {**previous.get("seconds_by_component", {}), **timings}
    stamp = {
        "key": versions.build_key(),
        "built_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "seconds_total": round(sum(timings.values()), 1),
        "seconds_this_run": round(time.monotonic() - started, 1),
        "seconds_by_component": timings,
        "bin_bytes": du_bytes(out),
        "gocache_bytes_during_build": gocache_bytes,
        "go": subprocess.run([str(versions.GO), "version"], capture_output=True, text=True).stdout.strip(),
    }
    (out / STAMP).write_text(json.dumps(stamp, indent=2) + "\n")
    print(json.dumps(stamp, indent=2), file=sys.stderr)
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="kvstrata-dev cluster build", description="build the control-plane binaries"
    )
    p.add_argument("--force", action="store_true", help="rebuild even if the stamp exists")
    p.add_argument("--keep-gocache", action="store_true", help="keep the Go build cache (faster rebuilds)")
    args = p.parse_args(argv)
    try:
        print(build(force=args.force, keep_gocache=args.keep_gocache))
    except BuildError as e:
        print(f"kvstrata-dev cluster build: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
