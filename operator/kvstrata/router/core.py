"""The routing brain: prompt → block hashes → index lookup → policy → ranked endpoints.

Everything here runs on the event loop except tokenization and hashing of long prompts, which go to a
small thread pool (``tokenizers`` and ``hashlib`` release the GIL), so the data path never blocks for
long. Short prompts are tokenized inline: the hop to the pool and back costs more CPU than encoding
them (measured: ~130 µs inline vs ~260 µs through the pool for a 350-character prompt).
"""

from __future__ import annotations

import asyncio
import logging
import time
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, NamedTuple, TypeVar

import aiohttp
from mypy_extensions import mypyc_attr

from kvstrata.api.router_config import RouterSettings
from kvstrata.router.admission import Gate, GateDeps
from kvstrata.router.conversations import (
    ConversationBoundFilter,
    ConversationTracker,
    StickyConversationFilter,
    fair_share_cap,
)
from kvstrata.router.decision import Decision
from kvstrata.router.hashing import block_hashes, char_block_hashes, check_algo
from kvstrata.router.incremental import Encoded, PromptEncoder, WalkView
from kvstrata.router.index import BlockIndex, PrefixMatch
from kvstrata.router.metrics import RouterMetrics
from kvstrata.router.outlier import OutlierDetector
from kvstrata.router.policies import POLICIES
from kvstrata.router.pool import Endpoint, EndpointPool
from kvstrata.router.prompts import ChatTemplateError, LocalTokenizer, chat_template_kwargs
from kvstrata.router.reasons import Reason
from kvstrata.router.requests import ParsedRequest
from kvstrata.router.scoring import (
    EXPLAIN_AFTER_BOUNDED,
    EXPLAIN_BEFORE_BOUNDED,
    BoundedLoadFilter,
    FitScorer,
    NativePick,
    Outcome,
    Ranked,
    RecentScorer,
    RouteRequest,
    Scorer,
    ShareBoundFilter,
    build_scorers,
    hooked,
    picker,
)
from kvstrata.router.workpool import PoolBusy, WorkPools

__all__ = ["Decision", "NoEndpoints", "Router"]

log = logging.getLogger("kvstrata.router.route")
_S = TypeVar("_S")

# Prompts up to this many blocks are hashed inline: cheaper than a thread hop.
_INLINE_HASH_BLOCKS = 8
# Completion prompts up to this many characters are tokenized inline (a few hundred µs at most).
_INLINE_TOKENIZE_CHARS = 1024
_INLINE_CHARS = 16_384
# Completion prompts up to this many characters look up their cached chunks on the loop (~1 µs per
# 1,000 characters); longer ones do all their work in the pool.
_INLINE_WALK_CHARS = 1 << 20
_TOKEN_CACHE_SIZE = 4096
_TOKEN_CACHE_MAX_CHARS = 32_768  # bounds the cache at ~128 MiB of prompt text
_REMOTE_TOKENIZE_BACKOFF_S = 60.0
# A long new stretch of a completion prompt is first tokenized this far, per token of block size (a
# safe cut at or after it: about two blocks at ~4 characters per token), and routed on that if no
# engine holds those blocks. Whether anyone does is exact at any length; longer only costs more.
_PROBE_CHARS_PER_BLOCK_TOKEN = 8
_MIN_PROBE_CHARS = 256
# Rests of prompts routed on their leading blocks kept until hashed: the background thread's few, and
# those it had no room for, which the next request that needs one hashes (the oldest go first).
_MAX_RESTS = 64
# Predictions cover at most a prompt's first this many blocks (256K tokens at block size 32): writing
# a 4 MB prompt's 32K blocks into the index would hold the event loop ~10 ms; a prefix match is
# capped here until the engine's events confirm the rest.
_MAX_PREDICTED_BLOCKS = 8192


class NoEndpoints(Exception):
    pass


def _settle_rest(
    done: asyncio.Future[tuple[int, array[int]]], got: tuple[int, array[int]] | BaseException
) -> None:
    if done.done():  # cancelled (dropped unasked), or already settled
        return
    if isinstance(got, BaseException):
        done.set_exception(got)
    else:
        done.set_result(got)


@dataclass(frozen=True, slots=True)
class _Ranking:
    ranked: list[Ranked]
    dropped: list[Endpoint]  # by any bound, least loaded first: retries if all else fails
    over_load: list[Endpoint]  # dropped by the in-flight bound
    over_share: list[Endpoint]  # dropped by the share bound
    over_conversations: list[Endpoint]  # dropped by the conversation bound
    sticky: bool = False  # a follow-up kept on its conversation's engine, the others dropped


@dataclass(slots=True)
class _Rest:
    """The rest of a prompt routed on its leading blocks: hashed on the background thread, or by the next
    request that needs it first (:meth:`Router._take_over`), whichever starts first."""

    enc: PromptEncoder[Any]  # the completion or the rendered-chat encoder
    text: str
    walked: WalkView
    done: asyncio.Future[tuple[int, array[int]]]  # (tokens, hashes) of the whole prompt
    job: Future[None] | None = None  # queued on the background thread (None: it had a backlog)
    taken: bool = False  # a request is hashing it on its own path


