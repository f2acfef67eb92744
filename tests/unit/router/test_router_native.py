"""The native block tables (native/src/lib.rs) against a plain-Python model of the same rules: random
operations, the same answers, the same least-recently-touched order; a chain read in place from an
``array('Q')`` and a list of ints give the same results."""

from __future__ import annotations

import random
from array import array
from collections import OrderedDict

import pytest

from kvstrata.api.router_config import HashAlgo
from kvstrata.router.hashing import block_digests, py_block_digests
from kvstrata.router.native import CPU, GPU, PREDICTED, STORAGE, BlockTable, Recency
from kvstrata.router.native import block_digests as native_block_digests

REAL = GPU | CPU | STORAGE


class Model:
    """The rules of BlockTable in Python (what router/index.py did with OrderedDicts before)."""

    def __init__(self) -> None:
        self.d: OrderedDict[int, list[int]] = OrderedDict()  # hash -> [mask, holders, born]

    def prefix(self, hs: list[int]) -> tuple[int, int, int, int, int]:
        n = gpu = cpu = storage = predicted = 0
        for h in hs:
            e = self.d.get(h)
            if e is None:
                break
            self.d.move_to_end(h)
            n += 1
            if e[0] & GPU:
                gpu += 1
            elif e[0] & CPU:
                cpu += 1
            elif e[0] & STORAGE:
                storage += 1
            else:
                predicted += 1
        return n, gpu, cpu, storage, predicted

    def store(self, hs: list[int], bit: int) -> int:
        added = 0
        for h in hs:
            e = self.d.get(h)
            if e is None:
                self.d[h] = [bit, 0, 0]
                added += 1
            else:
                e[0] = (e[0] | bit) & REAL
                self.d.move_to_end(h)
        return added

    def remove(self, hs: list[int], bit: int) -> tuple[int, list[int]]:
        matched, gone = 0, []
        for h in hs:
            e = self.d.get(h)
            if e is None:
                continue
            matched += bool(e[0] & bit)
            if e[0] & ~bit & REAL:
                e[0] = e[0] & ~bit & REAL
            else:
                del self.d[h]
                gone.append(h)
        return matched, gone

    def predict(self, hs: list[int], pred: int, touched: int) -> int:
        added = 0
        for i, h in enumerate(hs):
            e = self.d.get(h)
            if e is None:
                self.d[h] = [PREDICTED, 1, pred]
                added += 1
            else:
                e[1] += 1
                if i >= touched:
                    self.d.move_to_end(h)
        return added

    def expire(self, hs: list[int], pred: int) -> int:
        n = 0
        for h in hs:
            e = self.d.get(h)
            if e is None or e[2] > pred or e[1] == 0:
                continue
            e[1] -= 1
            if e[1] == 0 and not e[0] & REAL:
                del self.d[h]
                n += 1
        return n


def test_block_table_follows_the_model_on_random_operations() -> None:
    rng = random.Random(5)
    universe = [rng.getrandbits(64) for _ in range(60)] + [0, 1, (1 << 64) - 1]
    for _ in range(20):
        table, model = BlockTable(), Model()
        preds: list[tuple[list[int], int]] = []
        for step in range(300):
            start = rng.randrange(len(universe))
            hs = universe[start : start + rng.randrange(1, 12)]
            arg: list[int] | array[int] = array("Q", hs) if step % 2 else hs
            op = rng.randrange(6)
            if op == 0:
                assert table.prefix(arg) == model.prefix(hs)
            elif op == 1:
                bit = rng.choice((GPU, CPU, STORAGE))
                assert table.store(arg, bit) == model.store(hs, bit)
            elif op == 2:
                bit = rng.choice((GPU, CPU, STORAGE))
                assert table.remove(arg, bit) == model.remove(hs, bit)
            elif op == 3:
                preds.append((hs, step + 1))  # ids increase, as the index gives them
                touched = rng.randrange(0, 4)
                assert table.predict(arg, step + 1, touched) == model.predict(hs, step + 1, touched)
            elif op == 4 and preds:
                # A live prediction ends, in any order: the blocks it predicted lose a holder.
                ended, pred = preds.pop(rng.randrange(len(preds)))
                assert table.expire(ended, pred) == model.expire(ended, pred)
            elif model.d:
                h, (mask, *_) = next(iter(model.d.items()))
                del model.d[h]
                assert table.pop_oldest() == (h, mask)
            assert len(table) == len(model.d)
            assert all(table.mask(h) == (model.d[h][0] if h in model.d else 0) for h in universe)
        order = []
        while (oldest := table.pop_oldest()) is not None:
            order.append(oldest[0])
        assert order == list(model.d)


def test_a_prefix_stops_at_the_first_miss_and_bad_hashes_are_refused() -> None:
    table = BlockTable()
    table.store([1, 2, 3], GPU)
    assert table.prefix(array("Q", [1, 99, 3])) == (1, 1, 0, 0, 0)
    for bad in ([-1], [1 << 64], ["x"]):
        with pytest.raises((OverflowError, TypeError)):
            table.prefix(bad)  # type: ignore[arg-type]


