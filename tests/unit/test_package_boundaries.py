"""The product package stands alone: no harness module in its wheel, no import of the harness from it."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ROOT / "operator" / "kvstrata"
HARNESS = ("kvstrata_dev", "kvstrata.localcluster", "kvstrata.testing", "kvstrata.e2e")


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _harness_imports(path: Path) -> list[str]:
    return sorted(n for n in _imports(path) if any(n == h or n.startswith(h + ".") for h in HARNESS))


def test_product_never_imports_the_harness() -> None:
    offenders = {
        str(p.relative_to(ROOT)): bad for p in sorted(PRODUCT.rglob("*.py")) if (bad := _harness_imports(p))
    }
    assert offenders == {}


def test_import_rule_catches_a_harness_import(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("from kvstrata_dev.localcluster.session import LocalCluster\nimport kvstrata.api\n")
    assert _harness_imports(bad) == ["kvstrata_dev.localcluster.session"]


def test_product_never_finds_its_source_tree() -> None:
    """An installed package has no repository around it: `parents[N]` from __file__ is a harness habit."""
    offenders = [str(p.relative_to(ROOT)) for p in PRODUCT.rglob("*.py") if ".parents[" in p.read_text()]
    assert offenders == []


@pytest.fixture(scope="module")
def wheel_files(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    # Built from a copy: setuptools never cleans its build/ directory, so an in-tree build could ship
    # modules that no longer exist in the source.
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheel")
    shutil.copy(ROOT / "pyproject.toml", src)
    shutil.copytree(
        ROOT / "operator", src / "operator", ignore=shutil.ignore_patterns("*.egg-info", "__pycache__")
    )
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(src)], check=True
    )
    (wheel,) = out.glob("kvstrata-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        return zf.namelist()


def test_wheel_holds_the_product_and_nothing_of_the_harness(wheel_files: list[str]) -> None:
    modules = [f for f in wheel_files if f.endswith(".py")]
    top = {f.split("/")[0] for f in modules}
    assert top == {"kvstrata"}, top
    for sub in ("api", "planner", "render", "controller", "router"):
        assert any(f.startswith(f"kvstrata/{sub}/") for f in modules), sub
    harness = [
        f for f in modules if f.startswith(("kvstrata/localcluster/", "kvstrata/testing/", "kvstrata/e2e/"))
    ]
    assert harness == []
    assert "kvstrata/controller/localrun.py" not in modules
    assert "kvstrata/py.typed" in wheel_files
