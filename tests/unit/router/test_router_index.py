"""The block index: stored/removed/cleared, tiers, predictions with TTL, the bound, dropping endpoints."""

from __future__ import annotations

import pytest

from kvstrata.router.events import AllBlocksCleared, BlockRemoved, BlockStored, decode_payload
from kvstrata.router.index import BlockIndex, PrefixMatch


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def stored(hashes: list[int], medium: str = "GPU") -> BlockStored:
    return BlockStored(tuple(hashes), None, (), 32, medium)


def test_longest_prefix_walk_stops_at_first_miss() -> None:
    idx = BlockIndex(100)
    idx.apply("a", stored([1, 2, 3]))
    idx.apply("b", stored([1, 2]))
    idx.apply("c", stored([2, 3]))  # no block 1: no prefix at all
    got = idx.lookup([1, 2, 3, 4])
    assert got == {"a": PrefixMatch(3, gpu=3), "b": PrefixMatch(2, gpu=2)}
    assert len(idx) == 7


def test_tiers_are_tracked_per_medium() -> None:
    idx = BlockIndex(100)
    idx.apply("a", stored([1, 2, 3], "GPU"))
    idx.apply("a", stored([2, 3], "CPU"))
    idx.apply("a", BlockRemoved((2, 3), "GPU"))  # offloaded: still on CPU
    assert idx.lookup([1, 2, 3]) == {"a": PrefixMatch(3, gpu=1, cpu=2)}
    idx.apply("a", BlockRemoved((3,), "CPU"))
    assert idx.lookup([1, 2, 3]) == {"a": PrefixMatch(2, gpu=1, cpu=1)}
    assert len(idx) == 2
    idx.apply("a", stored([3], "STORAGE"))
    assert idx.lookup([1, 2, 3])["a"].storage == 1


def test_removed_and_cleared() -> None:
    idx = BlockIndex(100)
    idx.apply("a", stored([1, 2, 3]))
    idx.apply("b", stored([1]))
    idx.apply("a", BlockRemoved((2,), "GPU"))
    assert idx.lookup([1, 2, 3])["a"] == PrefixMatch(1, gpu=1)
    idx.apply("a", AllBlocksCleared())
    assert idx.lookup([1]) == {"b": PrefixMatch(1, gpu=1)}
    assert len(idx) == 1
    idx.apply("zzz", BlockRemoved((1,), "GPU"))  # unknown endpoint: no-op


def test_predictions_expire_unless_confirmed() -> None:
    clock = Clock()
    idx = BlockIndex(100, clock=clock)
    idx.predict("a", [1, 2, 3], ttl=5)
    assert idx.lookup([1, 2, 3]) == {"a": PrefixMatch(3, predicted=3)}
    idx.apply("a", stored([1, 2]))  # the engine confirms two of them
    clock.t += 6
    assert idx.lookup([1, 2, 3]) == {"a": PrefixMatch(2, gpu=2)}
    assert len(idx) == 2


def test_predictions_expire_in_expiry_order_whatever_their_ttl() -> None:
    """A request in flight is predicted until its prefill ends (long TTL), then for the short TTL."""
    clock = Clock()
    idx = BlockIndex(100, clock=clock)
    in_flight = idx.predict("a", [1, 2], ttl=600)  # in flight
    idx.predict("b", [1, 2], ttl=5)  # another request, already settled
    clock.t += 6
    assert idx.lookup([1, 2]) == {"a": PrefixMatch(2, predicted=2)}
    assert len(idx) == 2  # b's entries left although a's longer expiry was queued first
    assert in_flight is not None
    idx.retime(in_flight, 5)  # a's prefill is over: the prediction shortens
    clock.t += 6
    assert idx.lookup([1, 2]) == {} and len(idx) == 0


def test_a_later_prediction_holds_an_earlier_ones_blocks_while_it_lives() -> None:
    """The next turn of a conversation re-predicts the earlier blocks by holding the earlier prediction,
    not by rewriting each block: those blocks live while either request does, and no longer."""
    clock = Clock()
    idx = BlockIndex(100, clock=clock)
    turn1 = idx.predict("a", [1, 2], ttl=5)
    turn2 = idx.predict("a", [1, 2, 3], ttl=600)  # in flight, holds turn 1's blocks
    assert turn1 is not None and turn2 is not None
    clock.t += 6
    assert idx.lookup([1, 2, 3]) == {"a": PrefixMatch(3, predicted=3)}
    idx.retime(turn2, 5)  # turn 2's prefill is over
    clock.t += 4
    assert idx.lookup([1, 2, 3]) == {"a": PrefixMatch(3, predicted=3)}
    clock.t += 2
    assert idx.lookup([1, 2, 3]) == {} and len(idx) == 0
    # Confirmed blocks stay whatever the predictions do.
    idx.predict("a", [1, 2], ttl=5)
    idx.apply("a", stored([1]))
    idx.predict("a", [1, 2, 3], ttl=5)
    clock.t += 6
    assert idx.lookup([1, 2, 3]) == {"a": PrefixMatch(1, gpu=1)} and len(idx) == 1