def test_recency_expires_the_oldest_touches_first() -> None:
    r = Recency()
    r.touch(array("Q", [1, 2, 3]), 1.0)
    r.touch([2], 5.0)  # touched again: newest
    assert r.expire_before(2.0) == 1  # 1 and 3 were last touched at 1.0
    r.touch([4, 5, 6], 6.0)
    r.trim(2)  # the oldest go: 2, then 4
    assert len(r) == 2 and r.expire_before(6.0) == 2


def test_a_bounded_touch_is_a_touch_then_a_trim() -> None:
    """``touch(hashes, now, limit)`` touches only the last ``limit`` hashes: the state a touch of all of
    them and a trim to ``limit`` leave, whether the earlier entries survive or not."""
    rng = random.Random(4)
    for limit in (1, 5, 40, 200):
        bounded, reference = Recency(), Recency()
        for step in range(6):
            hashes = array("Q", (rng.getrandbits(64) for _ in range(rng.randrange(0, 120))))
            bounded.touch(hashes, float(step), limit)
            reference.touch(hashes, float(step))
            reference.trim(limit)
            assert len(bounded) == len(reference)
            ranks = range(len(reference) + 1)
            assert [bounded.touched_at_rank(i) for i in ranks] == [
                reference.touched_at_rank(i) for i in ranks
            ]


def test_recency_follows_an_ordered_dict_on_random_operations() -> None:
    rng = random.Random(9)
    universe = [rng.getrandbits(64) for _ in range(40)]
    for _ in range(20):
        r, model = Recency(), OrderedDict[int, float]()
        now = 0.0
        for step in range(400):
            now += rng.choice((0.0, 0.5, 1.0))
            op = rng.randrange(3)
            if op == 0:
                start = rng.randrange(len(universe))
                hs = universe[start : start + rng.randrange(1, 10)]
                r.touch(array("Q", hs) if step % 2 else hs, now)
                for h in hs:
                    model[h] = now
                    model.move_to_end(h)
            elif op == 1:
                horizon = now - rng.choice((0.5, 2.0, 5.0))
                while model and next(iter(model.values())) < horizon:
                    model.popitem(last=False)
                assert r.expire_before(horizon) == len(model)
            else:
                limit = rng.randrange(0, 30)
                r.trim(limit)
                while len(model) > limit:
                    model.popitem(last=False)
            assert len(r) == len(model)
            newest_first = list(model.values())[::-1]
            # Every rank, so both ends of the walk are taken; past the last one there is none.
            assert [r.touched_at_rank(k) for k in range(len(model) + 2)] == [*newest_first, None, None]


# Token ids at every pickle and CBOR integer width boundary, and ordinary vocabulary ids.
_EDGE_IDS = (0, 1, 23, 24, 255, 256, 65_535, 65_536, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**40, 2**63 - 1)


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
@pytest.mark.parametrize("block_size", [1, 2, 3, 4, 5, 16, 32, 256])
def test_native_block_digests_are_vllms(algo: HashAlgo, block_size: int) -> None:
    """Byte for byte the digests of the Python definition (pickle protocol 5 / canonical CBOR of
    ``(parent, tuple(block), None)``), chained, with and without a parent, from a list or an array."""
    rng = random.Random(block_size)
    for trial in range(20):
        n = rng.randrange(0, 6 * block_size + 2)
        ids = [rng.choice(_EDGE_IDS) if rng.random() < 0.3 else rng.randrange(300_000) for _ in range(n)]
        parent = None if trial % 2 else rng.randbytes(32)
        want = py_block_digests(ids, block_size, parent, algo)
        assert len(want) == n // block_size
        assert block_digests(ids, block_size, parent, algo) == want
        assert block_digests(array("q", ids), block_size, parent, algo) == want


def test_native_block_digests_refuse_what_they_cannot_do() -> None:
    with pytest.raises(ValueError, match="algorithm"):
        native_block_digests([1, 2], 1, bytes(32), "xxhash")
    with pytest.raises(ValueError, match="32-byte"):
        native_block_digests([1, 2], 1, b"short", "sha256")
    # Block sizes past one pickle frame are left to the Python definition.
    with pytest.raises(ValueError, match="block size"):
        native_block_digests([1] * 8000, 8000, bytes(32), "sha256")
    assert block_digests([7] * 8000, 8000) == py_block_digests([7] * 8000, 8000)


@pytest.mark.parametrize("seed", range(4))
def test_popping_many_oldest_takes_what_popping_one_at_a_time_would(seed: int) -> None:
    rng = random.Random(seed)
    one, many = BlockTable(), BlockTable()
    for table in (one, many):  # the same history, so the same order of age
        r = random.Random(seed)
        for _ in range(300):
            hs = [r.randrange(1, 2_000) for _ in range(r.randrange(1, 20))]
            if r.random() < 0.5:
                table.store(hs, r.choice((GPU, CPU, STORAGE)))
            else:
                table.predict(hs, r.randrange(1, 1 << 30), r.randrange(0, 3))
            table.prefix(hs[: r.randrange(0, len(hs) + 1)])
    while len(one):
        n = rng.randrange(1, 200)
        popped = [one.pop_oldest() for _ in range(min(n, len(one)))]
        real = [h for h, mask in popped if mask & (GPU | CPU | STORAGE)]
        assert many.pop_oldest_many(n) == (len(popped), real)
        assert len(many) == len(one)
    assert many.pop_oldest_many(5) == (0, [])
