"""Routing as plugins (llm-d style): filters drop endpoints, scorers rate the rest in [0, 1], a picker
combines the weighted scores into a ranking. Each piece is a few lines and tested alone.

All scorers see the same :class:`RouteRequest` (the prompt's block hashes and what the index knows
about them) and the candidate endpoints, and return one score per candidate, in order. Scorers are
registered by name (:data:`SCORERS`; the name is also the field of their weight in the settings), own
whatever state they keep (updated through the request hooks of :class:`ScorerHooks`) and explain a win
they decided as a typed :class:`Reason`.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import NamedTuple, Protocol

from mypy_extensions import mypyc_attr

from kvstrata.api.router_config import RouterSettings, TierWeights
from kvstrata.router.index import PrefixMatch
from kvstrata.router.native import Ranker, Recency
from kvstrata.router.pool import Endpoint, faded
from kvstrata.router.reasons import Reason


@dataclass(slots=True)
class RouteRequest:
    hashes: Sequence[int] = ()
    matches: dict[str, PrefixMatch] = field(default_factory=dict)
    # Stable key for tie-breaks and consistent hashing: the first block's hash (or the prompt's start).
    tie_key: bytes = b""
    session: str | None = None
    approximate: bool = False
    # Blocks the router's index holds per endpoint; filled only when no endpoint matches the prompt.
    cached_blocks: dict[str, int] = field(default_factory=dict)
    # Per endpoint, the prompt's leading blocks it holds or evicted lately (BlockIndex.history); filled
    # only when no endpoint matches the prompt.
    history: dict[str, int] = field(default_factory=dict)
    # Prompt length in tokens when the router tokenized it (None for character-block fallbacks); an
    # estimate while ``blocks`` is set.
    prompt_tokens: int | None = None
    # When the decision is made (monotonic seconds): scorers that weigh history by age read it.
    now: float = 0.0
    # The prompt's full blocks when ``hashes`` holds only the leading ones (a long stretch no engine
    # holds the start of is hashed after the decision: Router._probe); None: all hashed.
    blocks: int | None = None
    # Endpoints whose KV pool has room for the blocks this prompt would add there (FitScorer.fits);
    # filled only with ``copyWithRoom``.
    with_room: frozenset[str] = frozenset()
    # Per endpoint, the blocks its live conversations are expected to add with their next turns
    # (ConversationTracker.next_turn_growth); filled only with ``projectedFit``.
    growth: dict[str, float] = field(default_factory=dict)

    def block_count(self) -> int:
        """The prompt's full blocks (estimated while only the leading ones are hashed)."""
        return len(self.hashes) if self.blocks is None else self.blocks


class Ranked(NamedTuple):
    """An endpoint's place in a ranking (a tuple: a ranking makes one per endpoint per request)."""

    endpoint: Endpoint
    total: float
    scores: dict[str, float]


@dataclass(frozen=True, slots=True)
class Outcome:
    """A kv-aware ranking, for the scorers to say whether they decided it."""

    win: Ranked
    second: Ranked | None
    best_match: int  # most prompt blocks any endpoint holds (0: nobody holds the prompt)


class Scorer(Protocol):
    # Read-only (a property) so frozen dataclasses satisfy it.
    @property
    def name(self) -> str: ...

    def score(self, req: RouteRequest, eps: Sequence[Endpoint]) -> list[float]: ...

    def on_routed(self, ep: Endpoint, now: float, hashes: Sequence[int] = ()) -> None:
        """A routed request was sent to ``ep`` (at monotonic ``now``) with these prompt block hashes."""

    def on_hashed(self, ep: Endpoint, now: float, hashes: Sequence[int]) -> None:
        """All block hashes of a request routed to ``ep`` on its leading blocks (``on_routed`` had
        those), known now that the rest of its prompt is hashed."""

    def on_removed(self, ep: Endpoint) -> None:
        """``ep`` left the pool: forget what is kept about it."""

    def explain(self, outcome: Outcome, weight: float) -> Reason | None:
        """The reason this scorer decided ``outcome``, or None when it did not."""


@mypyc_attr(allow_interpreted_subclasses=True)
class ScorerHooks:
    """No-op hooks and no explanation: scorers without state or a reason of their own inherit these."""

    __slots__ = ()

    def on_routed(self, ep: Endpoint, now: float, hashes: Sequence[int] = ()) -> None:
        return None

    def on_hashed(self, ep: Endpoint, now: float, hashes: Sequence[int]) -> None:
        return None

    def on_removed(self, ep: Endpoint) -> None:
        return None

    def explain(self, outcome: Outcome, weight: float) -> Reason | None:
        return None


