"""Pinned versions of the local control plane and where its build and state live.

One place to bump: the build cache directory is keyed by these versions, so a bump builds anew
and never mixes binaries of two releases.
"""

from __future__ import annotations

import os
from pathlib import Path

KUBERNETES = "v1.37.2"
# Staging modules (k8s.io/api, client-go, ...) are published as v0.<minor>.<patch> of the release.
KUBERNETES_STAGING = "v0.37.2"
ETCD = "v3.7.3"
KWOK = "v0.8.0"
HELM = "v3.22.0"

GO = Path(os.environ.get("KVSTRATA_GO", "/usr/local/go/bin/go"))


def cache_root() -> Path:
    return Path(os.environ.get("KVSTRATA_CACHE") or Path.home() / ".cache" / "kvstrata").expanduser()


def build_key() -> str:
    return f"k8s-{KUBERNETES}-etcd-{ETCD}-kwok-{KWOK}-helm-{HELM}"


def build_dir() -> Path:
    return cache_root() / build_key()


def bin_dir() -> Path:
    return build_dir() / "bin"


def default_state_dir() -> Path:
    override = os.environ.get("KVSTRATA_CLUSTER_DIR")
    return Path(override).expanduser() if override else cache_root() / "cluster"
