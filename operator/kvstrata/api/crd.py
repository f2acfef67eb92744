"""Generate the CRD from the pydantic models: `python -m kvstrata.api.crd [--write | --check]`.

Pydantic emits JSON Schema 2020-12; the apiserver wants a *structural* OpenAPI v3 schema: no `$ref`, no
`title`, `nullable` instead of `anyOf [X, null]`, and a `type` on every node. This module does exactly that
conversion and nothing else.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from kvstrata.api.models import (
    GROUP,
    KIND,
    PLURAL,
    SHORT_NAMES,
    SINGULAR,
    VERSION,
    InferenceClusterSpec,
    InferenceClusterStatus,
)
from kvstrata.api.router_config import LABEL_NAME, LABEL_PART_OF

# Paths inside a checkout of the repository (`--repo`, default: the current directory). The installed
# package never looks for its own source tree.
CRD_PATH = Path("crds") / f"{PLURAL}.{GROUP}.yaml"
# The chart ships the CRD as a template (not in crds/, which Helm never upgrades) and keeps it on
# uninstall so that deleting the release does not delete every InferenceCluster with it.
CHART_CRD_PATH = Path("charts") / "kvstrata" / "templates" / "crd.yaml"
CRD_PATHS = [CRD_PATH, CHART_CRD_PATH]
_DROP = {"title", "$defs", "discriminator"}


def _resolve(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, list):
        return [_resolve(n, defs) for n in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        target = copy.deepcopy(defs[node["$ref"].rsplit("/", 1)[-1]])
        extra = {k: v for k, v in node.items() if k != "$ref"}
        return _resolve({**target, **extra}, defs)
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROP:
            continue
        if key in {"properties", "patternProperties"}:
            out[key] = {name: _resolve(sub, defs) for name, sub in value.items()}
        else:
            out[key] = _resolve(value, defs)
    return _structural(out)


def _children_defaults(node: dict[str, Any]) -> dict[str, Any]:
    return {k: copy.deepcopy(v["default"]) for k, v in node.get("properties", {}).items() if "default" in v}


def _structural(node: dict[str, Any]) -> dict[str, Any]:
    any_of = node.get("anyOf")
    if any_of and any(branch.get("type") == "null" for branch in any_of):
        rest = [b for b in any_of if b.get("type") != "null"]
        node.pop("anyOf")
        node.pop("default", None) if node.get("default") is None else None
        if len(rest) == 1:
            merged = {**rest[0], **{k: v for k, v in node.items() if k not in rest[0]}}
            node = merged
        else:
            node["anyOf"] = rest
        # Omitted and null mean the same to the planner; `nullable` lets clients send either.
        node["nullable"] = True
    for bound in ("Minimum", "Maximum"):
        # JSON Schema 2020-12 makes exclusive bounds numbers; OpenAPI v3.0 makes them flags.
        key = f"exclusive{bound}"
        if isinstance(node.get(key), int | float) and not isinstance(node.get(key), bool):
            node[bound.lower()] = node.pop(key)
            node[key] = True
    if node.get("type") == "object" and "properties" in node:
        required = set(node.get("required", []))
        for name, prop in node["properties"].items():
            # Optional sub-objects default to their children's defaults so the apiserver fills them and CEL
            # rules can read e.g. self.kvCache.tiers without has() on every level. Not a bare {}: the
            # apiserver checks a default against the object's CEL rules without defaulting inside it first.
            if name not in required and prop.get("type") == "object" and not prop.get("nullable"):
                prop.setdefault("default", _children_defaults(prop))
    if node.get("x-kubernetes-int-or-string"):
        node.pop("type", None)
    if "const" in node:
        node["enum"] = [node.pop("const")]
    if (
        node.get("type") == "object"
        and "additionalProperties" in node
        and node["additionalProperties"] is False
    ):
        node.pop("additionalProperties")
    return node


def openapi_schema(model: type[BaseModel]) -> dict[str, Any]:
    raw = model.model_json_schema(by_alias=True, mode="validation")
    resolved: dict[str, Any] = _resolve(raw, raw.get("$defs", {}))
    return resolved


def crd() -> dict[str, Any]:
    spec_schema = openapi_schema(InferenceClusterSpec)
    status_schema = openapi_schema(InferenceClusterStatus)
    status_schema["x-kubernetes-preserve-unknown-fields"] = True
    spec_schema["description"] = "Desired state: model, engine, replicas, KV-cache tiers and router."
    status_schema["description"] = "Observed state: conditions, plan, replicas and live cache figures."
    columns = [
        ("Ready", "string", ".status.ready", "Ready engine pods / desired"),
        ("Hit%", "integer", ".status.cache.hitRatePercent", "Prefix-cache hit rate over the last window"),
        # Per tier: shares of all queried prompt tokens, so they add up to Hit% (rounding aside).
        ("GPU%", "integer", ".status.cache.gpuHitRatePercent", "Hit rate from the engines' own KV pools"),
        ("CPU%", "integer", ".status.cache.cpuHitRatePercent", "Hit rate from the CPU DRAM offload tier"),
        ("NVMe%", "integer", ".status.cache.nvmeHitRatePercent", "Hit rate from the NVMe offload tier"),
        ("KV%", "integer", ".status.cache.kvUsagePercent", "Mean KV-cache usage of ready engines"),
        ("Tiers", "string", ".status.tiers", "KV tiers in the plan"),
        ("Verdict", "string", ".status.plan.verdict", "Planner verdict"),
    ]
    printer = [{"name": n, "type": t, "jsonPath": p, "description": d} for n, t, p, d in columns]
    printer.append({"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"})
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{PLURAL}.{GROUP}",
            "labels": {LABEL_NAME: "kvstrata", LABEL_PART_OF: "kvstrata"},
        },
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": SINGULAR,
                "shortNames": SHORT_NAMES,
                "categories": ["kvstrata"],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {
                        "status": {},
                        "scale": {
                            "specReplicasPath": ".spec.replicas",
                            "statusReplicasPath": ".status.replicas",
                            "labelSelectorPath": ".status.selector",
                        },
                    },
                    "additionalPrinterColumns": printer,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "description": "An LLM inference cluster with a planned, tiered KV cache.",
                            "required": ["spec"],
                            "properties": {
                                "apiVersion": {"type": "string"},
                                "kind": {"type": "string"},
                                "metadata": {"type": "object"},
                                "spec": spec_schema,
                                "status": status_schema,
                            },
                        }
                    },
                }
            ],
        },
    }


def render_yaml(path: Path = CRD_PATH) -> str:
    obj = crd()
    if path == CHART_CRD_PATH:
        obj["metadata"]["annotations"] = {"helm.sh/resource-policy": "keep"}
    header = "# Generated by `make crds` from operator/kvstrata/api/models.py. Do not edit.\n"
    return header + yaml.safe_dump(obj, sort_keys=False, width=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvstrata crd", description=__doc__)
    parser.add_argument("--write", action="store_true", help="write crds/ and the chart's CRD")
    parser.add_argument("--check", action="store_true", help="exit 1 when the checked-in CRDs are stale")
    parser.add_argument("--repo", type=Path, default=Path("."), help="checkout to write or check (default .)")
    args = parser.parse_args(argv)
    if args.write:
        for path in CRD_PATHS:
            target = args.repo / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(render_yaml(path))
            print(f"wrote {path}")
        return 0
    if args.check:
        stale = [
            p
            for p in CRD_PATHS
            if not (args.repo / p).exists() or (args.repo / p).read_text() != render_yaml(p)
        ]
        for path in stale:
            print(f"{path} is stale: run `make crds`", file=sys.stderr)
        return 1 if stale else 0
    sys.stdout.write(render_yaml())
    return 0


if __name__ == "__main__":
    sys.exit(main())
