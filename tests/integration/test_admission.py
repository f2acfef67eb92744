"""Bad input at `kubectl apply`: each malformed or infeasible manifest is refused by the apiserver (OpenAPI
schema, CEL rules) or by the webhook (the planner), with a message that names the field; the operator logs
no traceback for any of them."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml
from kvs_operator_env import OperatorEnv, example, operator_env_fixture, tracebacks  # noqa: F401

from kvstrata_dev.testing.manifests import with_changes

TINY = example("tiny-cpu.yaml")
GPU = example("llama-8b-single-gpu.yaml")
BIG = example("llama-70b-h100-tiered.yaml")
INFEASIBLE = example("infeasible-405b-one-gpu.yaml")
MLA_ARCH = {
    "attention": "mla",
    "numLayers": 4,
    "numAttentionHeads": 8,
    "hiddenSize": 512,
    "paramsBillions": 0.1,
}


# (id, base manifest, changes, who refuses it, substrings the error must contain)
CASES: list[tuple[str, dict[str, Any], dict[str, Any], str, list[str]]] = [
    # --- OpenAPI schema (apiserver)
    ("unknown-field", TINY, {"spec.engine.gpuCount": 2}, "schema", ["spec.engine.gpuCount"]),
    ("device-enum", TINY, {"spec.engine.device": "tpu"}, "schema", ["spec.engine.device", "tpu"]),
    ("replicas-negative", TINY, {"spec.replicas": -1}, "schema", ["spec.replicas"]),
    ("replicas-string", TINY, {"spec.replicas": "three"}, "schema", ["spec.replicas"]),
    (
        "util-too-high",
        GPU,
        {"spec.kvCache.tiers.gpu.memoryUtilization": 1.5},
        "schema",
        ["memoryUtilization"],
    ),
    (
        "cpu-size-unit",
        BIG,
        {"spec.kvCache.tiers.cpu.size": "64 GB"},
        "schema",
        ["spec.kvCache.tiers.cpu.size"],
    ),
    ("kv-dtype", GPU, {"spec.kvCache.dtype": "int8"}, "schema", ["spec.kvCache.dtype"]),
    (
        "offload-backend",
        BIG,
        {"spec.kvCache.offload.backend": "redis"},
        "schema",
        ["spec.kvCache.offload.backend"],
    ),
    ("router-policy", GPU, {"spec.router.policy": "random"}, "schema", ["spec.router.policy"]),
    ("max-model-len-tiny", GPU, {"spec.engine.maxModelLen": 10}, "schema", ["spec.engine.maxModelLen"]),
    ("name-uppercase", GPU, {"metadata.name": "Llama"}, "schema", ["Llama", "lowercase"]),
    ("no-model", TINY, {"spec.model": ...}, "schema", ["spec.model"]),
    ("source-scheme", TINY, {"spec.model.source": "s3://bucket/model"}, "schema", ["spec.model.source"]),
    (
        "env-name",
        TINY,
        {"spec.engine.env": [{"name": "1BAD NAME", "value": "x"}]},
        "schema",
        ["spec.engine.env[0].name"],
    ),
    ("router-port", GPU, {"spec.router.port": 70000}, "schema", ["spec.router.port"]),
    ("tp-too-big", GPU, {"spec.engine.tensorParallelSize": 32}, "schema", ["spec.engine.tensorParallelSize"]),
    # --- CEL rules in the CRD (apiserver)
    ("cpu-tp", TINY, {"spec.engine.tensorParallelSize": 2}, "cel", ["spec.engine.tensorParallelSize", "1"]),
    (
        "cpu-block-size",
        TINY,
        {"spec.kvCache.blockSize": 16},
        "cel",
        ["spec.kvCache.blockSize", "multiple of 32"],
    ),
    # device cpu takes CPU and NVMe tiers (kvstrata's CPU-platform copy worker); LMCache stays refused
    # there (its wheel ships CUDA ops), by the planner through the webhook.
    (
        "cpu-lmcache-tier",
        TINY,
        {"spec.kvCache.tiers.cpu": {"size": "8Gi"}, "spec.kvCache.offload": {"backend": "lmcache"}},
        "webhook",
        ["spec.kvCache.offload.backend"],
    ),
    (
        "cpu-pool-whole-gib",
        TINY,
        {"spec.kvCache.tiers.gpu.size": "1536Mi"},
        "cel",
        ["spec.kvCache.tiers.gpu.size", "GiB"],
    ),
    (
        "lmcache-without-tier",
        GPU,
        {"spec.kvCache.offload.backend": "lmcache"},
        "cel",
        ["spec.kvCache.offload.backend"],
    ),
    (
        "mla-without-rank",
        GPU,
        {"spec.model.architecture": MLA_ARCH},
        "cel",
        ["spec.model.architecture", "kvLoraRank"],
    ),
    (
        "kv-heads-over-heads",
        TINY,
        {"spec.model.architecture.numKvHeads": 16},
        "cel",
        ["spec.model.architecture.numKvHeads"],
    ),
    # --- the webhook (planner and names)
    (
        "unknown-model",
        GPU,
        {"spec.model.name": "acme/mystery-13b", "spec.model.source": "hf://acme/mystery-13b"},
        "webhook",
        ["spec.model.name", "spec.model.architecture"],
    ),
    ("405b-one-gpu", INFEASIBLE, {}, "webhook", ["spec.engine.", "tensorParallelSize"]),
    (
        "beyond-context",
        GPU,
        {"spec.engine.maxModelLen": 1_000_000},
        "webhook",
        ["spec.engine.maxModelLen", "131,072"],
    ),
    (
        "tp-not-divisor",
        GPU,
        {"spec.engine.tensorParallelSize": 3},
        "webhook",
        ["spec.engine.tensorParallelSize"],
    ),
    (
        "too-many-blocks",
        TINY,
        {"spec.kvCache.tiers.gpu.numBlocks": 10_000_000},
        "webhook",
        ["spec.kvCache.tiers.gpu.numBlocks"],
    ),
    (
        "gpu-pool-too-big",
        GPU,
        {"spec.kvCache.tiers.gpu.size": "90Gi"},
        "webhook",
        ["spec.kvCache.tiers.gpu.size"],
    ),
    (
        "cpu-pool-too-small",
        TINY,
        {"spec.engine.maxModelLen": 4096, "spec.kvCache.tiers.gpu.numBlocks": 100},
        "webhook",
        ["spec.engine.maxModelLen"],
    ),
    ("name-too-long", TINY, {"metadata.name": "a" * 46}, "webhook", ["metadata.name", "45"]),
]


def refused(env: OperatorEnv, doc: dict[str, Any]) -> str:
    r = env.lc.kubectl("apply", "-n", env.ns, "-f", "-", input=yaml.safe_dump(doc), check=False)
    assert r.returncode != 0, f"accepted: {r.stdout}"
    return r.stderr


def test_there_are_at_least_25_cases() -> None:
    assert len(CASES) >= 25
    assert {who for *_, who, _ in CASES} == {"schema", "cel", "webhook"}


@pytest.mark.parametrize(("case", "base", "changes", "who", "needles"), CASES, ids=[c[0] for c in CASES])
def test_bad_manifest_is_refused_naming_the_field(
    operator_env: OperatorEnv, case: str, base: dict, changes: dict, who: str, needles: list[str]
) -> None:
    doc = with_changes(base, changes)
    doc["metadata"]["name"] = doc["metadata"]["name"] if case.startswith("name-") else f"bad-{case}"[:45]
    err = refused(operator_env, doc)
    for needle in needles:
        assert needle in err, f"{needle!r} not in: {err}"
    if who == "webhook":
        assert "denied the request" in err, err
    else:
        assert "denied the request" not in err, f"expected the apiserver itself to refuse: {err}"


def test_nvme_tier_without_class_needs_a_default_storage_class(operator_env: OperatorEnv) -> None:
    env = operator_env
    doc = with_changes(BIG, {"metadata.name": "no-class", "spec.kvCache.tiers.nvme.storageClassName": ...})
    default = [
        sc["metadata"]["name"]
        for sc in env.lc.kubectl_json("get", "storageclass")["items"]
        if (sc["metadata"].get("annotations") or {}).get("storageclass.kubernetes.io/is-default-class")
        == "true"
    ]
    assert default, "the local cluster has a default StorageClass"
    key = "storageclass.kubernetes.io/is-default-class"
    for sc in default:
        env.lc.kubectl("annotate", "--overwrite", "storageclass", sc, f"{key}=false")
    try:
        err = refused(env, doc)
        assert "spec.kvCache.tiers.nvme.storageClassName" in err and "default StorageClass" in err
        assert default[0] in err  # it lists the classes there are
    finally:
        for sc in default:
            env.lc.kubectl("annotate", "--overwrite", "storageclass", sc, f"{key}=true")
    env.apply(doc)  # with a default class again, the same manifest is accepted
    env.lc.kubectl("delete", "ic", "no-class", "-n", env.ns, "--wait=true")
    env.lc.kubectl("delete", "pvc", "-n", env.ns, "-l", "app.kubernetes.io/instance=no-class", "--wait=false")


def test_updates_are_checked_too(operator_env: OperatorEnv) -> None:
    env = operator_env
    doc = with_changes(
        BIG, {"metadata.name": "upd", "spec.kvCache.tiers.nvme.storageClassName": "kvstrata-local"}
    )
    env.apply(doc)
    # CEL transition rule: the class of existing PVCs cannot change
    err = refused(env, with_changes(doc, {"spec.kvCache.tiers.nvme.storageClassName": "other"}))
    assert "spec.kvCache.tiers.nvme.storageClassName" in err and "immutable" in err
    # the planner on UPDATE
    err = refused(env, with_changes(doc, {"spec.engine.maxModelLen": 1_000_000}))
    assert "spec.engine.maxModelLen" in err and "denied the request" in err
    # metadata-only changes of an object are never held up by the webhook
    env.lc.kubectl("label", "ic", "upd", "-n", env.ns, "team=a")
    env.lc.kubectl("delete", "ic", "upd", "-n", env.ns, "--wait=true")
    env.lc.kubectl("delete", "pvc", "-n", env.ns, "-l", "app.kubernetes.io/instance=upd", "--wait=false")


def test_nothing_was_created_and_no_traceback(operator_env: OperatorEnv) -> None:
    env = operator_env
    names = [i["metadata"]["name"] for i in env.lc.kubectl_json("get", "ic", "-n", env.ns)["items"]]
    assert not [n for n in names if n.startswith("bad-")]
    log = env.op.log_text()
    assert tracebacks(log) == []
    denied = [
        json.loads(line) for line in log.splitlines() if line.startswith("{") and "failed permanently" in line
    ]
    webhook_cases = sum(1 for *_, who, _ in CASES if who == "webhook")
    assert len(denied) >= webhook_cases  # every webhook refusal was logged as one line, without a traceback
