"""Kubeconfig files for the admin and each control-plane component (client-cert auth)."""

from __future__ import annotations

from pathlib import Path

import yaml

CONTEXT = "kvstrata-local"


def render(server: str, ca: Path, cert: Path, key: Path, user: str) -> str:
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": CONTEXT, "cluster": {"server": server, "certificate-authority": str(ca)}}],
        "users": [{"name": user, "user": {"client-certificate": str(cert), "client-key": str(key)}}],
        "contexts": [
            {"name": CONTEXT, "context": {"cluster": CONTEXT, "user": user, "namespace": "default"}}
        ],
        "current-context": CONTEXT,
        "preferences": {},
    }
    return yaml.safe_dump(doc, sort_keys=False)


def write(path: Path, server: str, ca: Path, cert: Path, key: Path, user: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render(server, ca, cert, key, user))
    path.chmod(0o600)
    return path