def test_prediction_heap_stays_bounded_under_refreshes() -> None:
    idx = BlockIndex(10, clock=Clock())
    for _ in range(100):
        idx.predict("a", [1, 2, 3], ttl=5)
    assert len(idx) == 3 and idx._predictions.records <= 2 * 10


def test_prediction_refresh_extends_ttl_and_does_not_downgrade_confirmed() -> None:
    clock = Clock()
    idx = BlockIndex(100, clock=clock)
    idx.apply("a", stored([1]))
    idx.predict("a", [1, 2], ttl=5)
    clock.t += 4
    idx.predict("a", [1, 2], ttl=5)
    clock.t += 4  # the first prediction's expiry has passed, the refreshed one has not
    assert idx.lookup([1, 2]) == {"a": PrefixMatch(2, gpu=1, predicted=1)}
    clock.t += 2
    assert idx.lookup([1, 2]) == {"a": PrefixMatch(1, gpu=1)}


def test_removed_block_cancels_its_prediction() -> None:
    idx = BlockIndex(100)
    idx.predict("a", [1], ttl=60)
    idx.apply("a", BlockRemoved((1,), "GPU"))
    assert idx.lookup([1]) == {}
    assert len(idx) == 0


def test_bound_evicts_least_recently_touched_of_the_biggest_endpoint() -> None:
    idx = BlockIndex(5)
    idx.apply("a", stored([1, 2, 3]))
    idx.apply("b", stored([10, 11]))
    idx.lookup([1])  # touch block 1 on a: block 2 is now a's least recently touched
    idx.apply("a", stored([4]))  # 6 entries > 5: evict from a (3 entries... now 4), LRU = block 2
    assert len(idx) == 5
    assert idx.evictions == 1
    assert idx.lookup([1, 2]) == {"a": PrefixMatch(1, gpu=1)}
    assert idx.lookup([10, 11]) == {"b": PrefixMatch(2, gpu=2)}
    idx.predict("b", [12, 13, 14], ttl=10)
    assert len(idx) == 5
    assert idx.evictions == 4


def test_drop_endpoint_forgets_everything_about_it() -> None:
    idx = BlockIndex(100)
    idx.apply("a", stored([1, 2]))
    idx.predict("a", [1, 2, 3], ttl=10)
    idx.apply("b", stored([1]))
    idx.drop_endpoint("a")
    assert idx.lookup([1, 2, 3]) == {"b": PrefixMatch(1, gpu=1)}
    assert len(idx) == 1 and "a" not in idx.endpoints()
    idx.drop_endpoint("never-seen")