class Filter(Protocol):
    @property
    def name(self) -> str: ...

    def filter(self, req: RouteRequest, eps: Sequence[Endpoint]) -> list[Endpoint]: ...


def rendezvous(key: bytes, url: str) -> int:
    """Highest-random-weight hashing: stable across processes and router replicas."""
    return int.from_bytes(hashlib.blake2b(key + url.encode(), digest_size=8).digest(), "big")


def decisive(outcome: Outcome, name: str, weight: float) -> bool:
    """Scorer ``name`` put the winner ahead of the runner-up: it scored the winner higher, and without
    it the runner-up would have been level or ahead."""
    win, second = outcome.win, outcome.second
    if second is None:
        return False
    mine, theirs = win.scores.get(name, 0.0), second.scores.get(name, 0.0)
    return mine > theirs and second.total - weight * theirs >= win.total - weight * mine - 1e-9


def credited_blocks(m: PrefixMatch, tiers: TierWeights) -> float:
    """Matched blocks, each counted by the share of its prefill a hit in its tier saves.

    A predicted block (routed there moments ago, not yet confirmed) is credited like a GPU block:
    that is where the engine will put it."""
    return (m.gpu + m.predicted) * tiers.gpu + m.cpu * tiers.cpu + m.storage * tiers.storage


def uncached_tokens(prompt_tokens: int | None, blocks: int, credit: float, block_size: int) -> float:
    """Prompt tokens an engine must still compute, given the blocks it holds (``credit``).

    vLLM always computes the prompt's last token, so at least one token remains. Without a token count
    (character-block fallback) each of the ``blocks`` character blocks stands in for one token block."""
    if prompt_tokens is None:
        return max(blocks - credit, 0.0) * block_size
    return max(prompt_tokens - credit * block_size, 1.0)


@mypyc_attr(allow_interpreted_subclasses=True)
@dataclass(frozen=True, slots=True)
class PrefillCostScorer(ScorerHooks):
    """Prefill work ahead of this request's first token on each endpoint, in tokens (Dynamo's cost):
    the prompt tokens the endpoint does not hold, plus ``queue_weight`` × the uncached tokens of the
    requests this router sent there that have not produced a first token yet. Score = cheapest / cost.

    A share-of-prompt prefix score (:class:`PrefixScorer`) is fractional, so a load score can outvote a
    near-complete match, and a request-count bound spills a conversation off the engine that holds it
    even when everything queued there is a cache hit (measured in `make bench-router`). In tokens, a
    follow-up that saves 800 tokens of prefill stays unless 800 / queue_weight tokens of prefill are
    queued ahead of it. With chunked prefill an engine computes its queue and the new prompt in the same
    steps, so a weight of 1 is the request's own TTFT estimate; a weight below 1 adds what that estimate
    leaves out: the copy made elsewhere costs cache room there and evicts other prefixes, which later
    requests pay for (at 0.5, `make bench-router` lost 5 % hit rate to such copies). The same weight holds
    for a prompt no engine holds: counting that queue in full put a third document on an idle engine
    that already held two (then :class:`CacheRoomScorer` lost by a hair) and it evicted.

    With ``room_aware`` (``copyWithRoom``, off by default) that discount applies only where it is due.
    The cost is then scaled by 1 / ``queue_weight`` (the same ranking): the queue in full, and each
    uncached token 1 / ``queue_weight`` times, which stands for the prefixes its block evicts; at an
    engine with room for the prompt's new blocks (``RouteRequest.with_room``) a copy evicts nothing, so
    there an uncached token counts once and the cost is the TTFT estimate. With memory to spare a
    conversation then goes where its first token comes soonest; under pressure nothing changes."""

    tiers: TierWeights
    block_size: int
    queue_weight: float = 0.25
    room_aware: bool = False
    name: str = "prefill"

    def cost(self, req: RouteRequest, ep: Endpoint) -> float:
        m = req.matches.get(ep.url)
        credit = credited_blocks(m, self.tiers) if m else 0.0
        own = uncached_tokens(req.prompt_tokens, len(req.hashes), credit, self.block_size)
        if self.room_aware and self.queue_weight > 0:
            evicts = 1.0 if ep.url in req.with_room else 1.0 / self.queue_weight
            return own * evicts + ep.pending_prefill
        return own + self.queue_weight * ep.pending_prefill

    def score(self, req: RouteRequest, eps: Sequence[Endpoint]) -> list[float]:
        costs = [self.cost(req, ep) for ep in eps]
        cheapest = min(costs, default=0.0)
        return [(cheapest + 1.0) / (c + 1.0) for c in costs]

    def explain(self, outcome: Outcome, weight: float) -> Reason | None:
        # A holder exists but did not win, and the winner's prefill was cheapest: the prefill queued at
        # the holder outweighed its match.
        if outcome.best_match and outcome.win.scores.get(self.name) == 1.0:
            return Reason.QUEUE
        return None


