"""`kvstrata plan` and `kvstrata render` as a user runs them: exit codes, formats, field-named errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from helpers import EXAMPLES, example, with_changes

from kvstrata.cli import main


def test_plan_json_for_a_feasible_manifest(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(EXAMPLES / "tiny-cpu.yaml"), "-o", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out[0]["name"] == "tiny" and out[0]["verdict"] == "fits"
    assert out[0]["tiers"][0]["tokens"] == 96 * 32


def test_plan_of_the_examples_dir_fails_because_one_is_infeasible(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(EXAMPLES)]) == 1
    out = capsys.readouterr().out
    assert "== too-big" in out and "INFEASIBLE" in out and "FITS-WITH-OFFLOAD" in out


def test_plan_yaml_output(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(EXAMPLES / "llama-8b-single-gpu.yaml"), "-o", "yaml"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)[0]["kvBytesPerToken"] == 131_072


def test_invalid_manifest_names_the_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = with_changes(example("tiny-cpu.yaml"), {"spec.kvCache.tiers.gpu.memoryUtilization": 2})
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    assert main(["plan", str(path)]) == 1
    err = capsys.readouterr().err
    assert "spec.kvCache.tiers.gpu.memoryUtilization" in err and "0.98" in err


def test_broken_yaml_and_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("spec: [unclosed\n")
    assert main(["plan", str(path)]) == 1
    assert "not valid YAML" in capsys.readouterr().err
    assert main(["plan", str(tmp_path / "nope.yaml")]) == 2


def test_render_prints_applyable_objects(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["render", str(EXAMPLES / "tiny-cpu.yaml"), "-n", "demo"]) == 0
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    kinds = sorted(d["kind"] for d in docs)
    assert "StatefulSet" in kinds and "Deployment" in kinds
    assert all(d["metadata"]["namespace"] == "demo" for d in docs)


def test_render_refuses_an_infeasible_plan(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["render", str(EXAMPLES / "infeasible-405b-one-gpu.yaml")]) == 1
    assert "spec.engine.tensorParallelSize" in capsys.readouterr().err


def test_unknown_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["frobnicate"]) == 2
    assert "unknown command" in capsys.readouterr().err
