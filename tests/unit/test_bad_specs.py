"""Table of malformed and infeasible manifests: each is refused with the field and a fix, never a traceback."""

from __future__ import annotations

import pytest
from helpers import example, with_changes

from kvstrata.api.manifest import ManifestError, validate
from kvstrata.planner import plan

TINY = example("tiny-cpu.yaml")
GPU = example("llama-8b-single-gpu.yaml")
BIG = example("llama-70b-h100-tiered.yaml")

# (id, base, changes, text the message must contain: the field path, and a hint of the fix)
CASES = [
    ("no-spec", TINY, {"spec": ...}, ["spec", "required"]),
    ("no-model", TINY, {"spec.model": ...}, ["spec.model", "required"]),
    ("bad-source", TINY, {"spec.model.source": "s3://bucket/model"}, ["spec.model.source", "hf://"]),
    ("unknown-field", TINY, {"spec.engine.gpuCount": 2}, ["spec.engine.gpuCount", "unknown field"]),
    ("typo-kvcache", TINY, {"spec.kvcache": {}}, ["spec.kvcache", "unknown field"]),
    ("device", TINY, {"spec.engine.device": "tpu"}, ["spec.engine.device", "'gpu' or 'cpu'"]),
    ("replicas-negative", TINY, {"spec.replicas": -1}, ["spec.replicas", "greater than or equal to 0"]),
    ("replicas-string", TINY, {"spec.replicas": "three"}, ["spec.replicas", "integer"]),
    ("util-too-high", GPU, {"spec.kvCache.tiers.gpu.memoryUtilization": 1.5}, ["memoryUtilization", "0.98"]),
    ("util-too-low", GPU, {"spec.kvCache.tiers.gpu.memoryUtilization": 0.0}, ["memoryUtilization", "0.05"]),
    ("cpu-size-unit", BIG, {"spec.kvCache.tiers.cpu.size": "64 GB"}, ["spec.kvCache.tiers.cpu.size", "64Gi"]),
    ("nvme-size-negative", BIG, {"spec.kvCache.tiers.nvme.size": "-5Gi"}, ["spec.kvCache.tiers.nvme.size"]),
    ("kv-dtype", GPU, {"spec.kvCache.dtype": "int8"}, ["spec.kvCache.dtype", "fp8"]),
    (
        "offload-backend",
        BIG,
        {"spec.kvCache.offload.backend": "redis"},
        ["spec.kvCache.offload.backend", "lmcache"],
    ),
    ("policy", GPU, {"spec.router.policy": "random"}, ["spec.router.policy", "kv-aware"]),
    ("max-model-len-tiny", GPU, {"spec.engine.maxModelLen": 10}, ["spec.engine.maxModelLen", "64"]),
    ("name-uppercase", GPU, {"metadata.name": "Llama"}, ["metadata.name", "pattern"]),
    ("kind", GPU, {"kind": "InferenceService"}, ["kind", "InferenceCluster"]),
    ("arch-missing-heads", TINY, {"spec.model.architecture.numKvHeads": ...}, ["numKvHeads"]),
    # infeasible: the planner's verdict
    (
        "unknown-model",
        GPU,
        {"spec.model.name": "acme/mystery-13b", "spec.model.source": "hf://acme/mystery-13b"},
        ["spec.model.name", "spec.model.architecture"],
    ),
    ("cpu-block-size", TINY, {"spec.kvCache.blockSize": 16}, ["spec.kvCache.blockSize", "multiple of 32"]),
    (
        "cpu-lmcache",
        TINY,
        {"spec.kvCache.tiers.cpu": {"size": "8Gi"}, "spec.kvCache.offload": {"backend": "lmcache"}},
        ["spec.kvCache.offload.backend", "set backend native"],
    ),
    (
        "cpu-kv-not-whole-gib",
        TINY,
        {"spec.kvCache.tiers.gpu.size": "1536Mi"},
        ["spec.kvCache.tiers.gpu.size", "2Gi"],
    ),
    (
        "tp-not-divisor",
        GPU,
        {"spec.engine.tensorParallelSize": 3},
        ["spec.engine.tensorParallelSize", "use one of"],
    ),
    (
        "beyond-model-context",
        GPU,
        {"spec.engine.maxModelLen": 262144},
        ["spec.engine.maxModelLen", "at most 131,072"],
    ),
    (
        "weights-too-big",
        example("infeasible-405b-one-gpu.yaml"),
        {},
        ["spec.engine.tensorParallelSize", "raise"],
    ),
    (
        "max-len-no-fit",
        GPU,
        {"spec.engine.gpuMemory": "24Gi", "spec.engine.maxModelLen": 131072},
        ["spec.engine.maxModelLen", "lower spec.engine.maxModelLen"],
    ),
    (
        "mla-offload",
        BIG,
        {
            "spec.model.name": "deepseek-ai/DeepSeek-V3",
            "spec.model.source": "hf://deepseek-ai/DeepSeek-V3",
            "spec.engine.tensorParallelSize": 8,
            "spec.engine.maxModelLen": 32768,
        },
        ["spec.kvCache.tiers", "MLA"],
    ),
    (
        "num-blocks-over-pool",
        TINY,
        {"spec.kvCache.tiers.gpu.numBlocks": 100000},
        ["spec.kvCache.tiers.gpu.numBlocks", "lower numBlocks"],
    ),
    (
        "gpu-size-too-big",
        GPU,
        {"spec.kvCache.tiers.gpu.size": "90Gi"},
        ["spec.kvCache.tiers.gpu.size", "at most"],
    ),
    (
        "lmcache-no-tier",
        GPU,
        {"spec.kvCache.offload.backend": "lmcache"},
        ["spec.kvCache.offload.backend", "cpu or nvme tier"],
    ),
]


@pytest.mark.parametrize(("base", "changes", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_spec_is_refused_naming_field_and_fix(base, changes, expected) -> None:
    doc = with_changes(base, changes)
    try:
        ic = validate(doc)
    except ManifestError as err:
        message = str(err)
    else:
        p = plan(ic.spec)
        assert p.verdict == "infeasible", f"accepted: {p.summary()}"
        message = "; ".join(pr.message() for pr in p.problems)
    for text in expected:
        assert text in message, f"{text!r} not in {message!r}"


def test_there_are_at_least_25_cases() -> None:
    assert len(CASES) >= 25


def test_non_mapping_document_is_an_error_not_a_crash() -> None:
    with pytest.raises(ManifestError, match="expected a mapping"):
        validate(["not", "a", "manifest"])