@mypyc_attr(allow_interpreted_subclasses=True)
@dataclass(frozen=True, slots=True)
class PrefixScorer(ScorerHooks):
    """Share of the prompt's blocks an endpoint already holds, each block credited by its tier
    (llm-d's prefix scorer). Off by default: :class:`PrefillCostScorer` counts the same overlap in
    tokens against the queue."""

    tiers: TierWeights
    name: str = "prefix"

    def score(self, req: RouteRequest, eps: Sequence[Endpoint]) -> list[float]:
        total = req.block_count()
        top = max(self.tiers.gpu, self.tiers.cpu, self.tiers.storage)
        if not total or top <= 0:
            return [0.0] * len(eps)
        none = PrefixMatch(0)
        return [credited_blocks(req.matches.get(ep.url, none), self.tiers) / (total * top) for ep in eps]


@mypyc_attr(allow_interpreted_subclasses=True)
@dataclass(frozen=True, slots=True)
class LoadScorer(ScorerHooks):
    """Fewer requests running + waiting (and in flight from this router) scores higher."""

    name: str = "load"

    def score(self, req: RouteRequest, eps: Sequence[Endpoint]) -> list[float]:
        loads = [ep.load for ep in eps]
        worst = max(loads, default=0.0)
        return [1.0 - load / (worst + 1.0) for load in loads]


@mypyc_attr(allow_interpreted_subclasses=True)
@dataclass(frozen=True, slots=True)
class CacheRoomScorer(ScorerHooks):
    """A prompt no engine holds goes where the cache has most room: fewest blocks in the router's index.

    vLLM's kv_cache_usage_perc counts only blocks of running requests (cached blocks are free), so load
    alone places new prefix groups unevenly and the fullest engine evicts. This is sglang-router's
    smallest-tree rule for low-match requests. Silent (all zeros) when any endpoint matches."""

    name: str = "cache_room"

    def score(self, req: RouteRequest, eps: Sequence[Endpoint]) -> list[float]:
        if req.matches or req.history or not req.cached_blocks:
            return [0.0] * len(eps)
        blocks = [req.cached_blocks.get(ep.url, 0) for ep in eps]
        most = max(blocks, default=0)
        return [1.0 - b / (most + 1) for b in blocks]

    def explain(self, outcome: Outcome, weight: float) -> Reason | None:
        room = outcome.win.scores.get(self.name, 0.0)
        second = outcome.second
        if room > 0 and second is not None and second.scores.get(self.name, 0.0) < room:
            return Reason.CACHE_ROOM
        return None


@mypyc_attr(allow_interpreted_subclasses=True)
@dataclass(frozen=True, slots=True)
class HistoryScorer(ScorerHooks):
    """A prompt no engine holds goes back to the engine that held (and evicted) the longest part of it:
    its prefix group's home. Score = that prefix's length / the longest any endpoint had.

    Under memory pressure a group's blocks get evicted between its requests. A router that then places
    the group by room or load (:class:`CacheRoomScorer`, :class:`RecentScorer`) scatters it over every
    engine; each copy evicts another group, which scatters in turn, and the cluster caches less than
    one engine would. A text-tree router (sglang-router's cache_aware) never forgets where it sent a
    prefix, so it keeps the group at one engine. This scorer does the same from what the engines said
    they evicted (BlockIndex history), and takes the place of room and recency (both silent when it
    speaks); the prefill scorer still weighs the queue at the home against an idle engine."""

    name: str = "history"

    def score(self, req: RouteRequest, eps: Sequence[Endpoint]) -> list[float]:
        if req.matches or not req.history:
            return [0.0] * len(eps)
        longest = max(req.history.values())
        return [req.history.get(ep.url, 0) / longest for ep in eps]

    def explain(self, outcome: Outcome, weight: float) -> Reason | None:
        win, second = outcome.win, outcome.second
        if second is not None and win.scores.get(self.name, 0.0) > second.scores.get(self.name, 0.0):
            return Reason.HISTORY
        return None


