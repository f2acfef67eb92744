"""kvstrata.engine.cpu_offload imports vLLM, which only the engine image has: nothing else may import it."""

from __future__ import annotations

import ast
from pathlib import Path

PRODUCT = Path(__file__).resolve().parents[2] / "operator" / "kvstrata"


def _imports(path: Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
    return out


def test_only_the_engine_module_imports_vllm_and_nobody_imports_it() -> None:
    offenders = {}
    for path in PRODUCT.rglob("*.py"):
        rel = path.relative_to(PRODUCT).as_posix()
        bad = {
            n
            for n in _imports(path)
            if n.split(".")[0] in {"vllm", "torch"} or n == "kvstrata.engine.cpu_offload"
        }
        if bad and rel != "engine/cpu_offload.py":
            offenders[rel] = sorted(bad)
    assert offenders == {}


def test_the_engine_module_imports_no_other_kvstrata_module() -> None:
    """vLLM's API server and engine core import it: it must not pull in pydantic, kopf, the planner."""
    names = _imports(PRODUCT / "engine" / "cpu_offload.py")
    assert not [n for n in names if n.startswith("kvstrata")]
