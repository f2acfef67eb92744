"""The native follow-up learner (native/src/followups.rs, :class:`NativeFollowUps`) against its
definition, router/followups.py's :class:`FollowUps`: the same answer to every call of random
sequences, and the same learning at its bounds."""

from __future__ import annotations

import random
from array import array

import pytest

from kvstrata.router.followups import FollowUp, FollowUps, NativeFollowUps


def _prompt(rng: random.Random, groups: int) -> array[int]:
    """Chained-looking block hashes: a group's first block, then blocks drawn from a small space (so
    prompts extend one another's last blocks now and then)."""
    group = rng.randrange(groups) + 1
    return array("Q", [group, *(rng.randrange(1, 300) * 1_000_003 for _ in range(rng.randint(0, 90)))])


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("only_evicted", [False, True])
def test_native_follow_ups_answer_as_the_definition(seed: int, only_evicted: bool) -> None:
    rng = random.Random(seed)
    window = rng.choice([0.25, 2.0])
    python, native = (
        FollowUps(window, only_evicted=only_evicted),
        NativeFollowUps(window, only_evicted=only_evicted),
    )
    now = 50.0
    found = 0
    for _ in range(6000):
        now += rng.random() * window * rng.choice([0.1, 1.0, 3.0])
        hashes = _prompt(rng, groups=rng.choice([5, 400]))
        op = rng.random()
        if op < 0.4:
            ep = f"http://e{rng.randrange(3)}"
            python.ended(hashes, ep, now)
            native.ended(hashes, ep, now)
        elif op < 0.8:
            got, want = native.arrived(hashes, now), python.arrived(hashes, now)
            assert got == want
            assert got is None or isinstance(got, FollowUp)
            if want is not None:
                found += 1
                held = rng.randrange(want.blocks + 2)
                python.found(want, held)
                native.found(got, held)
        else:
            assert native.expected(hashes) == python.expected(hashes)
    assert found > 50


def test_an_empty_prompt_teaches_and_expects_nothing() -> None:
    for f in (FollowUps(1.0), NativeFollowUps(1.0)):
        f.ended(array("Q"), "http://e0", 1.0)
        assert f.arrived(array("Q"), 1.0) is None
        assert not f.expected(array("Q"))