@mypyc_attr(allow_interpreted_subclasses=True)
@dataclass(frozen=True, slots=True)
class FitScorer(ScorerHooks):
    """Prefer an engine whose KV pool still holds what it was recently asked for plus this prompt.

    An engine's *demand* is the distinct prompt blocks routed to it in the last ``window_s`` seconds
    (the prefix groups it serves now); its pool size comes from its metrics (``num_gpu_blocks``). A
    prompt fits where demand + the blocks it would add ≤ the pool: score 1. Where it does not fit:
    0.5 if that engine was already over its pool (it thrashes anyway: little is lost), 0 if the prompt
    would push an engine that fits into thrashing, since then every group there starts missing. Under
    memory pressure this packs prefix groups so that most engines keep theirs, instead of spreading
    them evenly until every engine evicts what its next request needs (seen in the family benchmark:
    kvstrata's index predicted 61 % cached tokens where the engines then reported 29 %, with prefix
    groups evenly spread at 3 per engine). Silent when all scores are equal or a pool size is unknown.

    With ``projectedFit`` the demand also counts what the engine's live conversations will add with
    their next turns (``RouteRequest.growth``): demand only looks back, and a pool that fits a new
    conversation now may not fit it once the conversations already there have grown a turn."""

    window_s: float
    name: str = "fit"
    # Per endpoint URL: block hash -> when it was last routed there (monotonic), oldest first (native:
    # a long prompt's thousands of blocks are touched in one call).
    demand: dict[str, Recency] = field(default_factory=dict)

    def demand_blocks(self, ep: Endpoint, now: float) -> int:
        blocks = self.demand.get(ep.url)
        return 0 if blocks is None else blocks.expire_before(now - self.window_s)

    def fits(self, ep: Endpoint, now: float, added: int) -> bool:
        """``added`` more blocks fit in ``ep``'s pool beside its demand (False while its size is unknown)."""
        return ep.kv_blocks > 0 and self.demand_blocks(ep, now) + added <= ep.kv_blocks

    @staticmethod
    def added_blocks(req: RouteRequest, ep: Endpoint) -> int:
        """The blocks of the prompt ``ep`` does not hold yet."""
        m = req.matches.get(ep.url)
        return req.block_count() - (m.blocks if m else 0)

    def over_pool(self, ep: Endpoint, now: float) -> bool:
        """More distinct blocks were routed to ``ep`` lately than its pool holds (it evicts its own
        groups between their requests); False while its pool size is unknown."""
        return ep.kv_blocks > 0 and self.demand_blocks(ep, now) > ep.kv_blocks

    def on_routed(self, ep: Endpoint, now: float, hashes: Sequence[int] = ()) -> None:
        blocks = self.demand.get(ep.url)
        if blocks is None:
            blocks = self.demand[ep.url] = Recency()
        # Bounded whatever the window: past a few pools' worth the answer is "over" anyway.
        blocks.touch(hashes, now, 4 * max(ep.kv_blocks, 1024))

    def on_hashed(self, ep: Endpoint, now: float, hashes: Sequence[int]) -> None:
        self.on_routed(ep, now, hashes)

    def on_removed(self, ep: Endpoint) -> None:
        self.demand.pop(ep.url, None)

    def score(self, req: RouteRequest, eps: Sequence[Endpoint]) -> list[float]:
        if not req.hashes or any(ep.kv_blocks <= 0 for ep in eps):
            return [0.0] * len(eps)
        scores = []
        for ep in eps:
            demand = self.demand_blocks(ep, req.now)  # once: each call expires the window's old blocks
            if demand + req.growth.get(ep.url, 0.0) + self.added_blocks(req, ep) <= ep.kv_blocks:
                scores.append(1.0)
            else:
                scores.append(0.5 if demand > ep.kv_blocks else 0.0)
        return [0.0] * len(eps) if len(set(scores)) == 1 else scores

    def explain(self, outcome: Outcome, weight: float) -> Reason | None:
        return Reason.FIT if decisive(outcome, self.name, weight) else None


