"""The fs-tier janitor: LRU choice above the high-water mark, real files scanned and unlinked."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest

from kvstrata.engine.fsjanitor import EvictionLog, KvFile, block_hash, choose_victims, evict, scan


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


def test_a_block_files_name_gives_the_hash_kv_events_carry() -> None:
    """vLLM names a block file by its full hash in hex and KV events carry the low 64 bits
    (the router's normalize_hash of the same digest)."""
    from kvstrata.router.hashing import normalize_hash

    digest = bytes(range(32))
    path = f"/kv/tiny_abc_r0/000/01_g0/{digest.hex()}.bin"
    assert block_hash(path) == normalize_hash(digest)
    assert block_hash("/kv/tiny_abc/config.json") is None
    assert block_hash(f"/kv/x/{digest.hex()}.bin.tmp") is None
    assert block_hash("/kv/x/not-hex.bin") is None


def test_the_eviction_log_serves_each_hash_once_and_says_what_it_dropped() -> None:
    log = EvictionLog(size=4)
    assert log.since(0) == {"epoch": log.epoch, "next": 0, "hashes": [], "missed": False}
    log.add([1, 2, 3])
    first = log.since(0)
    assert first["hashes"] == [1, 2, 3] and first["next"] == 3 and not first["missed"]
    log.add([4, 5, 6])
    later = log.since(3)
    assert later["hashes"] == [4, 5, 6] and later["next"] == 6 and not later["missed"]
    # A reader that fell behind the log's size gets what is left, and is told.
    behind = log.since(1)
    assert behind["hashes"] == [3, 4, 5, 6] and behind["missed"]
    # A number from another epoch (the janitor restarted): nothing, and told.
    assert log.since(99) == {"epoch": log.epoch, "next": 6, "hashes": [], "missed": True}
    assert EvictionLog().epoch != log.epoch


def test_passes_come_sooner_as_the_tier_grows_faster_and_keep_room_for_one_pass() -> None:
    from kvstrata.engine.fsjanitor import HIGH_WATER, MIN_INTERVAL_S, pacing

    budget = 60 << 20
    # Nothing written yet: the configured interval, nothing reserved.
    assert pacing(budget, 0.0, 1.0) == (1.0, 0)
    # Slow growth (1 MB/s against 60 MiB): the interval stands; 1.5 x one second's growth is kept free.
    assert pacing(budget, 1e6, 1.0) == (1.0, 1_500_000)
    # A CPU engine's ~100 MB/s: a pass every ~31 ms, one period's growth a twentieth of the budget, so
    # the room between the high mark and the budget (0.15) holds three periods.
    sleep, reserve = pacing(budget, 100e6, 1.0)
    assert MIN_INTERVAL_S <= sleep < 0.035 and reserve == pytest.approx(0.075 * budget, rel=0.01)
    assert (1 - HIGH_WATER) * budget >= 3 * 100e6 * sleep
    # A pass's own work (scan, unlink) counts in the period: the sleep shrinks, the reserve does not.
    sleep_w, reserve_w = pacing(budget, 100e6, 1.0, work_s=0.01)
    assert sleep_w == pytest.approx(sleep - 0.01) and reserve_w == pytest.approx(reserve, rel=0.01)
    # Faster still: never more often than MIN_INTERVAL_S, and the reserve grows with the rate instead.
    sleep, reserve = pacing(budget, 1e9, 1.0)
    assert sleep == MIN_INTERVAL_S and reserve == pytest.approx(1.5 * 1e9 * MIN_INTERVAL_S, abs=1)
    # The marks then keep that growth free under the budget.
    one_pass = pacing(budget, 100e6, 1.0)[1]
    d = choose_victims(
        [f(str(i), 1 << 20, i) for i in range(58)], budget_bytes=budget, reserve_bytes=one_pass
    )
    assert d.victims and d.after_bytes + one_pass <= budget


def test_passes_that_wake_late_keep_room_for_their_lateness_and_forget_it_slowly() -> None:
    from kvstrata.engine.fsjanitor import LATE_DECAY, lateness, pacing

    budget = 60 << 20
    on_time = pacing(budget, 100e6, 1.0)
    # A pass 0.1 s late at 100 MB/s: 10 MB more is kept free, the sleep is the same.
    late = pacing(budget, 100e6, 1.0, late_s=0.1)
    assert late[0] == on_time[0] and late[1] - on_time[1] == pytest.approx(10e6, abs=1)
    # Lateness is what a sleep took beyond what it asked for; never negative.
    assert lateness(0.0, 0.05, 0.15) == pytest.approx(0.1)
    assert lateness(0.0, 0.05, 0.04) == 0.0
    # One stall is remembered over the passes after it, shrinking, and a larger one replaces it.
    remembered = lateness(0.1, 0.05, 0.05)
    assert remembered == pytest.approx(0.1 * LATE_DECAY)
    assert lateness(remembered, 0.05, 0.35) == pytest.approx(0.3)
    # A calm machine gets the room back: after a few hundred passes on time, nothing is kept for it.
    seen = 0.3
    for _ in range(400):
        seen = lateness(seen, 0.05, 0.05)
    assert seen < 0.001


def test_a_stall_after_the_tier_stopped_growing_evicts_nothing_and_one_while_it_grows_keeps_room() -> None:
    """The e2e restart test lost every block file of a prompt written 4 s before the kill: the restarting
    engine made a pass late, and the room for that lateness at the burst rate once seen exceeded the
    budget, so the marks fell to zero."""
    from kvstrata.engine.fsjanitor import RATE_MEMORY_S, pacing, recent_rate

    budget, burst = 64 << 20, 400e6
    files = [f(str(i), 1 << 20, i) for i in range(50)]  # 50 MiB: under the high mark
    # The tier grew at the burst rate, then nothing was written for 4 s (10 ms passes, seeing no growth).
    rate = recent_rate(0.0, burst, 0.01)
    for _ in range(400):
        rate = recent_rate(rate, 0.0, 0.01)
    # The restart keeps both cores busy: a sleep of 10 ms takes 2 s. The pass after it, at the fastest
    # rate seen, keeps room for more than the budget: every file would go.
    sleep, at_max = pacing(budget, burst, 1.0, late_s=2.0)
    assert at_max > budget and len(choose_victims(files, budget, reserve_bytes=at_max).victims) == 50
    # At the recent rate (faded over the stall too) the same pass keeps the files, and passes stay as
    # frequent as the burst rate asks.
    rate = recent_rate(rate, 0.0, 2.0 + sleep)
    sleep_r, reserve = pacing(budget, burst, 1.0, late_s=2.0, rate=rate)
    assert sleep_r == sleep and not choose_victims(files, budget, reserve_bytes=reserve).victims
    # The planned period keeps its room at the fastest rate: a burst may start at once.
    assert reserve >= pacing(budget, burst, 1.0)[1]
    # While the tier is growing, the same stall keeps the same room as before.
    growing = recent_rate(rate, burst, 0.01)
    assert growing == burst and pacing(budget, burst, 1.0, late_s=2.0, rate=growing) == (sleep, at_max)
    # A growth rate fades with time, never below zero, and a faster one replaces it at once.
    assert recent_rate(burst, 0.0, RATE_MEMORY_S) == pytest.approx(burst / math.e)
    assert recent_rate(burst, -1e6, 0.01) > 0 and recent_rate(1e6, burst, 0.01) == burst
    assert recent_rate(0.0, -1e6, 0.01) == 0.0
