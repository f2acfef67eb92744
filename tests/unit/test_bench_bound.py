"""The family benchmark's capacity bound: Belady's rule on one cache the size of the cluster's pools, in
the order a router sent its requests. It must bound every placement over pools of that total size,
equal the oracle when everything fits, and be held to each router's own order."""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, cast

import pytest
from bench.client import Result
from bench.family_bench import BLOCK_SIZE, KVSTRATA, Prepared, own_order_bound, pooled, render
from bench.workload import bounded_hit_rate, distinct_blocks, ideal_hit_rate


def test_a_cache_that_holds_everything_gives_the_oracle() -> None:
    rng = random.Random(5)
    docs = [[rng.randrange(50) for _ in range(rng.randrange(4, 40))] for _ in range(6)]
    prompts = [
        docs[rng.randrange(6)] + [rng.randrange(50) for _ in range(rng.randrange(0, 9))] for _ in range(40)
    ]
    room = distinct_blocks(prompts, 4)
    assert bounded_hit_rate(prompts, 4, room) == pytest.approx(ideal_hit_rate(prompts, 4))
    assert bounded_hit_rate(prompts, 4, 0) == 0.0


def test_belady_keeps_the_block_used_soonest() -> None:
    # Blocks of 2 tokens: a and b are 2 blocks each (+1 token); served a, b, a in a cache of 2 blocks.
    # Belady evicts a's second block for b's first (a's first is used again sooner), then b's first
    # (never used again) for b's second: a's first block is found the third time. LRU finds nothing;
    # the oracle finds both of a's blocks.
    a, b = [1, 2, 3, 4, 9], [5, 6, 7, 8, 9]
    prompts = [a, b, a]
    total = 15
    assert bounded_hit_rate(prompts, 2, 2) == pytest.approx(2 / total)
    assert ideal_hit_rate(prompts, 2) == pytest.approx(4 / total)
    assert bounded_hit_rate(prompts, 2, 4) == pytest.approx(4 / total)


def _lru_cluster_hit_rate(prompts: Sequence[Sequence[int]], block_size: int, pools: int, each: int) -> float:
    """A router that places by the first block's hash over ``pools`` LRU pools of ``each`` blocks, vLLM's
    way: a prefix found up to its first miss, the last token always computed, every full block cached."""
    caches: list[OrderedDict[object, None]] = [OrderedDict() for _ in range(pools)]
    hits = total = 0
    for ids in prompts:
        cache = caches[hash(tuple(ids[:block_size])) % pools]
        key: object = None
        matching = True
        for end in range(block_size, len(ids) + 1, block_size):
            key = (key, tuple(ids[end - block_size : end]))
            if matching and end < len(ids) and key in cache:
                hits += block_size
            else:
                matching = False
            cache[key] = None
            cache.move_to_end(key)
            while len(cache) > each:
                cache.popitem(last=False)
        total += len(ids)
    return hits / total


@pytest.mark.parametrize("seed", range(8))
def test_no_placement_beats_the_bound(seed: int) -> None:
    rng = random.Random(seed)
    tenants = [[rng.randrange(30) for _ in range(rng.randrange(8, 48))] for _ in range(rng.randrange(2, 7))]
    conversations = [list(rng.choice(tenants)) for _ in range(rng.randrange(3, 12))]
    prompts = []
    for _ in range(rng.randrange(2, 6)):  # turns, in turn order, each extending the last
        for conv in conversations:
            conv += [rng.randrange(30) for _ in range(rng.randrange(3, 12))]
            prompts.append(list(conv))
    each = rng.randrange(4, 30)
    bound = bounded_hit_rate(prompts, 4, 3 * each)
    assert _lru_cluster_hit_rate(prompts, 4, 3, each) <= bound + 1e-12
    assert _lru_cluster_hit_rate(prompts, 4, 1, 3 * each) <= bound + 1e-12
    assert bound <= ideal_hit_rate(prompts, 4) + 1e-12


def test_each_router_is_held_to_the_bound_of_its_own_order() -> None:
    # Two conversations of two turns on different documents, in a cluster of 3 blocks (3 engines of 2,
    # less the null block each). All turns of one conversation before the next keeps each one's prefix;
    # in turn order (a0 b0 a1 b1) they evict each other.
    def tokens(start: int, blocks: float) -> list[int]:
        return list(range(start, start + int(blocks * BLOCK_SIZE)))

    a0, b0 = tokens(0, 2.5), tokens(1000, 2.5)
    a1, b1 = [*a0, *tokens(2000, 2)], [*b0, *tokens(3000, 2)]
    ids = [[a0, a1], [b0, b1]]
    prepared = cast(Prepared, type("P", (), {"ids": ids, "blocks": 2})())

    def result(cid: int, turn: int, start: float, ok: bool = True) -> Result:
        return Result(cid, turn, ok, 0.1, 0.2, None if ok else "boom", start_s=start)

    by_conversation = bounded_hit_rate([a0, a1, b0, b1], BLOCK_SIZE, 3)
    by_turn = bounded_hit_rate([a0, b0, a1, b1], BLOCK_SIZE, 3)
    assert by_conversation > by_turn > 0  # the order matters
    conversation_order = [result(0, 0, 0.0), result(0, 1, 1.0), result(1, 0, 2.0), result(1, 1, 3.0)]
    turn_order = [result(0, 0, 0.0), result(1, 0, 1.0), result(0, 1, 2.0), result(1, 1, 3.0)]
    assert own_order_bound(prepared, conversation_order) == pytest.approx(by_conversation)
    assert own_order_bound(prepared, list(reversed(turn_order))) == pytest.approx(by_turn)  # by start time
    # A request that failed was not served: it is left out.
    failed = [*conversation_order[:3], result(1, 1, 3.0, ok=False)]
    assert own_order_bound(prepared, failed) == pytest.approx(bounded_hit_rate([a0, a1, b0], BLOCK_SIZE, 3))


def test_the_gap_to_the_bound_is_pooled_and_printed() -> None:
    def row(name: str, hit: float, bound: float | None) -> dict[str, Any]:
        out: dict[str, Any] = {"router": name, "hit_rate": hit, "ttft_ms_mean": 100, "ttft_ms_p99": 200}
        out.update(errors=0, split_max_over_mean=1.0)
        if bound is not None:
            out["bound_hit_rate"] = bound
        return out

    routers = [KVSTRATA, "peer/a"]
    info = {"seed": 1, "regime": "pressure", "capacity_actual": 0.5, "api": "chat", "arrival": "closed"}
    info.update(tenants=4, oracle_hit_rate=0.8)
    draws = [
        {**info, "results": [row(KVSTRATA, 0.50, 0.60), row("peer/a", 0.40, 0.62)]},
        {**info, "seed": 2, "results": [row(KVSTRATA, 0.55, 0.59), row("peer/a", 0.50, 0.58)]},
        {**info, "seed": 3, "results": [row(KVSTRATA, 0.5, None), row("peer/a", 0.5, None)]},  # an old run
    ]
    out = pooled(draws, routers)["pressure"]["below_bound_points"]
    assert out[KVSTRATA][0] == pytest.approx((10 + 4) / 2)
    assert out["peer/a"][0] == pytest.approx((22 + 8) / 2)
    text = render({"routers": routers, "draws": draws, "pooled": pooled(draws, routers), "total_s": 1.0})
    assert "kvstrata bound %" in text and "hit below the capacity bound of its own run" in text
