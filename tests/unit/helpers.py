"""Small builders for manifests in unit tests."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def example(name: str) -> dict[str, Any]:
    return yaml.safe_load((EXAMPLES / name).read_text())


def with_changes(doc: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    """Set dotted paths (`spec.engine.maxModelLen`); a value of ... deletes the key."""
    out = copy.deepcopy(doc)
    for path, value in changes.items():
        node = out
        *parents, leaf = path.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        if value is ...:
            node.pop(leaf, None)
        else:
            node[leaf] = value
    return out