def test_recorded_stream_leaves_a_consistent_index(kv_messages: list[tuple[bytes, int, bytes]]) -> None:
    idx = BlockIndex(1_000_000)
    live: set[int] = set()
    for _, seq, payload in kv_messages:
        for ev in decode_payload(seq, payload).events:
            idx.apply("e", ev)
            if isinstance(ev, BlockStored):
                live |= set(ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                live -= set(ev.block_hashes)
    assert len(idx) == len(live) == idx.blocks_of("e")


def test_invalid_bound() -> None:
    with pytest.raises(ValueError):
        BlockIndex(0)


def test_history_remembers_evicted_blocks_until_stored_again() -> None:
    idx = BlockIndex(100)
    idx.apply("a", stored([1, 2, 3]))
    idx.apply("b", stored([1]))
    idx.apply("a", BlockRemoved((2, 3), "GPU"))
    assert idx.lookup([1, 2, 3]) == {"a": PrefixMatch(1, gpu=1), "b": PrefixMatch(1, gpu=1)}
    # The live prefix plus what `a` evicted: `a` had the whole prompt, `b` only its first block.
    assert idx.history([1, 2, 3, 4]) == {"a": 3, "b": 1}
    idx.apply("a", BlockRemoved((1,), "GPU"))
    assert idx.history([1, 2, 3]) == {"a": 3, "b": 1}
    assert "a" not in idx.lookup([1, 2, 3])
    # Offloaded to CPU is not evicted: no ghost, and a block stored again is live, not a ghost.
    idx.apply("b", stored([5], "CPU"))
    idx.apply("b", BlockRemoved((5,), "GPU"))
    idx.apply("a", stored([1, 2]))
    assert idx.history([1, 2, 3]) == {"a": 3, "b": 1}
    idx.apply("a", BlockRemoved((1, 2), "GPU"))
    idx.apply("a", AllBlocksCleared())  # a reset engine has no history either
    assert idx.history([1, 2, 3]) == {"b": 1}


def test_history_is_bounded_and_fed_by_the_index_bound() -> None:
    idx = BlockIndex(4)
    idx.apply("a", stored([1, 2, 3, 4]))
    idx.apply("a", stored([5, 6]))  # the bound drops 1 and 2: the router forgot them, a ghost remembers
    assert idx.history([1, 2]) == {"a": 2}
    idx.apply("b", BlockRemoved((9,), "GPU"))  # never held: not a ghost
    assert idx.history([9]) == {}

    churn = BlockIndex(4)
    churn.apply("a", stored([1, 2]))
    churn.apply("a", BlockRemoved((1, 2), "GPU"))
    for h in range(10, 20):
        churn.apply("c", stored([h]))
        churn.apply("c", BlockRemoved((h,), "GPU"))
    # At most max_blocks ghosts in all, taken from the endpoint with the most: c's newest two survive
    # and a's history is not pushed out by c's churn.
    assert [h for h in range(10, 20) if churn.history([h])] == [18, 19]
    assert churn.history([1, 2]) == {"a": 2}
    churn.drop_endpoint("c")
    assert all(not churn.history([h]) for h in range(10, 20))


def test_every_live_prediction_of_a_block_keeps_it_and_earlier_turns_leave_no_trace() -> None:
    """A conversation's turns each predict the whole prompt: the blocks of every turn live while any
    later turn that holds them does; two conversations sharing a system prompt each keep it alive; and a
    turn that expired is gone (nothing links the turns, so turn 1,000 costs what turn 2 did)."""
    clock = Clock()
    idx = BlockIndex(100_000, clock=clock)
    system = list(range(1, 101))
    a, b = [*system], [*system]
    turns = []
    for t in range(30):
        a += range(1000 * (t + 2), 1000 * (t + 2) + 10)
        pred = idx.predict("e", list(a), ttl=600)
        assert pred is not None
        idx.retime(pred, 5)
        turns.append(pred)
        clock.t += 1
        assert len(idx._predictions) <= 5  # the turns of the last 5 s only
    b += range(500_000, 500_010)
    other = idx.predict("e", list(b), ttl=600)  # a second conversation on the same system prompt
    assert other is not None
    # Turn 1 was predicted 30 s ago with a 5 s TTL: alive through the later turns.
    assert idx.lookup(a)["e"] == PrefixMatch(len(a), predicted=len(a))
    clock.t += 6  # conversation a's last turn expired; b is in flight and holds the system prompt
    assert idx.lookup(a)["e"] == PrefixMatch(len(system), predicted=len(system))
    assert idx.lookup(b)["e"] == PrefixMatch(len(b), predicted=len(b))
    assert len(idx) == len(b)
    idx.retime(other, 5)
    clock.t += 6
    assert idx.lookup(b) == {} and len(idx) == 0
    assert all(p.dead for p in [*turns, other]) and not len(idx._predictions)


def test_a_block_removed_and_predicted_again_is_not_ended_by_its_earlier_prediction() -> None:
    clock = Clock()
    idx = BlockIndex(100, clock=clock)
    idx.predict("a", [1, 2], ttl=5)
    idx.apply("a", BlockRemoved((2,), "GPU"))  # the engine evicted it before our prediction expired
    clock.t += 1
    idx.predict("a", [1, 2], ttl=10)  # block 2's new life, predicted by a later request
    clock.t += 5  # the first prediction ends: block 1 keeps the second's hold, block 2 was never its
    assert idx.lookup([1, 2]) == {"a": PrefixMatch(2, predicted=2)}
    clock.t += 5
    assert idx.lookup([1, 2]) == {} and len(idx) == 0


def test_predictions_past_twice_the_bound_end_early_soonest_first() -> None:
    """Each live prediction references its prompt's array: their blocks are bounded like the index's."""
    clock = Clock()
    idx = BlockIndex(10, clock=clock)
    first = idx.predict("a", [1, 2, 3, 4, 5, 6, 7, 8], ttl=5)
    later = [idx.predict("a", [9, 10, 11, 12, 13, 14, 15, 16], ttl=60 + i) for i in range(2)]
    assert first is not None and first.dead  # 24 blocks predicted, more than 2 x 10: the soonest went
    assert all(p is not None and not p.dead for p in later)
    assert idx._predictions.predicted_hashes == 16


@pytest.mark.parametrize("seed", range(6))
def test_random_predictions_events_and_time_keep_the_index_consistent(seed: int) -> None:
    """Random predictions, re-timings, events, drops and clock steps against a model of what must hold:
    a prediction lives exactly until its latest expiry (or an early end past the bound), the index's
    size is its tables', and an unconfirmed block is held by some live prediction of its endpoint."""
    import random

    from kvstrata.router.native import PREDICTED

    rng = random.Random(seed)
    clock = Clock()
    idx = BlockIndex(rng.choice([40, 400]), clock=clock)
    live: dict[object, tuple[str, float, set[int]]] = {}  # prediction -> endpoint, expiry, hashes
    unconfirmed = 0
    for _ in range(1500):
        before = idx._predictions.predicted_hashes
        op = rng.random()
        ep = rng.choice("abc")
        hashes = list(range(s := rng.randint(1, 60), s + rng.randint(1, 12)))
        if op < 0.35:
            pred = idx.predict(ep, hashes, ttl=rng.choice([0.5, 2.0, 30.0]))
            assert pred is not None
            live[pred] = (ep, pred.expires, set(hashes))
        elif op < 0.5 and live:
            pred = rng.choice(list(live))
            idx.retime(pred, rng.choice([0.0, 1.0, 10.0]))
            if not pred.dead:
                live[pred] = (live[pred][0], pred.expires, live[pred][2])
        elif op < 0.7:
            idx.apply(ep, stored(hashes, rng.choice(["GPU", "CPU"])))
        elif op < 0.8:
            idx.apply(ep, BlockRemoved(tuple(hashes), rng.choice(["GPU", "CPU"])))
        elif op < 0.82:
            idx.drop_endpoint(ep)
        else:
            clock.t += rng.random() * 3
        idx.lookup([1])  # ends what expired by now
        # Predicting past twice the bound in hashes ends the soonest to expire early.
        early = op < 0.5 and before + len(hashes) > 2 * idx.max_blocks
        for pred, (_, expires, _) in list(live.items()):
            if pred.dead:  # type: ignore[attr-defined]
                assert expires <= clock.t or early
                del live[pred]
            else:
                assert expires > clock.t  # nothing expired is alive
        assert len(idx._predictions) == len(live)
        assert idx._predictions.predicted_hashes == sum(len(h) for *_, h in live.values())
        assert len(idx) == sum(idx.blocks_of(e) for e in idx.endpoints())
        for e in idx.endpoints():
            table = idx._eps[e]
            held = set().union(*(h for (pe, _, h) in live.values() if pe == e))
            for h in range(0, 80):
                if table.mask(h) == PREDICTED:  # unconfirmed: only a live prediction keeps it
                    assert h in held
                    unconfirmed += 1
    assert idx._predictions.records <= 2 * len(idx._predictions) + 64
    assert unconfirmed > 100  # the check above ran


class _OneAtATime(BlockIndex):
    """The bound as it was enforced before bulk eviction: one entry of the largest table per step."""

    def _enforce_bound(self) -> None:
        while self._size > self.max_blocks:
            ep = max(self._eps, key=lambda e: len(self._eps[e]))
            popped = self._eps[ep].pop_oldest()
            assert popped is not None
            self._size -= 1
            self.evictions += 1


@pytest.mark.parametrize("seed", range(6))
def test_bulk_eviction_takes_the_entries_one_at_a_time_would(seed: int) -> None:
    """Evicting many entries in a call (a long prompt over the bound) leaves every table as evicting
    them one by one from whichever table is largest (ties included) would."""
    import random

    rng = random.Random(seed)
    bulk = BlockIndex(rng.randrange(20, 200))
    single = _OneAtATime(bulk.max_blocks)
    for _ in range(400):
        ep = rng.choice("abc")
        hs = [rng.randrange(1, 3_000) for _ in range(rng.randrange(1, 120))]
        event = rng.random() < 0.5
        for idx in (bulk, single):
            if event:
                idx.apply(ep, stored(hs))
            else:
                idx.predict(ep, hs, ttl=1e9)
        assert (len(bulk), bulk.evictions) == (len(single), single.evictions)
        probe = [rng.randrange(1, 3_000) for _ in range(3)]
        for h in probe:
            assert bulk.lookup([h]) == single.lookup([h])
