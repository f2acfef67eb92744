"""Fixtures shared by tests/ and e2e/. Logic lives in kvstrata_dev.localcluster; this file only wires it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvstrata_dev.localcluster.session import LocalCluster, acquire, fresh_namespace, release


@pytest.fixture(scope="session")
def local_cluster() -> Iterator[LocalCluster]:
    """The local control plane (kube-apiserver, controller-manager, scheduler, kwok nodes).

    Started (and built) on first use, reused when one already runs; torn down at the end only if
    this fixture started it and no other session still uses it (KVSTRATA_REUSE_CLUSTER=1: never).
    """
    lc = acquire()
    try:
        yield lc
    finally:
        release(lc)


@pytest.fixture
def namespace(local_cluster: LocalCluster, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace for one test, deleted afterwards."""
    with fresh_namespace(local_cluster, request.node.name) as ns:
        yield ns
