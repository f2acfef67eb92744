"""Small builders for manifests in unit tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from kvstrata.testing.manifests import with_changes

__all__ = ["EXAMPLES", "example", "with_changes"]

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def example(name: str) -> dict[str, Any]:
    return yaml.safe_load((EXAMPLES / name).read_text())
