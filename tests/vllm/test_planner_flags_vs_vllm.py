"""Every engine command line the planner renders is accepted by vLLM 0.32.0's own api_server parser.

The flags are checked by vLLM's parser itself (run in vLLM's venv by the probe), never by a copy of
its flag list; ``AsyncEngineArgs.from_cli_args`` also runs, so malformed JSON configs fail too. Negative
controls prove the check can fail.
"""

from __future__ import annotations

import copy
import itertools
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvstrata.api import InferenceCluster
from kvstrata.planner import plan
from kvstrata_dev.testing.vllm_probe_client import vllm_parse_args

REPO = Path(__file__).resolve().parents[2]


def example_manifests() -> dict[str, dict[str, Any]]:
    out = {}
    for path in sorted((REPO / "examples").glob("*.yaml")):
        for i, doc in enumerate(yaml.safe_load_all(path.read_text())):
            if doc:
                out[f"{path.name}#{i}"] = doc
    return out


GPU_BASE: dict[str, Any] = {
    "apiVersion": "kvstrata.io/v1alpha1",
    "kind": "InferenceCluster",
    "metadata": {"name": "matrix"},
    "spec": {
        "model": {
            "name": "meta-llama/Llama-3.1-8B-Instruct",
            "source": "hf://meta-llama/Llama-3.1-8B-Instruct",
        },
        "engine": {"device": "gpu", "gpuMemory": "80Gi", "maxModelLen": 16384, "maxNumSeqs": 32},
        "kvCache": {},
    },
}
MODELS = {
    "llama-8b": ("meta-llama/Llama-3.1-8B-Instruct", "hf://meta-llama/Llama-3.1-8B-Instruct", {}),
    "llama-70b": ("meta-llama/Llama-3.1-70B-Instruct", "hf://meta-llama/Llama-3.1-70B-Instruct", {}),
    "deepseek-v2-lite-mla": (
        "deepseek-ai/DeepSeek-V2-Lite",
        "pvc://models/deepseek-v2-lite",
        {"servedName": "dsv2"},
    ),
    "gemma-2-9b-sliding": ("google/gemma-2-9b-it", "hf://google/gemma-2-9b-it", {}),
}
TIERS = {
    "gpu-only": {},
    "cpu": {"cpu": {"size": "64Gi"}},
    "nvme": {"nvme": {"size": "500Gi", "storageClassName": "nvme"}},
    "cpu+nvme": {"cpu": {"size": "64Gi"}, "nvme": {"size": "1Ti"}},
}
GPU_POOLS = {
    "utilization": {"memoryUtilization": 0.9},
    "size": {"size": "20Gi"},
    "size+blocks": {"size": "20Gi", "numBlocks": 4096},
}


def gpu_matrix() -> dict[str, dict[str, Any]]:
    out = {}
    for (model, (name, source, extra)), tp, kv_dtype, tiers, backend, pool, prefix in itertools.product(
        MODELS.items(),
        (1, 2, 8),
        ("auto", "fp8", "fp8_e5m2", "bfloat16"),
        TIERS,
        ("auto", "native", "lmcache"),
        GPU_POOLS,
        (True, False),
    ):
        doc = copy.deepcopy(GPU_BASE)
        doc["spec"]["model"] = {"name": name, "source": source, **extra}
        doc["spec"]["engine"]["tensorParallelSize"] = tp
        doc["spec"]["kvCache"] = {
            "dtype": kv_dtype,
            "prefixCaching": prefix,
            "hashAlgo": "sha256" if prefix else "sha256_cbor",
            "tiers": {"gpu": GPU_POOLS[pool], **TIERS[tiers]},
            "offload": {"backend": backend},
        }
        out[f"{model}-tp{tp}-{kv_dtype}-{tiers}-{backend}-{pool}-prefix{int(prefix)}"] = doc
    return out


