"""Build the router's compiled modules (kvstrata/compiled.py) with mypyc: ``make venv`` runs this.

mypyc writes each extension beside its source; here it runs on a copy of the package in a temporary
directory, so the source tree never holds an extension that would shadow an edited source. The
extensions and a manifest of the sources' digests go to ``kvstrata-compiled/`` in the venv. Nothing is done when that
build is current (the loader's own check).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvstrata.compiled import (
    COMPILED_MODULES,
    MANIFEST,
    PACKAGE_ROOT,
    check,
    default_dir,
    digest,
    extension_suffix,
    manifest,
    module_file,
    source_of,
)


def build(out: Path) -> dict[str, object]:
    """Compile :data:`COMPILED_MODULES` and install them, with their manifest, in ``out``."""
    suffix = extension_suffix()
    digests = {m: digest(source_of(m)) for m in COMPILED_MODULES}  # before copying: what is built
    with tempfile.TemporaryDirectory(prefix="kvstrata-mypyc-") as tmp:
        work = Path(tmp)
        shutil.copytree(PACKAGE_ROOT, work / "kvstrata", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
        rel = [str(source_of(m).relative_to(PACKAGE_ROOT.parent)) for m in COMPILED_MODULES]
        done = subprocess.run(
            [sys.executable, "-m", "mypyc", *rel], cwd=work, capture_output=True, text=True, check=False
        )
        if done.returncode != 0:
            sys.stderr.write(done.stdout[-6000:] + done.stderr[-6000:])
            raise SystemExit(f"mypyc failed ({done.returncode})")
        groups = list(work.glob(f"*__mypyc{suffix}"))
        if len(groups) != 1:
            raise SystemExit(f"expected one shared library from mypyc, found {groups}")
        staged = out.with_name(out.name + ".new")
        shutil.rmtree(staged, ignore_errors=True)
        staged.mkdir(parents=True)
        for m in COMPILED_MODULES:
            file = module_file(m)
            (staged / file).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(work / file, staged / file)
        group = groups[0]
        shutil.copy2(group, staged / group.name)
        built = manifest(group.name, digests, {"mypy": _mypy_version()})
        (staged / MANIFEST).write_text(json.dumps(built, indent=1, sort_keys=True) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    staged.rename(out)
    return built


def _mypy_version() -> str:
    from mypy.version import __version__

    return __version__


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", type=Path, default=default_dir(), help="where the build goes (%(default)s)")
    p.add_argument("--force", action="store_true", help="build even when the build there is current")
    args = p.parse_args(argv)
    files, reason = check(args.out)
    if files and not args.force:
        print(f"compiled router modules: current ({args.out})")
        return 0
    print(f"compiling the router's request path with mypyc ({reason}) ...", flush=True)
    t0 = time.monotonic()
    build(args.out)
    files, reason = check(args.out)
    if not files:
        raise SystemExit(f"the build in {args.out} does not load: {reason}")
    print(f"compiled {len(COMPILED_MODULES)} modules in {time.monotonic() - t0:.0f}s into {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
