"""What every benchmark's JSON carries: the machine it ran on, and a run read back as written."""

from __future__ import annotations

import gzip
import sys
from pathlib import Path

from bench.report import machine, read_json, write_json

from kvstrata_dev.testing.engines import cpuinfo_field


def test_a_run_reads_back_the_same_plain_or_gzipped(tmp_path: Path) -> None:
    payload = {"routers": ["kvstrata/kv-aware", "peer/x"], "draws": [{"seed": 9, "hit_rate": 0.8}]}
    plain = tmp_path / "run.json"
    write_json(plain, payload)
    packed = tmp_path / "run.json.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    assert read_json(plain) == read_json(packed) == payload


def test_the_machine_names_its_cpu_and_the_vector_extensions_engines_depend_on() -> None:
    m = machine()
    assert m["cpus"] and m["date_utc"].endswith("Z")
    assert set(m["cpu_isa"]) <= {"avx2", "avx512f", "avx512_bf16", "amx_tile"}
    if sys.platform == "linux":
        flags = (cpuinfo_field(Path("/proc/cpuinfo").read_text(), "flags") or "").split()
        assert ("avx2" in m["cpu_isa"]) == ("avx2" in flags)
        assert m["cpu_model"]