def cpu_matrix() -> dict[str, dict[str, Any]]:
    base = example_manifests()["tiny-cpu.yaml#0"]
    out = {}
    cpu_tiers: dict[str, dict[str, Any]] = {
        "": {},
        "-cpu": {"cpu": {"size": "64Mi"}},
        "-nvme": {"nvme": {"size": "1Gi"}},
        "-cpu+nvme": {"cpu": {"size": "64Mi"}, "nvme": {"size": "1Gi"}},
    }
    for kv_dtype, block, blocks, extra, tiers in itertools.product(
        ("auto", "bfloat16"), (32, 128), (None, 64), ([], ["--enforce-eager"]), cpu_tiers
    ):
        doc = copy.deepcopy(base)
        doc["spec"]["kvCache"]["dtype"] = kv_dtype
        doc["spec"]["kvCache"]["blockSize"] = block
        doc["spec"]["kvCache"]["tiers"] = {
            "gpu": {"size": "2Gi", **({"numBlocks": blocks} if blocks else {})},
            **cpu_tiers[tiers],
        }
        doc["spec"]["engine"]["extraArgs"] = extra
        out[f"cpu-{kv_dtype}-b{block}-n{blocks}-extra{len(extra)}{tiers}"] = doc
    return out


def rendered_argvs() -> dict[str, list[str]]:
    """Distinct engine command lines of every feasible plan in examples/ and the matrices."""
    argvs: dict[str, list[str]] = {}
    seen: set[tuple[str, ...]] = set()
    for name, doc in {**example_manifests(), **gpu_matrix(), **cpu_matrix()}.items():
        p = plan(InferenceCluster.model_validate(doc).spec)
        if not p.feasible:
            continue
        key = tuple(p.engine_args)
        if key not in seen:
            seen.add(key)
            argvs[name] = p.engine_args
    return argvs


ARGVS = rendered_argvs()


@pytest.fixture(scope="module")
def verdicts() -> dict[str, tuple[bool, str]]:
    names = list(ARGVS)
    return dict(zip(names, vllm_parse_args([ARGVS[n] for n in names]), strict=True))


def test_matrix_renders_every_kind_of_flag_set() -> None:
    flat = [" ".join(a) for a in ARGVS.values()]
    for needle in (
        "--kv-offloading-backend native",
        "--kv-offloading-backend lmcache",
        "TieringOffloadingSpec",
        "CpuTieringOffloadingSpec",
        "--tensor-parallel-size 8",
        "--kv-cache-dtype fp8",
        "--no-enable-prefix-caching",
        "--num-gpu-blocks-override",
        "--kv-cache-memory-bytes",
        "--gpu-memory-utilization",
        "--load-format dummy",
    ):
        assert any(needle in a for a in flat), needle
    assert sum(1 for name in ARGVS if name.endswith(".yaml#0")) >= 3


@pytest.mark.parametrize("name", sorted(ARGVS))
def test_vllm_accepts_rendered_flags(verdicts: dict[str, tuple[bool, str]], name: str) -> None:
    ok, error = verdicts[name]
    assert ok, f"vLLM rejects the planner's flags for {name}: {error}\n{ARGVS[name]}"


def _replace(argv: list[str], flag: str, value: str) -> list[str]:
    out = list(argv)
    out[out.index(flag) + 1] = value
    return out


def test_negative_controls_are_rejected() -> None:
    """Flags that articles about vLLM use but 0.32.0 does not have: the check must catch them."""
    base = ARGVS["llama-70b-h100-tiered.yaml#0"]
    offload = next(a for a in ARGVS.values() if "--kv-transfer-config" in a)
    bad = {
        "int8 kv dtype": _replace(base, "--kv-cache-dtype", "int8"),
        "offload kv dtype": _replace(base, "--kv-cache-dtype", "offload"),
        "eviction policy flag": [*base, "--cache-eviction-policy", "lru"],
        "swap space flag": [*base, "--swap-space", "4"],
        "unknown offload backend": _replace(base, "--kv-offloading-backend", "redis"),
        "broken transfer json": _replace(offload, "--kv-transfer-config", '{"kv_connector": "Offloading'),
        "non-numeric port": _replace(base, "--port", "http"),
    }
    results = dict(zip(bad, vllm_parse_args(list(bad.values())), strict=True))
    accepted = {name for name, (ok, _) in results.items() if ok}
    assert not accepted, f"vLLM accepted: {sorted(accepted)}"
    assert "invalid choice: 'int8'" in results["int8 kv dtype"][1]
    assert "unrecognized arguments: --cache-eviction-policy" in results["eviction policy flag"][1]
