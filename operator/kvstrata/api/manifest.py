"""Reading InferenceCluster manifests from files, with errors that name the field and the fix."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from kvstrata.api.models import InferenceCluster


class ManifestError(ValueError):
    """A manifest that is not a valid InferenceCluster; the message names each bad field."""


def _path(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def _alias_path(loc: tuple[Any, ...]) -> tuple[Any, ...]:
    """pydantic reports field names when populate_by_name is on; users wrote camelCase."""
    from pydantic.alias_generators import to_camel

    return tuple(to_camel(p) if isinstance(p, str) and "_" in p else p for p in loc)


def describe(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = _alias_path(tuple(p for p in e["loc"] if not str(p).startswith("function-")))
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown field: remove it or check its spelling (fields are camelCase)"
        elif e["type"] == "missing":
            msg = "required field is missing"
        lines.append(f"{_path(loc)}: {msg}")
    return "; ".join(lines)


def validate(doc: Any) -> InferenceCluster:
    if not isinstance(doc, dict):
        raise ManifestError(
            f"expected a mapping with apiVersion, kind, metadata and spec, got {type(doc).__name__}"
        )
    try:
        return InferenceCluster.model_validate(doc)
    except ValidationError as err:
        raise ManifestError(describe(err)) from None


@dataclass(frozen=True)
class Document:
    source: str
    body: dict[str, Any]


def iter_documents(path: Path) -> Iterator[Document]:
    """Every InferenceCluster document in a file or a directory of .yaml/.yml files."""
    files = sorted(p for p in path.rglob("*") if p.suffix in {".yaml", ".yml"}) if path.is_dir() else [path]
    for file in files:
        try:
            docs = list(yaml.safe_load_all(file.read_text()))
        except yaml.YAMLError as err:
            raise ManifestError(f"{file}: not valid YAML: {err}") from None
        for i, doc in enumerate(d for d in docs if d is not None):
            if isinstance(doc, dict) and doc.get("kind") not in (None, "InferenceCluster"):
                continue
            yield Document(source=f"{file}#{i}", body=doc)
