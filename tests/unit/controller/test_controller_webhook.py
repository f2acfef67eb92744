"""Admission decisions: planner verdicts, names, StorageClasses, unchanged-spec updates."""

from __future__ import annotations

import copy

from controller_fakes import example

from kvstrata.controller.webhook import decide

CLASSES = [("kvstrata-local", True), ("nvme-local", False)]


def test_feasible_examples_are_allowed() -> None:
    for name in ("tiny-cpu.yaml", "llama-8b-single-gpu.yaml", "llama-70b-h100-tiered.yaml"):
        d = decide(example(name), None, "CREATE", CLASSES)
        assert d.allowed, (name, d.message)


def test_infeasible_is_denied_with_the_field() -> None:
    d = decide(example("infeasible-405b-one-gpu.yaml"), None, "CREATE", CLASSES)
    assert not d.allowed
    assert "spec.engine.tensorParallelSize" in d.message or "spec.engine.maxModelLen" in d.message


def test_shape_errors_name_the_field() -> None:
    doc = example("tiny-cpu.yaml")
    doc["spec"]["engine"]["gpuCount"] = 2
    d = decide(doc, None, "CREATE", CLASSES)
    assert not d.allowed and "spec.engine.gpuCount" in d.message


def test_long_name_is_denied() -> None:
    doc = example("tiny-cpu.yaml")
    doc["metadata"]["name"] = "a" * 46
    d = decide(doc, None, "CREATE", CLASSES)
    assert not d.allowed and d.message.startswith("metadata.name")
    doc["metadata"]["name"] = "a" * 45
    assert decide(doc, None, "CREATE", CLASSES).allowed


def test_nvme_without_class_needs_a_default() -> None:
    doc = example("llama-70b-h100-tiered.yaml")
    del doc["spec"]["kvCache"]["tiers"]["nvme"]["storageClassName"]
    assert decide(doc, None, "CREATE", CLASSES).allowed
    d = decide(doc, None, "CREATE", [("nvme-local", False)])
    assert not d.allowed
    assert "spec.kvCache.tiers.nvme.storageClassName" in d.message and "nvme-local" in d.message


def test_unknown_class_is_a_warning() -> None:
    doc = example("llama-70b-h100-tiered.yaml")
    d = decide(doc, None, "CREATE", [("kvstrata-local", True)])
    assert d.allowed
    assert any("nvme-local" in w for w in d.warnings)


def test_update_with_unchanged_spec_is_always_allowed() -> None:
    bad = example("infeasible-405b-one-gpu.yaml")
    old = copy.deepcopy(bad)
    bad["metadata"]["annotations"] = {"x": "y"}
    assert decide(bad, old, "UPDATE", CLASSES).allowed
    changed = copy.deepcopy(bad)
    changed["spec"]["replicas"] = 2
    assert not decide(changed, old, "UPDATE", CLASSES).allowed


def test_planner_warnings_are_returned() -> None:
    doc = example("llama-70b-h100-tiered.yaml")
    doc["spec"]["kvCache"]["offload"]["backend"] = "native"
    d = decide(doc, None, "CREATE", CLASSES)
    assert d.allowed
    assert any("does not bound or evict" in w for w in d.warnings)