@mypyc_attr(allow_interpreted_subclasses=True)
@dataclass(frozen=True, slots=True)
class RecentScorer(ScorerHooks):
    """Fewer requests sent lately scores higher: a forecast of the follow-ups an engine will get.

    With prefix affinity, conversations stay where their prefix is, so an engine that served many
    requests in the last ``window_s`` seconds will soon get their next turns; a prompt placed there that
    needs a long prefill makes each of them wait for it. In-flight and queue counts miss this between
    turns (the user is reading), which is when a new document gets placed (measured in the open-loop
    `make bench-router`: the cold document went to the engine with two live conversations instead of
    the one with one, whose last request was still decoding). Silent (all zeros) when any endpoint
    matches the prompt, like :class:`CacheRoomScorer`: when two engines hold a document, the prefill
    scores of a follow-up differ only by its conversation's tail, and recent traffic outvoted that in a
    10-round closed-loop run, copying conversations and costing 4-6 points of hit rate in two rounds."""

    window_s: float
    name: str = "recent"
    # Per endpoint URL: requests sent there, each fading with time, as of the monotonic time beside it.
    sent: dict[str, tuple[float, float]] = field(default_factory=dict)

    def recent_requests(self, ep: Endpoint, now: float) -> float:
        """Requests sent to ``ep`` lately, each weighing exp(-age / window_s)."""
        value, at = self.sent.get(ep.url, (0.0, now))
        return faded(value, now - at, self.window_s)

    def on_routed(self, ep: Endpoint, now: float, hashes: Sequence[int] = ()) -> None:
        self.sent[ep.url] = (self.recent_requests(ep, now) + 1.0, now)

    def on_removed(self, ep: Endpoint) -> None:
        self.sent.pop(ep.url, None)

    def score(self, req: RouteRequest, eps: Sequence[Endpoint]) -> list[float]:
        if req.matches or req.history:
            return [0.0] * len(eps)
        recent = [self.recent_requests(ep, req.now) for ep in eps]
        most = max(recent, default=0.0)
        return [1.0 - r / (most + 1.0) for r in recent]

    def explain(self, outcome: Outcome, weight: float) -> Reason | None:
        """The winner had fewer recent requests, and without them it would not be ahead."""
        return Reason.RECENT if decisive(outcome, self.name, weight) else None


@mypyc_attr(allow_interpreted_subclasses=True)
@dataclass(frozen=True, slots=True)
class EvictsScorer(ScorerHooks):
    """A prompt no engine holds goes where the blocks its prefill would evict were used longest ago.

    vLLM's pool evicts its least recently used free blocks first, so on an engine whose pool holds
    ``kv_blocks`` a prompt adding ``n`` blocks keeps the ``kv_blocks - n`` blocks used most recently and
    evicts the rest; the newest of those is the one to weigh. Each engine's blocks are ordered by when
    this router last sent a request using them. Score = 1 - exp(-age / ``window_s``), ``age`` being how
    long ago that block was used: the share of its use that has faded, on the recent scorer's time
    scale (a request sent ``age`` ago counts exp(-age / ``window_s``) there); 1 where nothing this router
    sent would be evicted. The cluster's pools then evict together like one LRU cache, and blocks all
    used within the last moments (a burst's first prompts) score alike near 0 instead of being told
    apart by milliseconds.

    Why (family draw 338, two runs of the same code 10 points apart): five tenants on three engines
    whose pools held one tenant's system prompt each; a tenant evicted everywhere went back to its home
    (:class:`HistoryScorer`), whose pool held the prompt another tenant had used 0.7 s before, while the
    other two engines held prompts last used 8 s before. The next request of the evicted tenant missed,
    and so did the following four. Silent when the prompt matches anywhere, a pool size is unknown, or
    every engine scores alike."""

    window_s: float
    name: str = "evicts"
    # Per endpoint URL: block hash -> when a request using it was last sent there (monotonic).
    used: dict[str, Recency] = field(default_factory=dict)

    def evicted_age(self, req: RouteRequest, ep: Endpoint) -> float:
        """Seconds since the newest block ``req``'s prefill would evict on ``ep`` was used (inf: none
        this router sent there)."""
        used = self.used.get(ep.url)
        if used is None:
            return math.inf
        at = used.touched_at_rank(max(ep.kv_blocks - req.block_count(), 0))
        return math.inf if at is None else req.now - at

    def on_routed(self, ep: Endpoint, now: float, hashes: Sequence[int] = ()) -> None:
        used = self.used.get(ep.url)
        if used is None:
            used = self.used[ep.url] = Recency()
        # Past its pool's size nothing older is ever weighed.
        used.touch(hashes, now, max(ep.kv_blocks, 1024))

    def on_hashed(self, ep: Endpoint, now: float, hashes: Sequence[int]) -> None:
        self.on_routed(ep, now, hashes)

    def on_removed(self, ep: Endpoint) -> None:
        self.used.pop(ep.url, None)

    def score(self, req: RouteRequest, eps: Sequence[Endpoint]) -> list[float]:
        if req.matches or req.approximate or not req.hashes or any(ep.kv_blocks <= 0 for ep in eps):
            return [0.0] * len(eps)
        scores = [1.0 - faded(1.0, self.evicted_age(req, ep), self.window_s) for ep in eps]
        return [0.0] * len(eps) if len(set(scores)) == 1 else scores

    def explain(self, outcome: Outcome, weight: float) -> Reason | None:
        """The winner evicts older blocks, and without that it would not be ahead."""
        return Reason.EVICTS if decisive(outcome, self.name, weight) else None


