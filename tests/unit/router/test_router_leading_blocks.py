"""A long new stretch no engine holds the start of is routed on its leading blocks; the rest is hashed
after the decision and completes it (core.Router._probe, _hashed_later)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from kvstrata.api.router_config import RouterSettings
from kvstrata.router import core
from kvstrata.router.core import Router
from kvstrata.router.hashing import block_hashes
from kvstrata.router.metrics import RouterMetrics
from kvstrata.router.pool import EndpointSpec
from kvstrata.router.prompts import LocalTokenizer
from kvstrata.router.requests import ParsedRequest
from kvstrata.router.scoring import FitScorer
from kvstrata.router.workpool import BACKGROUND_THREAD_NAME
from kvstrata_dev.testing.tinymodel import default_tiny_model_dir, ensure_tiny_model

BLOCK = 16
URLS = ("http://a:8000", "http://b:8000", "http://c:8000")


@pytest.fixture(scope="module")
def tok() -> LocalTokenizer:
    return LocalTokenizer(ensure_tiny_model(default_tiny_model_dir()))


class _HoldsBackRests(Router):
    """A router whose rests wait for ``release`` once it is set (:func:`hold_back_rests`). A subclass,
    since the router's methods cannot be replaced on an instance when it is compiled."""

    release: threading.Event | None = None

    def _finish(self, enc: Any, text: str, walked: Any) -> Any:
        release = self.release
        if release is not None and threading.current_thread().name.startswith(BACKGROUND_THREAD_NAME):
            assert release.wait(10)  # a rest, after its decision
        return super()._finish(enc, text, walked)


@pytest.fixture
def router(tok: LocalTokenizer) -> Iterator[Router]:
    settings = RouterSettings.model_validate({"model": "m", "blockSize": BLOCK, "remoteTokenize": False})
    r = _HoldsBackRests(settings, RouterMetrics(), tokenizer=tok)
    r.pool.replace([EndpointSpec(u) for u in URLS])
    for ep in r.pool.all():
        ep.kv_blocks = 100_000  # a known pool: the fit scorer speaks
    yield r
    r.close()


def document(seed: int, words: int) -> str:
    """Pseudo-English with plenty of safe cuts (``word word``)."""
    vocab = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet"]
    return " ".join(vocab[(seed * 7 + i * i) % len(vocab)] + str((seed + i) % 13) for i in range(words))


def completion(text: str) -> ParsedRequest:
    return ParsedRequest("completion", {}, "m", False, text=text)


def chat(messages: list[dict[str, str]]) -> ParsedRequest:
    size = sum(len(m["content"]) for m in messages)
    return ParsedRequest("chat", {}, "m", False, messages=messages, size=size)


def counter(router: Router, rest: str = "deferred") -> float:
    name = "kvstrata_router_routed_on_leading_blocks_total"
    return router.metrics.registry.get_sample_value(name, {"rest": rest}) or 0.0


async def rest_done(router: Router) -> None:
    await asyncio.gather(*(rest.done for rest in router._rests.values()))
    await asyncio.sleep(0)  # the done callbacks run on the next turn of the loop


