"""The generated CRD: fresh, structural, and carrying the columns, subresources and CEL rules users rely on."""

from __future__ import annotations

import json
from pathlib import Path

from kvstrata.api import crd as crd_mod

ROOT = Path(__file__).resolve().parents[2]


def _walk(node, path=""):
    if isinstance(node, dict):
        yield path, node
        for k, v in node.items():
            yield from _walk(v, f"{path}.{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _walk(v, f"{path}[{i}]")


def test_checked_in_crds_are_not_stale() -> None:
    assert crd_mod.main(["--check", "--repo", str(ROOT)]) == 0, "run `make crds`"


def test_schema_is_structural() -> None:
    schema = crd_mod.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    text = json.dumps(schema)
    assert "$ref" not in text and '"title"' not in text and '"const"' not in text
    for path, node in _walk(schema):
        if "properties" in node:
            assert node.get("type") == "object", path
        if isinstance(node.get("anyOf"), list):
            assert node.get("x-kubernetes-int-or-string"), f"anyOf outside int-or-string at {path}"
            assert all(b.get("type") != "null" for b in node["anyOf"]), path
        if "exclusiveMinimum" in node:
            assert node["exclusiveMinimum"] is True, path


def test_quantities_are_int_or_string_with_a_pattern() -> None:
    spec = crd_mod.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    cpu_size = spec["properties"]["kvCache"]["properties"]["tiers"]["properties"]["cpu"]["properties"]["size"]
    assert cpu_size["x-kubernetes-int-or-string"] is True
    assert "pattern" in cpu_size  # beside anyOf: structural schemas allow no value checks inside it
    assert cpu_size["anyOf"] == [{"type": "integer"}, {"type": "string"}]


def test_printer_columns_and_subresources() -> None:
    version = crd_mod.crd()["spec"]["versions"][0]
    names = [c["name"] for c in version["additionalPrinterColumns"]]
    assert names[:7] == ["Ready", "Hit%", "GPU%", "CPU%", "NVMe%", "KV%", "Tiers"] and names[-1] == "Age"
    scale = version["subresources"]["scale"]
    assert scale["labelSelectorPath"] == ".status.selector"
    assert "status" in version["subresources"]


def test_cross_field_rules_are_cel_with_field_paths() -> None:
    spec = crd_mod.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    rules = spec["x-kubernetes-validations"]
    messages = " ".join(r["message"] for r in rules)
    assert "multiple of 32" in messages and "MLA" in messages and "offload" in messages
    assert all(r.get("fieldPath", "").startswith(".") for r in rules)


def test_optional_objects_default_to_their_defaults_so_cel_can_read_them() -> None:
    # The apiserver checks an object default against its CEL rules without defaulting inside it first,
    # so `engine: {}` would fail `self.device != 'cpu'`: defaults carry their children's defaults.
    spec = crd_mod.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert spec["properties"]["engine"]["default"]["device"] == "gpu"
    assert spec["properties"]["engine"]["default"]["tensorParallelSize"] == 1
    assert spec["properties"]["kvCache"]["default"]["tiers"]["gpu"]["memoryUtilization"] == 0.9
    assert spec["properties"]["kvCache"]["properties"]["tiers"]["default"] == {
        "gpu": {"memoryUtilization": 0.9}
    }
