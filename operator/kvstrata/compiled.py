"""The router's request path compiled by mypyc, loaded when it was built from the sources here.

Most of what a kv-aware request costs the router in CPU is the interpreter running its Python between
the native steps (docs/router.md, "The request path out of Python"). mypyc (part of mypy, pinned in
pyproject.toml) compiles those typed modules to C extensions with the same semantics: the Python
sources stay the definition, and the router runs either. `make venv` builds them
(dev/kvstrata_dev/build_compiled.py) into ``kvstrata-compiled/`` under the environment's prefix (the
venv's: they are built for its interpreter), or ``KVSTRATA_COMPILED_DIR``, with a manifest of each
module's source digest.

:func:`install` puts a finder first on ``sys.meta_path`` that loads the extensions instead of the
sources, all of them or none: compiled modules use each other's native classes directly, so one module
loaded from its source beside the others would fail type checks. A source edited since the build, a
build for another Python, or ``KVSTRATA_COMPILED=0`` leaves every module to its source (the reason is
in ``kvstrata.router.COMPILED``, logged at start-up, and shown in ``/kvstrata/state``).
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from importlib.machinery import ModuleSpec
from pathlib import Path
from types import ModuleType
from typing import Final

# The modules compiled, each with its source under the kvstrata package. The build and the loader
# both read this list. Left out: followups.py (its native subclass overrides __new__, which mypyc does
# not compile), incremental_native.py (a thin wrapper of the native encoder whose self-check a test
# replaces on the class), errors.py (aiohttp marks a middleware by setting an attribute on it),
# upstream.py (the Python plane's client, off the native front's path), and the modules off the
# request path.
COMPILED_MODULES: Final = (
    "kvstrata.router.admission",
    "kvstrata.router.conversations",
    "kvstrata.router.core",
    "kvstrata.router.decision",
    "kvstrata.router.hashing",
    "kvstrata.router.index",
    "kvstrata.router.metrics",
    "kvstrata.router.native_http",
    "kvstrata.router.outlier",
    "kvstrata.router.policies",
    "kvstrata.router.pool",
    "kvstrata.router.proxy",
    "kvstrata.router.requests",
    "kvstrata.router.scoring",
    "kvstrata.router.tally",
)
MANIFEST: Final = "manifest.json"
DISABLE_ENV: Final = "KVSTRATA_COMPILED"
DIR_ENV: Final = "KVSTRATA_COMPILED_DIR"
PACKAGE_ROOT: Final = Path(__file__).resolve().parent  # .../kvstrata


@dataclass(frozen=True)
class CompiledState:
    """Whether the compiled modules are the ones loaded, and why not."""

    active: bool
    reason: str
    directory: str

    def as_json(self) -> dict[str, object]:
        return {"active": self.active, "reason": self.reason, "directory": self.directory}


def source_of(module: str) -> Path:
    """The Python source of ``module`` (one of :data:`COMPILED_MODULES`)."""
    parts = module.split(".")
    assert parts[0] == "kvstrata", module
    return PACKAGE_ROOT.joinpath(*parts[1:]).with_suffix(".py")


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def default_dir() -> Path:
    """``kvstrata-compiled`` under the environment's prefix (the venv), unless ``KVSTRATA_COMPILED_DIR``."""
    env = os.environ.get(DIR_ENV)
    return Path(env) if env else Path(sys.prefix) / "kvstrata-compiled"


def extension_suffix() -> str:
    return importlib.machinery.EXTENSION_SUFFIXES[0]


def module_file(module: str) -> Path:
    """Where a build puts ``module``'s extension, relative to its directory."""
    return Path(*module.split(".")).with_suffix(extension_suffix())


def manifest(
    group_file: str, digests: dict[str, str], extra: dict[str, str] | None = None
) -> dict[str, object]:
    """The manifest of a build: each module's file and source digest, and the shared library's file
    (the one layout :func:`check` reads)."""
    suffix = extension_suffix()
    return {
        "suffix": suffix,
        "modules": {m: {"file": str(module_file(m)), "sha256": d} for m, d in digests.items()},
        "group": {"module": group_file.removesuffix(suffix), "file": group_file},
        **(extra or {}),
    }


def check(directory: Path, modules: Sequence[str] = COMPILED_MODULES) -> tuple[dict[str, Path], str]:
    """The extension file of every compiled module (and of their shared library) when ``directory``
    holds a build of exactly these sources for this interpreter; else nothing, and the reason."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except FileNotFoundError:
        return {}, f"not built ({directory / MANIFEST} is missing: `make venv` builds it)"
    except (OSError, ValueError) as exc:
        return {}, f"unreadable manifest {directory / MANIFEST}: {exc}"
    if manifest.get("suffix") != extension_suffix():
        return {}, f"built for {manifest.get('suffix')}, this interpreter loads {extension_suffix()}"
    built: dict[str, dict[str, str]] = manifest.get("modules", {})
    if sorted(built) != sorted(modules):
        return {}, "built for another list of modules: `make venv` rebuilds it"
    files: dict[str, Path] = {}
    for module in modules:
        if built[module]["sha256"] != digest(source_of(module)):
            return {}, f"{source_of(module)} changed since the build: `make venv` rebuilds it"
        files[module] = directory / built[module]["file"]
    group = manifest.get("group")
    if group:
        files[group["module"]] = directory / group["file"]
    missing = [str(f) for f in files.values() if not f.is_file()]
    if missing:
        return {}, f"missing {', '.join(missing)}"
    return files, "compiled"


class _Finder(importlib.abc.MetaPathFinder):
    """Finds the compiled modules' extension files, ahead of the sources."""

    def __init__(self, files: dict[str, Path]) -> None:
        self.files = files

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        file = self.files.get(fullname)
        if file is None:
            return None
        loader = importlib.machinery.ExtensionFileLoader(fullname, str(file))
        return importlib.util.spec_from_file_location(fullname, file, loader=loader)


def install(directory: Path | None = None) -> CompiledState:
    """Load the compiled modules from now on, if they are fresh and not switched off."""
    directory = directory or default_dir()
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return CompiledState(False, f"switched off ({DISABLE_ENV}=0)", str(directory))
    loaded = [m for m in COMPILED_MODULES if m in sys.modules]
    if loaded:  # too late: a source module is in use, and mixing the two fails
        return CompiledState(False, f"already imported from source: {', '.join(loaded)}", str(directory))
    files, reason = check(directory)
    if not files:
        return CompiledState(False, reason, str(directory))
    sys.meta_path.insert(0, _Finder(files))
    return CompiledState(True, reason, str(directory))
