"""The router's compiled modules (kvstrata/compiled.py): loaded when built from these sources, never
beside their sources, and the sources kept to what mypyc compiles as Python runs it."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import kvstrata.router
from kvstrata.compiled import (
    COMPILED_MODULES,
    DISABLE_ENV,
    MANIFEST,
    check,
    default_dir,
    digest,
    extension_suffix,
    manifest,
    module_file,
    source_of,
)


def _loaded_from(module: str, env: dict[str, str]) -> str:
    """Where a fresh interpreter loads ``module`` from."""
    code = f"import importlib; print(importlib.import_module({module!r}).__file__)"
    done = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True, check=True
    )
    return done.stdout.strip()


def test_a_current_build_is_what_the_router_runs() -> None:
    """Where `make venv` built the modules from these sources (as `make test` does), every one of them
    is the extension, and the shared library too; else the reason is given."""
    files, reason = check(default_dir())
    if not files:
        assert not kvstrata.router.COMPILED.active
        assert kvstrata.router.COMPILED.reason == reason
        return
    assert kvstrata.router.COMPILED.active, kvstrata.router.COMPILED
    for module in COMPILED_MODULES:
        loaded = sys.modules.get(module) or __import__(module, fromlist=["_"])
        assert loaded.__file__ == str(files[module]), module
        assert loaded.__file__.endswith(extension_suffix())


def test_switched_off_every_module_is_its_source() -> None:
    for module in ("kvstrata.router.core", "kvstrata.router.proxy"):
        assert _loaded_from(module, {DISABLE_ENV: "0"}) == str(source_of(module))


def _fake_build(tmp: Path) -> Path:
    """A build directory whose manifest names every module with its current digest (the files empty)."""
    group = f"g__mypyc{extension_suffix()}"
    for m in COMPILED_MODULES:
        (tmp / module_file(m)).parent.mkdir(parents=True, exist_ok=True)
        (tmp / module_file(m)).write_bytes(b"")
    (tmp / group).write_bytes(b"")
    built = manifest(group, {m: digest(source_of(m)) for m in COMPILED_MODULES})
    (tmp / MANIFEST).write_text(json.dumps(built))
    return tmp


def test_a_build_of_these_sources_is_taken(tmp_path: Path) -> None:
    files, reason = check(_fake_build(tmp_path))
    assert reason == "compiled"
    assert set(files) == {*COMPILED_MODULES, "g__mypyc"}


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ("digest", "changed since the build"),
        ("suffix", "this interpreter loads"),
        ("module", "another list of modules"),
        ("file", "missing"),
        ("manifest", "not built"),
    ],
)
def test_a_build_that_does_not_match_is_refused_with_its_reason(
    tmp_path: Path, change: str, says: str
) -> None:
    """A source edited since the build, another Python, another module list, a file gone, no build:
    nothing loads compiled, and the reason says which."""
    build = _fake_build(tmp_path)
    manifest = json.loads((build / MANIFEST).read_text())
    first = COMPILED_MODULES[0]
    if change == "digest":
        manifest["modules"][first]["sha256"] = "0" * 64
    elif change == "suffix":
        manifest["suffix"] = ".cpython-310-x86_64-linux-gnu.so"
    elif change == "module":
        del manifest["modules"][first]
    elif change == "file":
        (build / manifest["modules"][first]["file"]).unlink()
    (build / MANIFEST).write_text(json.dumps(manifest))
    if change == "manifest":
        (build / MANIFEST).unlink()
    files, reason = check(build)
    assert files == {}
    assert says in reason, reason


def test_no_compiled_module_binds_one_exception_name_to_two_types() -> None:
    """mypyc types a name once per function: ``except A as exc`` then ``except B as exc`` made a B
    raise a TypeError ("A object expected") in the compiled router (seen: a 500 where no engine was
    known, instead of the 503). Each handler of a function names its exception apart."""
    clashes = []
    for module in COMPILED_MODULES:
        path = source_of(module)
        for fn in ast.walk(ast.parse(path.read_text())):
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            kinds: dict[str, set[str]] = {}
            for node in ast.walk(fn):
                if isinstance(node, ast.ExceptHandler) and node.name:
                    kinds.setdefault(node.name, set()).add(ast.unparse(node.type) if node.type else "")
            clashes += [
                f"{path.name}:{fn.lineno} {fn.name}: {n} {sorted(k)}" for n, k in kinds.items() if len(k) > 1
            ]
    assert clashes == []
