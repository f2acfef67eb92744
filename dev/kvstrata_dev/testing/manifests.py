"""Editing manifests in tests: one helper shared by the unit table and the admission table."""

from __future__ import annotations

import copy
from typing import Any


def with_changes(doc: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    """A copy of `doc` with dotted paths (`spec.engine.maxModelLen`) set; a value of `...` deletes the key."""
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
