"""Offload tiers on device cpu: vLLM's native tiering with kvstrata's CPU-platform spec, sized and rendered."""

from __future__ import annotations

import json

from helpers import example, with_changes

from kvstrata.api.manifest import validate
from kvstrata.planner import plan
from kvstrata.render.objects import JANITOR_CONTAINER, engine_statefulset

GIB = 1 << 30
MIB = 1 << 20
TINY_BYTES_PER_TOKEN = 2 * 4 * 8 * 64 * 2  # K and V, 4 layers, 8 KV heads, head dim 64, bf16


def tiny(tiers: dict[str, object], **more: object) -> dict[str, object]:
    changes = {f"spec.kvCache.tiers.{name}": value for name, value in tiers.items()}
    return with_changes(example("tiny-cpu.yaml"), {**changes, **more})


def transfer(p) -> dict[str, object]:
    return json.loads(p.engine_args[p.engine_args.index("--kv-transfer-config") + 1])


def test_cpu_and_nvme_tiers_plan_with_native_tiering_and_the_cpu_spec() -> None:
    p = plan(validate(tiny({"cpu": {"size": "256Mi"}, "nvme": {"size": "2Gi"}})).spec)
    assert p.verdict == "fits-with-offload" and p.offload_backend == "native"
    assert "device cpu" in p.offload_reason
    cpu, nvme = p.tier("cpu"), p.tier("nvme")
    assert cpu is not None and cpu.bytes == 256 * MIB
    assert cpu.tokens == 256 * MIB // TINY_BYTES_PER_TOKEN // 32 * 32 and cpu.blocks == cpu.tokens // 32
    assert nvme is not None and nvme.bytes == int(2 * GIB * 0.9) and p.pvc_bytes == 2 * GIB
    cfg = transfer(p)
    assert cfg["kv_connector"] == "OffloadingConnector" and cfg["kv_role"] == "kv_both"
    extra = cfg["kv_connector_extra_config"]
    assert extra["spec_name"] == "CpuTieringOffloadingSpec"
    assert extra["spec_module_path"] == "kvstrata.engine.cpu_offload"
    assert extra["cpu_bytes_to_use"] == 256 * MIB
    (fs,) = extra["secondary_tiers"]
    assert fs["type"] == "fs" and fs["root_dir"] == "/kv-cache" and fs["enable_kv_events"] is True
    assert "--kv-offloading-backend" not in p.engine_args  # vLLM's flag path builds its own, CUDA-only spec
    assert p.engine_env["PYTHONPATH"] == "/opt/kvstrata"
    # The CPU tier lives in /dev/shm (memory-backed, charged to the pod): both grow by twice its size.
    base = plan(validate(example("tiny-cpu.yaml")).spec)
    assert p.shm_bytes == base.shm_bytes + 512 * MIB
    assert p.memory_bytes == base.memory_bytes + 512 * MIB
    assert not any("does not bound" in w for w in p.warnings)  # the janitor bounds it on device cpu


def test_cpu_tier_alone_has_no_secondary_tier() -> None:
    p = plan(validate(tiny({"cpu": {"size": "64Mi"}})).spec)
    extra = transfer(p)["kv_connector_extra_config"]
    assert extra["cpu_bytes_to_use"] == 64 * MIB and "secondary_tiers" not in extra
    assert [t.name for t in p.tiers] == ["gpu", "cpu"]


def test_nvme_alone_gets_a_staging_cpu_tier() -> None:
    """vLLM's tiering needs a CPU tier (the only path between the pool and the fs tier)."""
    p = plan(validate(tiny({"nvme": {"size": "1Gi"}})).spec)
    assert transfer(p)["kv_connector_extra_config"]["cpu_bytes_to_use"] == GIB
    assert p.shm_bytes == plan(validate(example("tiny-cpu.yaml")).spec).shm_bytes + 2 * GIB


def test_lmcache_is_refused_on_device_cpu_and_auto_picks_native() -> None:
    refused = plan(
        validate(tiny({"cpu": {"size": "64Mi"}}, **{"spec.kvCache.offload": {"backend": "lmcache"}})).spec
    )
    assert not refused.feasible
    assert [p.field for p in refused.problems] == ["spec.kvCache.offload.backend"]
    auto = plan(
        validate(tiny({"nvme": {"size": "1Gi"}}, **{"spec.kvCache.offload": {"backend": "auto"}})).spec
    )
    assert auto.offload_backend == "native" and auto.lmcache is None


def test_mla_is_still_refused_on_device_cpu() -> None:
    mla = {"attention": "mla", "kvLoraRank": 512, "qkRopeHeadDim": 64}
    doc = tiny({"cpu": {"size": "64Mi"}}, **{f"spec.model.architecture.{k}": v for k, v in mla.items()})
    fields = [p.field for p in plan(validate(doc).spec).problems]
    assert "spec.kvCache.tiers" in fields


def test_gpu_clusters_keep_vllms_own_specs() -> None:
    p = plan(validate(example("llama-70b-h100-tiered.yaml")).spec)
    if "--kv-transfer-config" in p.engine_args:
        extra = transfer(p)["kv_connector_extra_config"]
        assert extra["spec_name"] == "TieringOffloadingSpec" and "spec_module_path" not in extra
    assert "PYTHONPATH" not in p.engine_env


def test_rendered_pod_runs_the_janitor_on_the_nvme_budget() -> None:
    spec = validate(tiny({"cpu": {"size": "64Mi"}, "nvme": {"size": "2Gi"}})).spec
    p = plan(spec)
    pod = engine_statefulset("tiny", "ns", spec, p, None)["spec"]["template"]["spec"]
    (janitor,) = pod["initContainers"]
    assert janitor["name"] == JANITOR_CONTAINER and janitor["restartPolicy"] == "Always"
    args = janitor["args"]
    assert args[args.index("--budget-bytes") + 1] == str(int(2 * GIB * 0.9))
    assert args[args.index("--root") + 1] == "/kv-cache"
    assert {"name": "kv-cache", "mountPath": "/kv-cache"} in janitor["volumeMounts"]
    engine = pod["containers"][0]
    assert {"name": "kv-cache", "mountPath": "/kv-cache"} in engine["volumeMounts"]
    assert {"name": "PYTHONPATH", "value": "/opt/kvstrata"} in engine["env"]
    shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"]["sizeLimit"] == f"{p.shm_bytes // MIB}Mi"