@mypyc_attr(allow_interpreted_subclasses=True)
@dataclass(frozen=True, slots=True)
class KvUsageScorer(ScorerHooks):
    """Free KV cache: an engine near full evicts (and preempts) sooner."""

    name: str = "kv_usage"

    def score(self, req: RouteRequest, eps: Sequence[Endpoint]) -> list[float]:
        return [1.0 - min(max(ep.kv_usage, 0.0), 1.0) for ep in eps]


@mypyc_attr(allow_interpreted_subclasses=True)
@dataclass(frozen=True, slots=True)
class SessionScorer(ScorerHooks):
    """Requests carrying the same session id prefer the same endpoint (rendezvous hash of the id)."""

    name: str = "session"

    def score(self, req: RouteRequest, eps: Sequence[Endpoint]) -> list[float]:
        if not req.session or not eps:
            return [0.0] * len(eps)
        key = req.session.encode()
        best = max(range(len(eps)), key=lambda i: rendezvous(key, eps[i].url))
        return [1.0 if i == best else 0.0 for i in range(len(eps))]

    def explain(self, outcome: Outcome, weight: float) -> Reason | None:
        return Reason.SESSION if outcome.win.scores.get(self.name) == 1.0 else None


@mypyc_attr(allow_interpreted_subclasses=True)
@dataclass(frozen=True, slots=True)
class BoundedLoadFilter:
    """Consistent hashing with bounded loads: no endpoint takes more than ``factor`` × its fair share
    of this router's in-flight requests (counting the new one), or fair share + ``slack``, whichever is
    larger. The slack matters at low concurrency (6 in flight over 3 engines: a factor of 1.5 allows 3,
    so a conversation group spills onto engines that do not hold its prefix and misses; measured in
    `make bench-router`). Never filters everything out."""

    factor: float
    slack: int = 0
    name: str = "bounded_load"

    def filter(self, req: RouteRequest, eps: Sequence[Endpoint]) -> list[Endpoint]:
        if len(eps) < 2:
            return list(eps)
        fair = (sum(ep.in_flight for ep in eps) + 1) / len(eps)
        cap = max(math.ceil(self.factor * fair), math.floor(fair) + self.slack)
        kept = [ep for ep in eps if ep.in_flight + 1 <= cap]
        return kept or list(eps)

    def explain(self, dropped: Sequence[Endpoint], matches: dict[str, PrefixMatch]) -> Reason | None:
        """Bounded load decided when it dropped an endpoint that holds part of the prompt."""
        return Reason.BOUNDED_LOAD if any(matches.get(ep.url) for ep in dropped) else None


