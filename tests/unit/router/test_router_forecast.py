"""The forecast behind moveOnForecast (router/forecast.py): when running requests end, when room frees."""

from __future__ import annotations

import pytest

from kvstrata.router.forecast import request_end, seconds_with_evictions, wait_for_room
from kvstrata.router.pool import Pace


def pace(tokens: int, seconds: float) -> Pace:
    p = Pace()
    p.observe(tokens, seconds)
    return p


def test_a_request_ends_its_output_after_its_first_byte_and_never_in_the_past() -> None:
    decode = pace(100, 1.0)  # 10 ms a token
    assert request_end(50.0, 49.0, 300, decode) == pytest.approx(52.0)
    assert request_end(50.0, 10.0, 300, decode) == 50.0  # overran its forecast: ends no sooner than now
    assert request_end(50.0, 0.0, 300, decode) == pytest.approx(53.0)  # still in prefill: from now
    assert request_end(50.0, 49.0, 300, Pace()) is None  # no decode pace yet: no forecast


def test_room_frees_as_running_requests_end_in_order_of_their_ends() -> None:
    running = [(30.0, 5), (12.0, 2), (20.0, 3)]
    assert wait_for_room(10.0, 4, 4, running) == 0.0  # fits now
    assert wait_for_room(10.0, 6, 4, running) == pytest.approx(2.0)  # the first to end frees 2
    assert wait_for_room(10.0, 9, 4, running) == pytest.approx(10.0)  # the first two free 5
    assert wait_for_room(10.0, 14, 4, running) == pytest.approx(20.0)  # all three: 14 fits
    assert wait_for_room(10.0, 50, 4, running) == pytest.approx(20.0)  # larger than the pool: alone
    assert wait_for_room(10.0, 50, 4, []) == 0.0


def test_a_prefill_counts_the_cached_blocks_it_evicts_beyond_the_free_ones() -> None:
    prefill = pace(100, 1.0)  # 10 ms a token, blocks of 16
    assert seconds_with_evictions(prefill, 160, 10, 16) == pytest.approx(1.6)  # 10 new blocks fit
    assert seconds_with_evictions(prefill, 160, 4, 16) == pytest.approx(1.6 + 6 * 0.16)
    assert seconds_with_evictions(prefill, 160, -3, 16) == pytest.approx(3.2)  # an over-full pool
    assert seconds_with_evictions(Pace(), 160, 10, 16) is None
