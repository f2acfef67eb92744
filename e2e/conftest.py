"""The whole stack once per test module: local cluster + operator + launcher + real vLLM engines + router.

Three engines on 2 cores take about 150 s to start and 3 GB each, so a module shares one stack and its
tests run in file order against it (the last test of a module may tear parts of it down).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstrata_dev.e2e.stack import Stack, load_manifest
from kvstrata_dev.localcluster.session import LocalCluster, namespace_name
from kvstrata_dev.repo import REPO
from kvstrata_dev.testing.engines import vllm_python

# KVSTRATA_E2E_EXAMPLE: run the same tests on another CPU manifest (three replicas, a pvc:// tiny model).
EXAMPLE = Path(os.environ.get("KVSTRATA_E2E_EXAMPLE") or REPO / "examples" / "tiny-cpu.yaml")
TIERED_EXAMPLE = REPO / "examples" / "tiny-cpu-tiered.yaml"
# 64 MiB PVC: the plan's budget is 90% of it (~58 MiB, ~13 prompts of ~600 tokens at 8 KiB per token),
# which ~20 prompts per engine run past; the janitor keeps 70-85% of it (~9-11 prompts), more than the
# CPU tier's 24 MiB (~5 prompts), so prompts a few more back still come from the NVMe tier.
TIERED_NVME = "64Mi"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.e2e)
            item.add_marker(pytest.mark.vllm)


def _module_stack(
    local_cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory, manifest: dict, prefix: str
) -> Iterator[Stack]:
    vllm_python()  # a missing vLLM venv is an error that says how to install it, never a skip
    ns = namespace_name(prefix)
    # A release of its own, so e2e never shares (or uninstalls) another session's operator; its webhook
    # ignores failures so that stopping this operator never blocks InferenceClusters elsewhere.
    st = Stack(
        local_cluster,
        ns,
        manifest,
        tmp_path_factory.mktemp("stack"),
        status_interval=3.0,
        release=f"kvstrata-{ns}"[:30].rstrip("-"),
        release_namespace=f"{ns}-system",
        webhook_failure_policy="Ignore",
    )
    try:
        st.install_operator()
        st.prepare_model()
        st.apply_cluster()
        st.start_launcher()
        st.wait_ready(timeout=900)
        yield st
    finally:
        st.stop()
        for namespace in (ns, st.release_namespace):
            local_cluster.kubectl(
                "delete", "namespace", namespace, "--wait=false", "--ignore-not-found", check=False
            )


@pytest.fixture(scope="module")
def stack(local_cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    yield from _module_stack(local_cluster, tmp_path_factory, load_manifest(EXAMPLE), "e2e")


@pytest.fixture(scope="module")
def tiered_stack(local_cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """examples/tiny-cpu-tiered.yaml (two engines: 64-block pool, 24 MiB CPU tier, NVMe tier on a PVC),
    with the NVMe tier shrunk to TIERED_NVME so a short workload runs past its budget."""
    manifest = load_manifest(TIERED_EXAMPLE)
    manifest["spec"]["kvCache"]["tiers"]["nvme"]["size"] = TIERED_NVME
    yield from _module_stack(local_cluster, tmp_path_factory, manifest, "e2e-tiers")
