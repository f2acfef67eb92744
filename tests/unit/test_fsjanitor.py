"""The fs-tier janitor: LRU choice above the high-water mark, real files scanned and unlinked."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvstrata.engine.fsjanitor import KvFile, choose_victims, evict, scan


def f(name: str, size: int, used: float, evictable: bool = True) -> KvFile:
    return KvFile(name, size, used, evictable)


def test_nothing_evicted_under_the_high_water_mark() -> None:
    d = choose_victims([f("a", 40, 1), f("b", 40, 2)], budget_bytes=100, high=0.85, low=0.7)
    assert d.victims == () and d.used_bytes == d.after_bytes == 80


def test_least_recently_used_go_first_down_to_the_low_water_mark() -> None:
    files = [f("new", 30, 9), f("old", 30, 1), f("mid", 30, 5), f("newest", 30, 10)]
    d = choose_victims(files, budget_bytes=100, high=0.85, low=0.7)
    assert [v.path for v in d.victims] == ["old", "mid"]
    assert (d.used_bytes, d.after_bytes) == (120, 60)


def test_temp_files_and_config_count_but_are_never_evicted() -> None:
    files = [f("tmp", 80, 0, evictable=False), f("blk", 30, 5)]
    d = choose_victims(files, budget_bytes=100, high=0.85, low=0.7)
    assert [v.path for v in d.victims] == ["blk"] and d.after_bytes == 80


def test_the_marks_leave_room_for_the_largest_burst_between_passes() -> None:
    files = [f(str(i), 10, i) for i in range(8)]  # 80 bytes: under the 85-byte mark
    assert choose_victims(files, budget_bytes=100).victims == ()
    d = choose_victims(files, budget_bytes=100, reserve_bytes=25)  # mark 75, target 50
    assert [v.path for v in d.victims] == ["0", "1", "2"] and d.after_bytes == 50


def test_bad_marks_are_refused() -> None:
    with pytest.raises(ValueError):
        choose_victims([], budget_bytes=1, high=0.5, low=0.9)


def test_scan_and_evict_on_a_real_tree(tmp_path: Path) -> None:
    run = tmp_path / "tiny_abc_r0" / "0a1" / "3f_g0"
    run.mkdir(parents=True)
    for i in range(6):
        p = run / f"{i:02x}.bin"
        p.write_bytes(b"x" * 1000)
        os.utime(p, (100 + i, 100 + i))
    (tmp_path / "tiny_abc_r0" / "config.json").write_text("{}")
    files = list(scan(tmp_path))
    assert len(files) == 7 and sum(x.size for x in files) == 6002
    d = choose_victims(files, budget_bytes=5000)
    assert [Path(v.path).name for v in d.victims] == ["00.bin", "01.bin", "02.bin"]
    assert evict(d.victims) == 3000
    assert evict(d.victims) == 0  # already gone: nothing removed, no error
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == [
        "03.bin",
        "04.bin",
        "05.bin",
        "config.json",
    ]


def test_an_open_file_stays_readable_after_eviction(tmp_path: Path) -> None:
    """The safety argument: a reader that opened a block before the unlink still reads all of it."""
    p = tmp_path / "b.bin"
    p.write_bytes(b"k" * 4096)
    with open(p, "rb") as reader:
        assert evict([KvFile(str(p), 4096, 0, True)]) == 4096
        assert not p.exists()
        assert reader.read() == b"k" * 4096