@mypyc_attr(allow_interpreted_subclasses=True)
@dataclass(slots=True)
class ShareBoundFilter:
    """An engine short of KV room that has taken more than ``factor`` × its fair share of the requests
    routed lately (or fair share + ``slack``, whichever is larger) gives one conversation to an engine
    with room.

    Prefix affinity places whole prefix groups, so four groups on three engines put two on one engine:
    it gets twice the requests of the others (a 1.5 max/mean split), queues, and, when its pool is short,
    evicts its own groups' blocks between their turns. Moving one conversation off it costs one prefill
    of what it reuses there, once, and the conversation stays at its new engine (that is where its
    newest blocks are). So the bound acts only when

    - the engine is *over its pool* (``over_pool``: the fit scorer's demand exceeds its KV blocks), where
      the blocks a move gives up would likely be evicted before their next use anyway (with room to
      spare a group stays together whatever the split);
    - some other engine is under the bound and not over its pool: a move between two engines that both
      evict copies the conversation into a second thrashing pool;
    - the engine has not given a request away in the last ``window_s`` seconds. Requests count
      exp(-age / ``window_s``), so the counts show a move's effect only a window later; moving again
      before that moves more conversations than the imbalance needs (seen: an engine back from an
      outage, its count near zero, got four groups in a row and held none of them).

    Never filters everything out; filters nothing while ``factor`` is None (off, the default)."""

    factor: float | None
    slack: float
    window_s: float
    over_pool: Callable[[Endpoint, float], bool]
    name: str = "share_bound"
    # Per endpoint URL: requests routed there, fading, as of the monotonic time beside it.
    sent: dict[str, tuple[float, float]] = field(default_factory=dict)
    # Per endpoint URL: when the bound last took a request away from it (monotonic).
    gave_at: dict[str, float] = field(default_factory=dict)

    def recent(self, ep: Endpoint, now: float) -> float:
        value, at = self.sent.get(ep.url, (0.0, now))
        return faded(value, now - at, self.window_s)

    def on_routed(self, ep: Endpoint, now: float) -> None:
        if self.factor is None:  # off: nothing reads the counts
            return
        self.sent[ep.url] = (self.recent(ep, now) + 1.0, now)

    def on_removed(self, ep: Endpoint) -> None:
        self.sent.pop(ep.url, None)
        self.gave_at.pop(ep.url, None)

    def filter(self, req: RouteRequest, eps: Sequence[Endpoint]) -> list[Endpoint]:
        if len(eps) < 2 or self.factor is None:
            return list(eps)
        now = req.now
        counts = [self.recent(ep, now) for ep in eps]
        fair = (sum(counts) + 1.0) / len(eps)
        cap = max(self.factor * fair, fair + self.slack)
        short = [self.over_pool(ep, now) for ep in eps]
        under = [n + 1.0 <= cap for n in counts]
        if not any(u and not s for u, s in zip(under, short, strict=True)):
            return list(eps)  # no engine with room to take a conversation
        kept = []
        for ep, is_under, is_short in zip(eps, under, short, strict=True):
            gave = self.gave_at.get(ep.url)
            if is_under or not is_short or (gave is not None and now - gave < self.window_s):
                kept.append(ep)
            else:
                self.gave_at[ep.url] = now
        return kept

    def explain(self, dropped: Sequence[Endpoint], matches: dict[str, PrefixMatch]) -> Reason | None:
        """The share bound decided when it dropped an endpoint that holds part of the prompt."""
        return Reason.SHARE_BOUND if any(matches.get(ep.url) for ep in dropped) else None


def pick(req: RouteRequest, eps: Sequence[Endpoint], scorers: Sequence[tuple[Scorer, float]]) -> list[Ranked]:
    """Rank endpoints by the weighted sum of scores; ties go to the rendezvous winner of the prompt's
    first block, so equal candidates still keep one prefix in one place."""
    per = [(s.name, w, s.score(req, eps)) for s, w in scorers if w > 0]
    ranked = []
    for i, ep in enumerate(eps):
        scores = {name: vals[i] for name, _, vals in per}
        total = sum(w * vals[i] for _, w, vals in per)
        ranked.append(Ranked(ep, total, scores))
    key = req.tie_key
    # Round to keep float noise from defeating the tie-break.
    ranked.sort(key=lambda r: (-round(r.total, 9), -rendezvous(key, r.endpoint.url)))
    return ranked


class Picker(Protocol):
    def __call__(self, req: RouteRequest, eps: Sequence[Endpoint]) -> list[Ranked]: ...


class PythonPick:
    """:func:`pick` over a fixed list of scorers: the path for any scorer registered in Python."""

    __slots__ = ("scorers",)

    def __init__(self, scorers: Sequence[tuple[Scorer, float]]) -> None:
        self.scorers = scorers

    def __call__(self, req: RouteRequest, eps: Sequence[Endpoint]) -> list[Ranked]:
        return pick(req, eps, self.scorers)


class NativePick:
    """:func:`pick` in one native call (native/src/ranking.rs) when every weighted scorer is one of the
    built-in classes here: the same scores, totals and order (the parity test replays random requests
    through both), at a fraction of the interpreter's cost per request. The scorers keep their state
    and hooks; the native call reads them."""

    __slots__ = ("_names", "_ranker")

    def __init__(self, names: list[str], specs: list[tuple[int, float, tuple[float, ...], object]]) -> None:
        self._names = names
        self._ranker = Ranker(specs)

    @classmethod
    def of(cls, scorers: Sequence[tuple[Scorer, float]]) -> NativePick | None:
        """The native picker for ``scorers``, or None when one of them has no native twin (a plugin, or a
        subclass of a built-in one: its ``score`` may differ)."""
        names, specs = [], []
        for s, w in scorers:
            if w <= 0:
                continue
            spec = _native_spec(s)
            if spec is None:
                return None
            kind, params, state = spec
            names.append(s.name)
            specs.append((kind, w, params, state))
        return cls(names, specs)

    def __call__(self, req: RouteRequest, eps: Sequence[Endpoint]) -> list[Ranked]:
        order, totals, rows = self._ranker.rank(req, eps if isinstance(eps, list) else list(eps))
        names, new = self._names, tuple.__new__
        # tuple.__new__, not Ranked(...): a NamedTuple's own __new__ is a Python function.
        return [new(Ranked, (eps[i], totals[i], dict(zip(names, rows[i])))) for i in order]  # noqa: B905