class Hashed(NamedTuple):
    """A prompt's block hashes as the router routes on them."""

    hashes: array[int]
    approximate: bool  # character blocks, not the engine's token blocks
    tokens: int | None  # prompt tokens (None for character blocks); an estimate while ``rest`` is set
    # Set: only the prompt's leading blocks are in ``hashes``; (tokens, hashes) of the whole prompt, being
    # computed after the decision.
    rest: asyncio.Future[tuple[int, array[int]]] | None = None


@mypyc_attr(allow_interpreted_subclasses=True)
class Router:
    def __init__(
        self,
        settings: RouterSettings,
        metrics: RouterMetrics,
        session: aiohttp.ClientSession | None = None,
        tokenizer: LocalTokenizer | None = None,
    ) -> None:
        check_algo(settings.hash_algo)
        self.settings = settings
        self.metrics = metrics
        self.session = session
        self.pool = EndpointPool()
        self.index = BlockIndex(settings.max_index_blocks)
        # Character-block routes are only our own predictions, remembered for approx_ttl_seconds.
        self.approx = BlockIndex(max(1, settings.max_index_blocks // 4))
        if tokenizer is None and settings.tokenizer:
            tokenizer = LocalTokenizer(settings.tokenizer)
        self.tokenizer = tokenizer
        if isinstance(tokenizer, LocalTokenizer):
            # Proved and self-tested now, not in the first requests' routing time.
            for specials in (True, False):
                enc = tokenizer.incremental(specials, settings.block_size, settings.hash_algo)
            log.info("incremental tokenization: %s", enc.reason)
        self.work = WorkPools(
            settings.tokenizer_threads, settings.large_prompt_chars, settings.large_prompt_queue
        )
        self.outlier = OutlierDetector(settings, metrics.ejected_by, lambda: len(self.pool))
        self.chunk_chars = settings.approx_chunk_chars or 4 * settings.block_size
        self.scorers: list[tuple[Scorer, float]] = build_scorers(settings)
        self.pick = picker(self.scorers)
        self._on_routed = hooked(self.scorers, "on_routed")
        self._on_hashed = hooked(self.scorers, "on_hashed")
        if not isinstance(self.pick, NativePick):
            log.info("ranking in Python: a weighted scorer has no native twin (a plugin or a subclass)")
        self.bounded = BoundedLoadFilter(settings.bounded_load_factor, settings.bounded_load_slack)
        self.share = ShareBoundFilter(
            settings.share_bound_factor,
            settings.share_bound_slack,
            settings.fit_window_seconds,
            self.over_pool,
        )
        # Live conversations per engine: fed only for the features that read them.
        self.tracker = (
            ConversationTracker(settings.fit_window_seconds)
            if settings.conversation_bound
            or settings.projected_fit
            or settings.sticky_conversations
            or settings.admission.steal_keeps_conversations_even
            else None
        )
        self.conversations = ConversationBoundFilter(self.tracker if settings.conversation_bound else None)
        self.sticky = StickyConversationFilter(self.tracker if settings.sticky_conversations else None)
        self.policy = POLICIES[settings.policy](self)
        adm = settings.admission
        self.gate = Gate(
            adm,
            adm.max_hold_seconds or settings.first_byte_timeout_seconds / 3,
            GateDeps(
                lookup=self.index.lookup,
                tiers=settings.tier_weights,
                block_size=settings.block_size,
                usable=self._in_rotation,
                silent=lambda ep: not self.heard(ep, time.monotonic()),
                endpoints=self.pool.all,
                indexed_blocks=lambda ep: self.index.blocks_of(ep.url),
                commit=self.commit,
                moved=self._moved,
                spare_room=self._spare_room,
                crowded=self._crowded,
            ),
            surviving=settings.surviving_match,
        )
        self._token_cache: OrderedDict[str, tuple[int, array[int]]] = OrderedDict()
        # Rests of prompts routed on their leading blocks, by the probe's last block hash, until hashed.
        self._rests: OrderedDict[int, _Rest] = OrderedDict()
        self._remote_off_until = 0.0
        self.pool.subscribe(lambda ep: None, self._forget)
        metrics.bind_index(lambda: len(self.index), lambda: self.index.evictions)
        metrics.held.set_function(self.gate.held)
        metrics.bind_endpoints(
            lambda: len(self.pool.healthy()),
            lambda: len(self.pool) - len(self.pool.healthy()),
            lambda: sum(1 for ep in self.pool.all() if self.outlier.ejected(ep)),
        )

    def close(self) -> None:
        self.work.shutdown()

    def _forget(self, ep: Endpoint) -> None:
        if ep.url not in self.pool:
            self.outlier.forget(ep.url)
        self.index.drop_endpoint(ep.url)
        self.approx.drop_endpoint(ep.url)
        for scorer, _ in self.scorers:
            scorer.on_removed(ep)
        self.share.on_removed(ep)
        if self.tracker is not None:
            self.tracker.forget(ep.url)

    def _scorer(self, kind: type[_S]) -> _S | None:
        return next((s for s, _ in self.scorers if isinstance(s, kind)), None)

    def recent_requests(self, ep: Endpoint, now: float) -> float:
        """Routed requests sent to ``ep`` lately, as the recent scorer counts them (0 without one)."""
        recent = self._scorer(RecentScorer)
        return 0.0 if recent is None else recent.recent_requests(ep, now)

    def over_pool(self, ep: Endpoint, now: float) -> bool:
        """``ep`` was routed more distinct blocks lately than its pool holds, as the fit scorer counts
        them (False without one)."""
        fit = self._scorer(FitScorer)
        return fit is not None and fit.over_pool(ep, now)

    def _spare_room(self, ep: Endpoint, blocks: int, now: float) -> bool:
        """Whether ``blocks`` more fit in ``ep``'s pool beside its recent demand (the fit scorer's; no
        such scorer, or an unknown pool: no)."""
        fit = self._scorer(FitScorer)
        return fit is not None and fit.fits(ep, now, blocks)

    def _in_rotation(self, ep: Endpoint) -> bool:
        return ep.healthy and not self.outlier.ejected(ep)

    def _crowded(self, ep: Endpoint, now: float) -> bool:
        """Whether one more live conversation on ``ep`` (one counted elsewhere, moving there) would pass
        its fair share of the N live ones over the engines in rotation (the conversation bound's cap;
        False while conversations are not tracked)."""
        tracker = self.tracker
        if tracker is None:
            return False
        engines = sum(map(self._in_rotation, self.pool.all()))
        return engines > 0 and tracker.live_on(ep.url, now) + 1 > fair_share_cap(
            tracker.live_total(now), engines
        )

    def mark_down(self, ep: Endpoint) -> None:
        """An engine that refuses connections lost its cache (or will have when it is back)."""
        if ep.healthy:
            log.warning("endpoint %s down; dropping its index entries", ep.url)
        ep.healthy = False
        self._forget(ep)

    def tokenizer_state(self) -> dict[str, Any] | None:
        """For /kvstrata/state: whether prompts are cut (and why or why not), and the chunk cache."""
        if not isinstance(self.tokenizer, LocalTokenizer):
            return None
        s = self.settings
        return {
            "completion": self.tokenizer.incremental(True, s.block_size, s.hash_algo).stats(),
            "chat": self.tokenizer.incremental(False, s.block_size, s.hash_algo).stats(),
        }

    # --- prompt → hashes -------------------------------------------------------------------------
    def _hash_tokens(self, ids: Sequence[int]) -> tuple[int, array[int]]:
        return len(ids), block_hashes(ids, self.settings.block_size, self.settings.hash_algo)

    def _incremental(self, text: str, add_special_tokens: bool) -> tuple[int, array[int]] | None:
        """Tokens and hashes by the incremental encoder, or None for a tokenizer without one (a
        stand-in in tests)."""
        make = getattr(self.tokenizer, "incremental", None)
        if make is None:
            return None
        s = self.settings
        return self._counted(text, make(add_special_tokens, s.block_size, s.hash_algo).encode(text))

    def _finish(self, enc: PromptEncoder[Any], text: str, walked: WalkView) -> tuple[int, array[int]]:
        return self._counted(text, enc.finish(text, walked))

    def _counted(self, text: str, got: Encoded) -> tuple[int, array[int]]:
        """``got``'s tokens and hashes, its characters counted as reused or tokenized."""
        m = self.metrics
        if got.reused_chars:
            m.prompt_chars.labels("reused").inc(got.reused_chars)
        m.prompt_chars.labels("tokenized").inc(len(text) - got.reused_chars)
        return got.tokens, got.hashes

    async def _text_hashes(self, text: str, chat: bool) -> Hashed:
        """A long completion prompt or rendered chat: the walk over cached chunks on the loop (cheap, and
        only when no tokenizer thread holds the cache), the rest on the loop too if little is new; a
        long new stretch that no engine holds the start of is routed on its leading blocks
        (:meth:`_probe`); else the rest in the pool sized by what is new: an extending prompt costs what
        its new tail costs."""
        tok = self.tokenizer
        if isinstance(tok, LocalTokenizer) and len(text) <= _INLINE_WALK_CHARS:
            s = self.settings
            enc = tok.incremental(not chat, s.block_size, s.hash_algo)
            walked = enc.walk(text, blocking=False)
            if walked is not None and len(text) - walked.pos > _INLINE_TOKENIZE_CHARS * 2:
                probed = self._probe(enc, text, walked)
                if isinstance(probed, Hashed):
                    return probed
                if probed is not None:
                    await self._take_over(probed)
                    walked = enc.walk(text, blocking=False)
            if walked is not None:
                new = len(text) - walked.pos
                if new <= _INLINE_TOKENIZE_CHARS * 2:
                    n, hashes = self._finish(enc, text, walked)
                else:
                    n, hashes = await self._offload(new, self._finish, enc, text, walked)
                return Hashed(hashes, False, n)
        n, hashes = await self._offload(
            len(text), self._hash_rendered if chat else self._hash_completion, text
        )
        return Hashed(hashes, False, n)

    def _probe(self, enc: PromptEncoder[Any], text: str, walked: WalkView) -> Hashed | _Rest | None:
        """Route a long new stretch on its first blocks (~2: :data:`_PROBE_CHARS_PER_BLOCK_TOKEN`) when no
        engine holds them.

        Chained hashes make a prefix match stop at the first block an engine lacks, so if no engine
        (nor any prediction) holds every block of the probe, no engine holds anything after it: the
        rest cannot change the matches, and tokenizing it first would only delay the request (the
        engine tokenizes it again anyway). The decision uses the probe's hashes and a token count
        extrapolated from it; the rest is hashed on the background thread after the decision, off the
        request's path, and completes it (:meth:`_hashed_later`): the prediction, the fit scorer's
        demand, the chunk cache for the next turn.

        Else: the earlier request's rest that hashes this same stretch, if one is under way, or None
        (hash the rest first: someone holds the whole probe, no cut can be made there, or the background
        thread has a backlog)."""
        chars = max(_MIN_PROBE_CHARS, _PROBE_CHARS_PER_BLOCK_TOKEN * self.settings.block_size)
        probe = enc.probe(text, walked, chars)
        if probe is None or len(probe.hashes) <= len(walked.hashes):
            return None
        key = probe.hashes[-1]  # chained: the identity of everything up to the probe's end
        held = max((m.blocks for m in self.index.lookup(probe.hashes).values()), default=0)
        if held >= len(probe.hashes):
            return self._rests.get(key)
        per_char = (probe.tokens - walked.tokens) / (probe.chars - walked.pos)
        estimate = probe.tokens + round((len(text) - probe.chars) * per_char) + len(enc.suffix)
        loop = asyncio.get_running_loop()
        rest = _Rest(enc, text, walked, loop.create_future())
        # On the background thread: nothing waits for this work, so it must not take pool threads from
        # the requests that do. With a backlog there, it waits for the next request that needs it
        # (:meth:`_take_over`), if one comes.
        rest.job = self.work.submit_background(self._hash_rest, rest, loop)
        self.metrics.routed_on_leading_blocks.labels("skipped" if rest.job is None else "deferred").inc()
        self._rests[key] = rest
        rest.done.add_done_callback(lambda f: self._rest_done(key, f))
        while len(self._rests) > _MAX_RESTS:  # unhashed rests nobody asked for, oldest first
            _, old = self._rests.popitem(last=False)
            old.done.cancel()
        return Hashed(probe.hashes, False, estimate, rest=rest.done)

    def _hash_rest(self, rest: _Rest, loop: asyncio.AbstractEventLoop) -> None:
        """On the background thread: hash ``rest`` and settle it on the loop (a request that takes the
        work over first cancels this job before it starts; a settled rest ignores a late result)."""
        try:
            got: tuple[int, array[int]] | BaseException = self._finish(rest.enc, rest.text, rest.walked)
        except Exception as exc:  # handed to the loop, like a result
            got = exc
        loop.call_soon_threadsafe(_settle_rest, rest.done, got)

    async def _take_over(self, rest: _Rest) -> None:
        """This request's prompt shares a stretch with an earlier one routed on its leading blocks, whose
        rest is not hashed yet (its prediction is what holds the probe). This request needs it now: it
        hashes it on its own path if nobody has started (cancelling the queued background job), else
        waits for whoever did. Either way the earlier decision is completed first (its prediction then
        covers the whole stretch, so this request sees where it will be cached), and the chunks are
        cached for this request's walk."""
        if not rest.taken and (rest.job is None or rest.job.cancel()):
            rest.taken = True
            try:
                new = len(rest.text) - rest.walked.pos
                got: tuple[int, array[int]] | BaseException = await self._offload(
                    new, self._finish, rest.enc, rest.text, rest.walked
                )
            except Exception as exc:  # PoolBusy, a tokenizer error: waiters go on without it
                got = exc
            _settle_rest(rest.done, got)
        # Returns after the callbacks added before this wait: the earlier decision's completion first.
        await asyncio.wait([rest.done])

    def _pending_rest(self, hashes: array[int], matches: dict[str, PrefixMatch]) -> _Rest | None:
        """The earlier prompt whose leading blocks are all this one matches anywhere, if its rest is still
        being hashed, or hashed but not yet applied to its decision (its result reached the loop in the
        turn this request is decided in, before the done callbacks ran): once applied, its prediction may
        cover much more of this prompt.

        :meth:`_probe` finds it only while this prompt's walk stops before the probe's end; the
        background thread caches chunks as it goes, so in a burst the walk often runs past it and this
        prompt is hashed in full on its own. Seen in family draw 321: two users of one tenant 8 ms apart,
        the second hashed to 33 blocks and saw 2 of them where the first was going, so the load scorers
        sent it to another engine to prefill the tenant's 30-block system prompt again."""
        if not self._rests:  # the common case: nothing routed on its leading blocks is being hashed
            return None
        best = max((m.blocks for m in matches.values()), default=0)
        if not 0 < best < len(hashes):
            return None
        # A rest leaves _rests in its first done callback; the one that applies it runs right after.
        return self._rests.get(hashes[best - 1])

    def _rest_done(self, key: int, done: asyncio.Future[tuple[int, array[int]]]) -> None:
        rest = self._rests.get(key)
        if rest is not None and rest.done is done:
            del self._rests[key]
        if not done.cancelled() and done.exception() is not None:  # retrieved: not logged as lost
            log.debug("hashing the rest of a prompt failed: %r", done.exception())

    def _hash_completion(self, text: str) -> tuple[int, array[int]]:
        assert self.tokenizer is not None
        return self._incremental(text, True) or self._hash_tokens(self.tokenizer.encode_completion(text))

    def _hash_rendered(self, rendered: str) -> tuple[int, array[int]]:
        """A rendered chat conversation: it extends the previous turn's, so the same cut as a completion
        prompt, on the rendered text (the engine encodes it without special tokens)."""
        assert self.tokenizer is not None
        return self._incremental(rendered, False) or self._hash_tokens(
            self.tokenizer.encode_rendered(rendered)
        )

    async def _offload(self, size: int, fn: Any, *args: Any) -> Any:
        return await self.work.run(size, fn, *args)

    async def _compute(self, inline: bool, size: int, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` on the loop when it is cheap (``inline``), else in the pool for its ``size``."""
        return fn(*args) if inline else await self._offload(size, fn, *args)

    async def prompt_hashes(self, req: ParsedRequest, candidates: Sequence[Endpoint]) -> Hashed:
        """Engine hashes when tokens can be had, else character blocks (every such fallback is counted
        by cause)."""
        bs = self.settings.block_size
        if req.token_ids is not None:
            ids = req.token_ids
            n, hashes = await self._compute(len(ids) <= _INLINE_HASH_BLOCKS * bs, 0, self._hash_tokens, ids)
            return Hashed(hashes, False, n)
        if self.tokenizer is not None:
            try:
                if req.text is not None:
                    # Only short prompts are kept (hashing a long one for the lookup costs more).
                    short = len(req.text) <= _TOKEN_CACHE_MAX_CHARS
                    cached = self._token_cache.get(req.text) if short else None
                    if cached is not None:
                        self._token_cache.move_to_end(req.text)
                        return Hashed(cached[1], False, cached[0])
                    if len(req.text) <= _INLINE_TOKENIZE_CHARS:
                        n, hashes = self._hash_completion(req.text)
                        got = Hashed(hashes, False, n)
                    else:
                        got = await self._text_hashes(req.text, chat=False)
                    if short and got.rest is None:
                        assert got.tokens is not None
                        self._keep_tokens(req.text, got.tokens, got.hashes)
                    return got
                assert req.messages is not None
                # Rendering is one template pass (0.1 ms for a 512K-character message, measured: string
                # joins); the long work is tokenizing, which a long cold conversation defers like a
                # completion prompt.
                kwargs = chat_template_kwargs(req.body)
                render = partial(self.tokenizer.render_chat, req.messages, **kwargs)
                rendered: str = await self._compute(req.size <= _INLINE_WALK_CHARS, req.size, render)
                if len(rendered) <= _INLINE_TOKENIZE_CHARS:
                    n, hashes = self._hash_rendered(rendered)
                    return Hashed(hashes, False, n)
                return await self._text_hashes(rendered, chat=True)
            except PoolBusy:
                return await self._fallback(req, "large_prompt_busy")
            except ChatTemplateError as exc:
                log.debug("chat template failed, falling back: %s", exc)
                return await self._fallback(req, "chat_template")
            except Exception as err:  # the Rust tokenizer raises plain Exceptions; never fail a request on it
                log.warning("tokenization failed, falling back to character blocks: %s", err)
                return await self._fallback(req, "tokenize_error")
        if (
            self.settings.remote_tokenize
            and self.session is not None
            and time.monotonic() >= self._remote_off_until
        ):
            remote = await self._remote_tokens(req, candidates)
            if remote is not None:
                n, hashes = await self._compute(
                    len(remote) <= _INLINE_HASH_BLOCKS * bs, 0, self._hash_tokens, remote
                )
                return Hashed(hashes, False, n)
            return await self._fallback(req, "remote_tokenize_failed")
        if self.settings.remote_tokenize and self.session is not None:
            return await self._fallback(req, "remote_tokenize_unavailable")
        return await self._fallback(req, "no_tokenizer")

    def _keep_tokens(self, text: str, tokens: int, hashes: array[int]) -> None:
        self._token_cache[text] = (tokens, hashes)
        if len(self._token_cache) > _TOKEN_CACHE_SIZE:
            self._token_cache.popitem(last=False)

    async def _fallback(self, req: ParsedRequest, reason: str) -> Hashed:
        self.metrics.fallbacks.labels(reason).inc()
        text = req.routing_text()
        # Size 0: the small pool, never refused (a hash over the text, bounded by maxPromptChars).
        hashes = await self._compute(len(text) <= _INLINE_CHARS, 0, char_block_hashes, text, self.chunk_chars)
        return Hashed(hashes, True, None)

    async def _remote_tokens(self, req: ParsedRequest, candidates: Sequence[Endpoint]) -> list[int] | None:
        assert self.session is not None
        if not candidates:
            return None
        ep = min(candidates, key=lambda e: e.load)
        body: dict[str, Any] = {"model": req.model}
        if req.text is not None:
            body["prompt"] = req.text
        else:
            body["messages"] = req.messages
            body.update(chat_template_kwargs(req.body))
        try:
            timeout = aiohttp.ClientTimeout(total=self.settings.connect_timeout_seconds * 2)
            async with self.session.post(ep.url + "/tokenize", json=body, timeout=timeout) as resp:
                if resp.status in (400, 413, 422):
                    return None  # this prompt was refused (e.g. too long); the engine will say why
                data = await resp.json(content_type=None) if resp.status == 200 else None
        except (aiohttp.ClientConnectionError, TimeoutError) as exc:
            # Transient (that engine is busy or gone): try again on the next request.
            log.debug("remote tokenize on %s failed: %s", ep.url, exc)
            return None
        except (aiohttp.ClientError, ValueError) as garbage:
            data = None
            log.debug("remote tokenize on %s answered garbage: %s", ep.url, garbage)
        tokens = data.get("tokens") if isinstance(data, dict) else None
        if not isinstance(tokens, list):
            # Not a vLLM /tokenize (404, other server, bad body): stop paying a round trip per request.
            log.info(
                "engine %s has no usable /tokenize; character-block routing for %.0fs",
                ep.url,
                _REMOTE_TOKENIZE_BACKOFF_S,
            )
            self._remote_off_until = time.monotonic() + _REMOTE_TOKENIZE_BACKOFF_S
            return None
        return tokens

    # --- decisions -------------------------------------------------------------------------------
    def candidates(self) -> list[Endpoint]:
        """Endpoints not ejected (:class:`AllEjected` if all are), the healthy ones first choice."""
        eps = self.outlier.available(self.pool.all())
        healthy = [ep for ep in eps if ep.healthy]
        # Health is a belief; if every endpoint looks down, still try them rather than refuse.
        return healthy or eps

    async def decide(self, req: ParsedRequest, session_id: str | None = None) -> Decision:
        t0 = time.perf_counter()
        eps = self.candidates()
        if not eps:
            raise NoEndpoints("no engine endpoints are known to the router")
        decision = await self.policy.decide(req, eps, session_id)
        self.metrics.decided(decision.reason)
        self.metrics.routing_seconds.observe(time.perf_counter() - t0)
        return decision

    def prefix_key(self, req: ParsedRequest) -> bytes:
        if req.token_ids is not None:
            n = self.settings.block_size * self.settings.prefix_hash_blocks
            return b",".join(str(t).encode() for t in req.token_ids[:n])
        return req.routing_text()[: self.chunk_chars * self.settings.prefix_hash_blocks].encode()

    async def kv_aware(self, req: ParsedRequest, eps: list[Endpoint], session_id: str | None) -> Decision:
        got = await self.prompt_hashes(req, eps)
        hashes, approximate, n_tokens = got.hashes, got.approximate, got.tokens
        if n_tokens is not None and got.rest is None:  # else counted exactly once the rest is hashed
            self.metrics.prompt_tokens.inc(n_tokens)
        blocks = None if got.rest is None or n_tokens is None else n_tokens // self.settings.block_size
        matches = (self.approx if approximate else self.index).lookup(hashes)
        pending = None if approximate or got.rest is not None else self._pending_rest(hashes, matches)
        if pending is not None:
            await self._take_over(pending)
            matches = self.index.lookup(hashes)
            log.debug(
                "waited for an earlier prompt's rest: now matches %s",
                {u: m.blocks for u, m in matches.items()},
            )
        tie_key = hashes[0].to_bytes(8, "big") if hashes else self.prefix_key(req)
        scored = matches
        if self.settings.surviving_match and not approximate:
            scored = self.gate.surviving_matches(matches, hashes, eps)
        room = {} if scored or approximate else {ep.url: self.index.blocks_of(ep.url) for ep in eps}
        history = {} if scored or approximate else self.index.history(hashes)
        rreq = RouteRequest(
            hashes,
            scored,
            tie_key,
            session_id,
            approximate,
            room,
            history,
            n_tokens,
            time.monotonic(),
            blocks,
        )
        if self.settings.copy_with_room:
            rreq.with_room = self._with_room(rreq, eps)
        if self.settings.projected_fit and self.tracker is not None and not approximate:
            rreq.growth = self.tracker.next_turn_growth([ep.url for ep in eps], rreq.now, hashes)
        ranking = self._rank(rreq, eps)
        ranked = ranking.ranked
        order = [r.endpoint for r in ranked] + ranking.dropped  # dropped: a retry if all else fails
        reason = self._reason(ranking, scored, approximate)
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "route reason=%s blocks=%d%s approx=%s -> %s | %s",
                reason,
                len(hashes),
                "" if blocks is None else f" (leading; ~{blocks} in all)",
                approximate,
                ranked[0].endpoint.url,
                "; ".join(
                    f"{r.endpoint.url} total={r.total:.3f} "
                    + " ".join(f"{k}={v:.3f}" for k, v in r.scores.items())
                    + f" match={matches.get(r.endpoint.url, PrefixMatch(0)).blocks}"
                    + (
                        f" survives={scored.get(r.endpoint.url, PrefixMatch(0)).blocks}"
                        if scored is not matches
                        else ""
                    )
                    + (f" growth={g:.1f}" if (g := rreq.growth.get(r.endpoint.url)) else "")
                    for r in ranked
                ),
            )
        decision = Decision(
            order, reason, hashes, approximate, matches, n_tokens, ranked, request=rreq, sticky=ranking.sticky
        )
        if got.rest is not None:
            got.rest.add_done_callback(lambda task: self._hashed_later(decision, req.text, task))
        return decision

    def _hashed_later(
        self, decision: Decision, text: str | None, task: asyncio.Future[tuple[int, array[int]]]
    ) -> None:
        """The rest of a prompt routed on its leading blocks is hashed: what the decision predicted and
        counted on the leading blocks now covers the whole prompt, as if it had been hashed first."""
        if task.cancelled() or task.exception() is not None:
            # Dropped unasked (the oldest of many unhashed rests), or the tokenizer failed: the leading
            # blocks stand, and the engine's events confirm the rest.
            return
        n, hashes = task.result()
        self.metrics.prompt_tokens.inc(n)
        if text is not None and len(text) <= _TOKEN_CACHE_MAX_CHARS:
            self._keep_tokens(text, n, hashes)
        leading = decision.hashes
        decision.hashes, decision.prompt_tokens = hashes, n
        if decision.request is not None:
            decision.request.hashes, decision.request.prompt_tokens = hashes, n
            decision.request.blocks = None
        self.gate.rehashed(decision)
        ep = decision.committed
        if ep is None or not decision.routed:
            return
        now = time.monotonic()
        for scorer in self._on_hashed:
            scorer.on_hashed(ep, now, hashes)
        if self.tracker is not None:
            self.tracker.rehashed(ep.url, now, leading, hashes)
        pred = decision.prediction
        if pred is not None and not pred.dead and pred.endpoint == ep.url:
            # Until the same moment as the leading blocks' prediction: the request's first token, or the
            # short TTL after it (settle re-times the prediction the decision holds, now this one).
            ttl = self.index.ttl_left(pred)
            decision.prediction = self.index.predict(ep.url, hashes[:_MAX_PREDICTED_BLOCKS], ttl)
            self.index.retime(pred, 0.0)  # the whole prompt's prediction holds the leading blocks now

    def _with_room(self, rreq: RouteRequest, eps: list[Endpoint]) -> frozenset[str]:
        """The endpoints whose pool has room for the blocks the prompt would add there, as the fit
        scorer counts demand (none without a fit scorer)."""
        fit = self._scorer(FitScorer)
        if fit is None:
            return frozenset()
        return frozenset(ep.url for ep in eps if fit.fits(ep, rreq.now, fit.added_blocks(rreq, ep)))

    def _rank(self, rreq: RouteRequest, eps: list[Endpoint]) -> _Ranking:
        """The scorers' ranking of the endpoints the load, share and conversation bounds and the sticky
        filter keep, and those they drop."""
        under_load = self.bounded.filter(rreq, eps)
        under_share = self.share.filter(rreq, under_load)
        under_conversations = self.conversations.filter(rreq, under_share)
        kept = self.sticky.filter(rreq, under_conversations)
        if len(kept) == len(eps):  # each bound keeps a subset of what it is given: here, all of it
            return _Ranking(self.pick(rreq, kept), [], [], [], [])
        return _Ranking(
            self.pick(rreq, kept),
            sorted((ep for ep in eps if ep not in kept), key=lambda ep: ep.load),
            [ep for ep in eps if ep not in under_load],
            [ep for ep in under_load if ep not in under_share],
            [ep for ep in under_share if ep not in under_conversations],
            len(kept) < len(under_conversations),
        )

    def retry_order(self, decision: Decision, left: list[Endpoint]) -> list[Endpoint]:
        """The endpoints still to try after a failed attempt, best first on the state now.

        A retry is a new choice: the first ranking's runner-up was chosen before the failure, on loads
        that have moved since, and every request cut from one engine would follow it to the same place
        (seen: four requests cut from a stopped engine all went to one engine while another sat idle).
        Decisions the scorers did not make (other policies, pass-through) keep their order.

        Engines not heard from within a first-byte period (no scrape answered, nothing streamed) go
        last whatever their rank: likely wedged, and not yet ejected."""
        live = [ep for ep in left if not self.outlier.ejected(ep)]
        if decision.request is None or len(live) < 2:
            return live
        now = time.monotonic()
        ranking = self._rank(replace(decision.request, now=now), live)
        order = [r.endpoint for r in ranking.ranked] + ranking.dropped
        return sorted(order, key=lambda ep: not self.heard(ep, now))  # stable: rank within each group

    def heard(self, ep: Endpoint, now: float) -> bool:
        """Heard from within a first-byte period (a scrape answered, a stream moving); else *silent*:
        likely wedged, not yet ejected. Retries try it last and patience treats it as gone."""
        return ep.heard_within(self.settings.first_byte_timeout_seconds, now)

    def _reason(self, ranking: _Ranking, matches: dict[str, PrefixMatch], approximate: bool) -> Reason:
        """Why the winner won: a prefix match, else the first scorer (or bound) that says it decided,
        in the order of EXPLAIN_BEFORE_BOUNDED / EXPLAIN_AFTER_BOUNDED, else the totals."""
        ranked = ranking.ranked
        win = ranked[0]
        best = max((m.blocks for m in matches.values()), default=0)
        won = matches.get(win.endpoint.url)
        if best and won is not None and won.blocks == best:
            return Reason.APPROX_PREFIX if approximate else Reason.PREFIX
        if ranking.sticky:
            return Reason.CONVERSATION
        outcome = Outcome(win, ranked[1] if len(ranked) > 1 else None, best)
        by_name = {s.name: (s, w) for s, w in self.scorers}

        def first(names: tuple[str, ...]) -> Reason | None:
            for name in names:
                scorer, weight = by_name[name]
                reason = scorer.explain(outcome, weight)
                if reason is not None:
                    return reason
            return None

        reason = first(EXPLAIN_BEFORE_BOUNDED)
        if reason is None and best:
            reason = (
                self.bounded.explain(ranking.over_load, matches)
                or self.share.explain(ranking.over_share, matches)
                or self.conversations.explain(ranking.over_conversations, matches)
            )
        reason = reason or first(EXPLAIN_AFTER_BOUNDED)
        if reason is not None:
            return reason
        if outcome.second is not None and outcome.second.total < win.total - 1e-9:
            return Reason.LOAD
        return Reason.TIE_HASH

    def commit(self, decision: Decision, ep: Endpoint) -> None:
        """Called when a request is sent to ``ep`` (or starts waiting for it, router/admission.py): it
        counts as recent traffic there, and its prompt blocks will be cached there.

        The prediction holds until the request's prefill is over (:meth:`settle`): under load a prefill
        can outlast any fixed TTL, and a prediction that expires first sends the next request of the same
        prefix elsewhere, which recomputes it (seen in `make bench-router` at TTFT > 5 s)."""
        decision.committed = ep
        if decision.routed:
            now = time.monotonic()
            hashes = () if decision.approximate else decision.hashes
            for scorer in self._on_routed:
                scorer.on_routed(ep, now, hashes)
            self.share.on_routed(ep, now)
            if self.tracker is not None:
                self.tracker.routed(ep.url, now, hashes)
        if not decision.hashes:
            return
        if decision.approximate:
            self.approx.predict(
                ep.url, decision.hashes[:_MAX_PREDICTED_BLOCKS], self.settings.approx_ttl_seconds
            )
        else:
            m = decision.matches.get(ep.url)
            decision.prediction = self.index.predict(
                ep.url,
                decision.hashes[:_MAX_PREDICTED_BLOCKS],
                self.settings.upstream_timeout_seconds,
                touched=m.blocks if m is not None else 0,  # the lookup touched those just now
            )

    def _moved(self, decision: Decision, ep: Endpoint) -> None:
        """A held request goes elsewhere than it waited for: the blocks predicted at its home will not
        come (expire them now, unless events confirmed them meanwhile)."""
        if decision.prediction is not None:
            self.index.retime(decision.prediction, 0.0)
            decision.prediction = None

    def settle(self, decision: Decision, ep: Endpoint) -> None:
        """The request's prefill is over (first token, or the attempt ended): the engine's events now
        confirm its blocks within moments, so unconfirmed predictions get the short TTL."""
        if decision.hashes and not decision.approximate:
            pred = decision.prediction
            if pred is not None and pred.endpoint == ep.url:
                self.index.retime(pred, self.settings.prediction_ttl_seconds)
            else:
                self.index.predict(
                    ep.url, decision.hashes[:_MAX_PREDICTED_BLOCKS], self.settings.prediction_ttl_seconds
                )