async def test_a_long_cold_prompt_is_routed_on_its_leading_blocks_and_completed_after(
    router: Router, tok: LocalTokenizer
) -> None:
    text = document(1, 3000)  # ~26K characters, nothing of it known anywhere
    ids = tok.encode_completion(text)
    full = block_hashes(ids, BLOCK)
    decision = await router.decide(completion(text))
    assert counter(router) == 1
    # The decision saw only the leading blocks, all of them the engine's own.
    assert 0 < len(decision.hashes) < len(full) // 10
    assert list(decision.hashes) == list(full[: len(decision.hashes)])
    # Its size is an estimate from them, close to the truth (prefill cost, fit and admission use it).
    assert decision.prompt_tokens is not None and abs(decision.prompt_tokens - len(ids)) < 0.05 * len(ids)
    assert decision.request is not None and decision.request.block_count() == decision.prompt_tokens // BLOCK
    ep = decision.order[0]
    grant = await router.gate.admit(decision, 0)  # proxy._forward
    assert grant.claim is not None and router.gate.in_flight_blocks(ep) == -(-decision.prompt_tokens // BLOCK)
    router.commit(decision, ep)  # sent (proxy._attempt)
    await rest_done(router)
    # Completed: the decision, the prediction, the fit scorer's demand and the admission gate's claim
    # cover the whole prompt.
    assert (list(decision.hashes), decision.prompt_tokens) == (list(full), len(ids))
    assert grant.claim.hashes is decision.hashes and router.gate.in_flight_blocks(ep) == -(-len(ids) // BLOCK)
    assert decision.request.block_count() == len(full)
    assert router.index.lookup(full)[ep.url].blocks == len(full)
    fit = next(s for s, _ in router.scorers if isinstance(s, FitScorer))
    assert fit.demand_blocks(ep, decision.request.now) == len(full)
    tokens = router.metrics.registry.get_sample_value("kvstrata_router_prompt_tokens_total")
    assert tokens == len(ids)  # counted once, exactly
    # The prediction is re-timed like any other when the prefill is over.
    router.settle(decision, ep)
    assert decision.prediction is not None and router.index.ttl_left(decision.prediction) <= (
        router.settings.prediction_ttl_seconds
    )


async def test_a_long_cold_chat_is_routed_on_its_leading_blocks_and_its_next_turn_walks_it(
    router: Router, tok: LocalTokenizer
) -> None:
    """Chat too: the rendered conversation is probed, routed on its first blocks, completed after the
    decision with the engine's exact ids, and the next turn reuses what was hashed."""
    messages = [{"role": "system", "content": document(3, 3000)}, {"role": "user", "content": "summarise"}]
    full = block_hashes(tok.encode_chat(messages), BLOCK)
    decision = await router.decide(chat(messages))
    assert counter(router) == 1
    assert 0 < len(decision.hashes) < len(full) // 10
    assert list(decision.hashes) == list(full[: len(decision.hashes)])
    ep = decision.order[0]
    router.commit(decision, ep)
    await rest_done(router)
    assert list(decision.hashes) == list(full)
    assert router.index.lookup(full)[ep.url].blocks == len(full)
    turn = [
        *messages,
        {"role": "assistant", "content": "it is about golf"},
        {"role": "user", "content": "more"},
    ]
    second = await router.decide(chat(turn))
    assert counter(router) == 1  # the engine holds the start: hashed in full, mostly from the cache
    assert list(second.hashes) == list(block_hashes(tok.encode_chat(turn), BLOCK))
    assert second.order[0] is ep and second.reason == "prefix"


async def test_the_next_turn_walks_what_was_hashed_after_the_decision(
    router: Router, tok: LocalTokenizer
) -> None:
    text = document(2, 3000)
    first = await router.decide(completion(text))
    router.commit(first, first.order[0])
    await rest_done(router)
    turn = text + " and then the user asks one more short question about it"
    second = await router.decide(completion(turn))
    ids = tok.encode_completion(turn)
    # The whole of the earlier prompt came from the chunk cache, and the engine holds it (predicted):
    # hashed in full before the decision, and routed to that engine for its prefix.
    assert counter(router) == 1
    assert list(second.hashes) == list(block_hashes(ids, BLOCK))
    assert second.order[0] is first.order[0] and second.reason == "prefix"


def hold_back_rests(router: Router) -> threading.Event:
    """Rests hashed on the background thread after their decision wait for the returned event; a
    request's own hashing does not."""
    assert isinstance(router, _HoldsBackRests)
    router.release = threading.Event()
    return router.release


async def test_a_request_for_a_document_being_hashed_waits_for_that_work(
    router: Router, tok: LocalTokenizer
) -> None:
    """Two questions about one new document, moments apart: the second finds the first's prediction
    on the probe and waits for the first's hashing, then walks it, instead of tokenizing it again."""
    text = document(5, 3000)
    turn = text + " and then the user asks one more short question about it"
    release = hold_back_rests(router)
    first = await router.decide(completion(text))
    router.commit(first, first.order[0])
    second = asyncio.ensure_future(router.decide(completion(turn)))
    await asyncio.sleep(0.05)
    release.set()
    decided = await second
    assert counter(router) == 1
    assert list(decided.hashes) == list(block_hashes(tok.encode_completion(turn), BLOCK))
    assert decided.order[0] is first.order[0]
    chars = router.metrics.registry.get_sample_value
    tokenized = chars("kvstrata_router_prompt_chars_total", {"path": "tokenized"})
    assert tokenized is not None and tokenized < len(text) + 200  # the document once, then the new turn


async def test_a_request_whose_only_match_is_a_prompt_still_being_hashed_waits_for_it(
    router: Router, tok: LocalTokenizer
) -> None:
    """Two prompts sharing a long stretch moments apart, the second hashed in full on its own path (here:
    short enough to need no probe; in a burst, because the background thread's cached chunks let its
    walk run past the probe). All it matches is the first's leading blocks, so it waits for the first's
    rest and then sees the whole shared stretch predicted where the first went."""
    text = document(50, 3000)  # document(s) repeats with period 130: clear of the other tests' seeds
    other = text[:1500] + " and then a different short question about it"
    release = hold_back_rests(router)
    first = await router.decide(completion(text))
    home = first.order[0]
    router.commit(first, home)
    probe = len(first.hashes)
    second = asyncio.ensure_future(router.decide(completion(other)))
    await asyncio.sleep(0.05)
    assert not second.done()  # waiting for the first's rest
    release.set()
    decided = await asyncio.wait_for(second, 5)
    full = block_hashes(tok.encode_completion(text), BLOCK)
    mine = block_hashes(tok.encode_completion(other), BLOCK)
    assert list(decided.hashes) == list(mine)
    shared = next(i for i, (a, b) in enumerate(zip(full, mine, strict=False)) if a != b)
    assert shared > probe
    assert decided.matches[home.url].blocks == shared
    assert decided.order[0] is home and decided.reason == "prefix"


async def test_a_request_decided_as_the_rest_it_matches_settles_waits_for_that_rest_to_apply(
    router: Router, tok: LocalTokenizer
) -> None:
    """The background thread finishes an earlier prompt's rest, and its result reaches the loop, in the
    same turn of the loop as a request that matches only that prompt's leading blocks is decided, before
    the done callbacks that apply the rest to the earlier decision have run. The request must wait for
    them: deciding at once, it saw the leading blocks alone predicted where the earlier prompt went
    (family draw 700: a tenant's second user at a burst's start went to another engine and prefilled
    the tenant's system prompt again)."""
    text = document(60, 3000)
    other = text[:1500] + " and then a different short question about it"
    release = hold_back_rests(router)
    try:
        first = await router.decide(completion(text))
        home = first.order[0]
        router.commit(first, home)
        probe = len(first.hashes)
        (rest,) = router._rests.values()
        got = router._finish(rest.enc, rest.text, rest.walked)  # what the background thread computes
        core._settle_rest(rest.done, got)  # its result reaches the loop; the done callbacks are queued
        # Decided in this task, at once (a new task would be queued behind the callbacks).
        decided = await router.decide(completion(other))
        full = block_hashes(tok.encode_completion(text), BLOCK)
        mine = block_hashes(tok.encode_completion(other), BLOCK)
        shared = next(i for i, (a, b) in enumerate(zip(full, mine, strict=False)) if a != b)
        assert shared > probe
        assert list(first.hashes) == list(full)
        assert decided.matches[home.url].blocks == shared
        assert decided.order[0] is home and decided.reason == "prefix"
    finally:
        release.set()


def busy_background(router: Router, jobs: int) -> threading.Event:
    """Fill the background thread with ``jobs`` jobs that wait for the returned event."""
    release = threading.Event()
    assert all(router.work.submit_background(release.wait, 10) is not None for _ in range(jobs))
    return release


async def test_a_request_does_work_still_queued_in_the_background_itself(
    router: Router, tok: LocalTokenizer
) -> None:
    """The background thread is busy: the first request's rest waits there. The next turn needs it now,
    so it takes that work over (cancels the queued job) instead of waiting behind the backlog, and
    completes the first decision before its own lookup: it sees the whole shared prompt predicted where
    the first one went (in a burst, a same-document request would otherwise see two blocks there, and
    go elsewhere to recompute them)."""
    release = busy_background(router, 1)
    try:
        text = document(6, 3000)
        turn = text + " and then the user asks one more short question about it"
        first = await router.decide(completion(text))
        router.commit(first, first.order[0])
        assert counter(router) == 1 and len(router._rests) == 1
        second = await asyncio.wait_for(router.decide(completion(turn)), 5)
        full = block_hashes(tok.encode_completion(text), BLOCK)
        assert list(first.hashes) == list(full)  # completed by the second request's work
        assert list(second.hashes) == list(block_hashes(tok.encode_completion(turn), BLOCK))
        assert second.order[0] is first.order[0] and second.reason == "prefix"
        assert second.matches[first.order[0].url].blocks == len(full)
        await asyncio.sleep(0)
        assert not router._rests  # the queued job was cancelled, not run later for nothing
    finally:
        release.set()


async def test_with_a_backlog_in_the_background_the_rest_waits_for_a_request_that_needs_it(
    router: Router, tok: LocalTokenizer
) -> None:
    """The background thread has its fill of work: a cold prompt is still routed on its leading blocks
    at once (not made to wait for its own hashing); its rest is kept, unhashed, and the next request
    that needs it hashes it (here: a second question about the same new document)."""
    release = busy_background(router, router.settings.large_prompt_queue)
    try:
        text = document(7, 3000)
        decision = await router.decide(completion(text))
        assert (counter(router, "skipped"), counter(router, "deferred")) == (1, 0)
        full = block_hashes(tok.encode_completion(text), BLOCK)
        assert 0 < len(decision.hashes) < len(full) // 10
        assert decision.request is not None and decision.request.blocks == decision.prompt_tokens // BLOCK
        router.commit(decision, decision.order[0])
        (rest,) = router._rests.values()
        assert rest.job is None and not rest.done.done()
        other = text + " and what does the second paragraph say about it, in short"
        second = await asyncio.wait_for(router.decide(completion(other)), 5)
        assert list(decision.hashes) == list(full)
        assert decision.prompt_tokens == len(tok.encode_completion(text))
        assert second.order[0] is decision.order[0] and second.reason == "prefix"
        assert not router._rests
    finally:
        release.set()


async def test_unhashed_rests_nobody_asks_for_are_bounded(router: Router) -> None:
    from kvstrata.router import core

    release = busy_background(router, router.settings.large_prompt_queue)
    try:
        decisions = [
            await router.decide(completion(document(100 + k, 600))) for k in range(core._MAX_RESTS + 5)
        ]
        assert len(router._rests) == core._MAX_RESTS
        await asyncio.sleep(0)
        # The oldest were dropped: their decisions stay on their leading blocks.
        assert all(len(d.hashes) < 20 for d in decisions[:5])
    finally:
        release.set()


async def test_a_prompt_an_engine_holds_the_start_of_is_hashed_in_full_first(
    router: Router, tok: LocalTokenizer
) -> None:
    """Another router replica (or a restart) sent this document: the engines' events know its blocks,
    this router's chunk cache does not. The match may go on past the probe, so nothing is cut short."""
    text = document(3, 3000)
    ids = tok.encode_completion(text)
    full = block_hashes(ids, BLOCK)
    holder = router.pool.all()[2]
    router.index.predict(holder.url, full[:200], ttl=600)
    decision = await router.decide(completion(text))
    assert counter(router) + counter(router, "skipped") == 0 and not router._rests
    assert list(decision.hashes) == list(full)
    assert decision.order[0] is holder and decision.matches[holder.url].blocks == 200


async def test_a_short_prompt_is_hashed_in_full(router: Router, tok: LocalTokenizer) -> None:
    text = document(4, 200)  # under the inline limit: cheaper to encode than to probe
    decision = await router.decide(completion(text))
    assert counter(router) == 0
    assert list(decision.hashes) == list(block_hashes(tok.encode_completion(text), BLOCK))


async def test_a_conversation_opened_on_leading_blocks_ends_at_its_full_prompt(tok: LocalTokenizer) -> None:
    """The conversation bound's tip of a prompt routed on its leading blocks moves to its last block
    once it is hashed, so the next turn is a follow-up (never bounded), not a new conversation."""
    settings = RouterSettings.model_validate(
        {"model": "m", "blockSize": BLOCK, "remoteTokenize": False, "conversationBound": True}
    )
    r = Router(settings, RouterMetrics(), tokenizer=tok)
    r.pool.replace([EndpointSpec(u) for u in URLS])
    text = document(4, 3000)
    first = await r.decide(completion(text))
    leading_tip = first.hashes[-1]
    r.commit(first, first.order[0])
    await rest_done(r)
    assert r.tracker is not None  # fed for the bound
    tips = r.tracker.tips
    assert list(tips) == [first.hashes[-1]] and leading_tip not in tips
    turn = text + " and then the user asks one more short question about it"
    second = await r.decide(completion(turn))
    assert r.tracker.continued_tip(second.hashes) == first.hashes[-1]
    r.commit(second, second.order[0])
    assert r.tracker.live_on(first.order[0].url, second.request.now) == 1
    r.close()