class _Native(IntEnum):
    """The scorer kinds native/src/ranking.rs knows (its constants)."""

    PREFILL = 0
    PREFIX = 1
    LOAD = 2
    KV_USAGE = 3
    CACHE_ROOM = 4
    HISTORY = 5
    FIT = 6
    RECENT = 7
    EVICTS = 8
    SESSION = 9


def _native_spec(s: Scorer) -> tuple[int, tuple[float, ...], object] | None:
    """(kind, parameters, state) of a built-in scorer, as native/src/ranking.rs reads them; None for
    any other (an exact class match: a subclass may score differently)."""
    match s:
        case PrefillCostScorer() if type(s) is PrefillCostScorer:
            t = s.tiers
            params = (t.gpu, t.cpu, t.storage, float(s.block_size), s.queue_weight, float(s.room_aware))
            return _Native.PREFILL, params, None
        case PrefixScorer() if type(s) is PrefixScorer:
            return _Native.PREFIX, (s.tiers.gpu, s.tiers.cpu, s.tiers.storage), None
        case FitScorer() if type(s) is FitScorer:
            return _Native.FIT, (s.window_s,), s.demand
        case RecentScorer() if type(s) is RecentScorer:
            return _Native.RECENT, (s.window_s,), s.sent
        case EvictsScorer() if type(s) is EvictsScorer:
            return _Native.EVICTS, (s.window_s,), s.used
    kind = _STATELESS.get(type(s))
    return None if kind is None else (kind, (), None)


_STATELESS: dict[type, _Native] = {
    LoadScorer: _Native.LOAD,
    KvUsageScorer: _Native.KV_USAGE,
    CacheRoomScorer: _Native.CACHE_ROOM,
    HistoryScorer: _Native.HISTORY,
    SessionScorer: _Native.SESSION,
}


def picker(scorers: Sequence[tuple[Scorer, float]], *, native: bool = True) -> Picker:
    """How a router ranks with ``scorers``: natively when it can (and ``native``), else :func:`pick`."""
    fast = NativePick.of(scorers) if native else None
    return fast if fast is not None else PythonPick(scorers)


ScorerFactory = Callable[[RouterSettings], Scorer]

# Scorers by name; each name is also the field of its weight in RouterSettings.weights.
SCORERS: dict[str, ScorerFactory] = {
    "prefill": lambda s: PrefillCostScorer(s.tier_weights, s.block_size, s.queue_weight, s.copy_with_room),
    "prefix": lambda s: PrefixScorer(s.tier_weights),
    "load": lambda s: LoadScorer(),
    "kv_usage": lambda s: KvUsageScorer(),
    "cache_room": lambda s: CacheRoomScorer(),
    "history": lambda s: HistoryScorer(),
    "fit": lambda s: FitScorer(s.fit_window_seconds),
    "recent": lambda s: RecentScorer(s.recent_window_seconds),
    "evicts": lambda s: EvictsScorer(s.recent_window_seconds),
    "session": lambda s: SessionScorer(),
}
# Which scorer's explanation wins when several could claim a decision (after a prefix match, which the
# kv-aware policy reports itself); bounded load, a filter, is asked between session and prefill.
EXPLAIN_BEFORE_BOUNDED = ("session",)
EXPLAIN_AFTER_BOUNDED = ("prefill", "fit", "evicts", "history", "recent", "cache_room")


def hooked(scorers: Sequence[tuple[Scorer, float]], hook: str) -> list[Scorer]:
    """The scorers whose ``hook`` (``on_routed``, ``on_hashed``) does something: a request calls each
    hook once per scorer, and most scorers keep :class:`ScorerHooks`' no-op."""
    noop = getattr(ScorerHooks, hook)
    return [s for s, _ in scorers if getattr(type(s), hook, None) is not noop]


def scorer_weight(name: str, settings: RouterSettings) -> float:
    if name == "session" and not settings.session_header:
        return 0.0  # no session ids without the header
    weight: float = getattr(settings.weights, name)
    return weight


def build_scorers(settings: RouterSettings) -> list[tuple[Scorer, float]]:
    """Every registered scorer with its weight from the settings (weight 0 leaves it out of :func:`pick`)."""
    return [(factory(settings), scorer_weight(name, settings)) for name, factory in SCORERS.items()]
