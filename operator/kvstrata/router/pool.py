"""The set of engine endpoints and their live state (health, in-flight requests, scraped load)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class EndpointSpec:
    """How to reach one engine: HTTP base URL (its identity), KV-event PUB and replay ROUTER sockets, and
    its fs-janitor's base URL (NVMe tier: the evictions vLLM does not report)."""

    url: str
    kv_events: str | None = None
    kv_replay: str | None = None
    fs_janitor: str | None = None


# Weight a pace sample keeps per newer sample: about the last five prefills count.
_PACE_KEEP = 0.8


@dataclass(slots=True)
class PrefillPace:
    """How long an engine has been taking per uncached prompt token, to the first streamed byte of this
    router's recent requests there: decayed sums, their ratio. Each sample's fixed cost (queueing, a
    decode step) inflates the pace, so a wait weighed against it moves fewer requests, not more."""

    seconds: float = 0.0
    tokens: float = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds < 0:
            return  # a fully cached prompt says nothing about prefill speed
        self.seconds = self.seconds * _PACE_KEEP + seconds
        self.tokens = self.tokens * _PACE_KEEP + tokens

    def seconds_for(self, tokens: float) -> float | None:
        """Seconds ``tokens`` more prefill would take, or None before the first sample."""
        return tokens * self.seconds / self.tokens if self.tokens > 0 else None


@dataclass(eq=False, slots=True)
class Endpoint:
    spec: EndpointSpec
    healthy: bool = True
    in_flight: int = 0
    # Uncached prompt tokens of this router's requests there that have no first token yet.
    pending_prefill: int = 0
    # From the engine's /metrics (0 until the first scrape; engines without /metrics stay at 0).
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    kv_blocks: int = 0  # KV pool size in blocks, from the engine's metrics (0: unknown)
    failures: int = 0
    scraped: bool = False
    answered_at: float = 0.0  # monotonic time of its last answered scrape (any status under 500)
    streamed_at: float = 0.0  # monotonic time it last sent a request's bytes (a stream chunk, a body)
    pace: PrefillPace = field(default_factory=PrefillPace)
    extra: dict[str, object] = field(default_factory=dict)
    # The spec's URL, the endpoint's identity: a field, since a request reads it some 40 times.
    url: str = field(init=False)

    def __post_init__(self) -> None:
        self.url = self.spec.url

    @property
    def load(self) -> float:
        """Requests the engine is working on or will: ours in flight, and what it reports queued.

        The engine's running count includes our in-flight requests, so take the larger of the two
        views rather than the sum (the scrape lags; in-flight is exact for this router)."""
        return max(float(self.in_flight), self.running) + self.waiting

    def heard_within(self, seconds: float, now: float) -> bool:
        """Whether the engine answered a scrape or sent a request bytes in the last ``seconds``: busy
        if it has work, not wedged. Either alone can lag on a loaded machine (an API server too slow
        for the scrape deadline still streams tokens; a long prefill streams nothing but answers scrapes)."""
        return max(self.answered_at, self.streamed_at) >= now - seconds


def faded(value: float, age_s: float, window_s: float) -> float:
    """``value`` after ``age_s`` seconds of exponential decay with time constant ``window_s``."""
    return value * math.exp(-max(age_s, 0.0) / window_s) if window_s > 0 else 0.0


class PrefillTicket:
    """Counts a request's uncached prompt tokens in its endpoint's ``pending_prefill`` until the first
    token arrives (or the attempt ends)."""

    __slots__ = ("_ep", "_on_done", "_tokens")

    def __init__(self, ep: Endpoint, tokens: int, on_done: Callable[[], None] | None = None) -> None:
        self._ep = ep
        self._tokens = max(tokens, 0)
        self._on_done = on_done  # told once, when the prefill ends (the admission gate's prefillInTurn)
        ep.pending_prefill += self._tokens

    def done(self, first_token_after_s: float | None = None) -> bool:
        """True the first time (the prefill just ended), False after. ``first_token_after_s``: the
        first token came that long after the request was sent (a sample of the engine's pace)."""
        if self._tokens < 0:
            return False
        self._ep.pending_prefill -= self._tokens
        if first_token_after_s is not None:
            self._ep.pace.observe(self._tokens, first_token_after_s)
        self._tokens = -1
        if self._on_done is not None:
            self._on_done()
        return True


Listener = Callable[[Endpoint], None]


class EndpointPool:
    """Endpoints by URL. Discovery calls :meth:`replace`; listeners learn about adds and removals."""

    def __init__(self) -> None:
        self._eps: dict[str, Endpoint] = {}
        self._on_add: list[Listener] = []
        self._on_remove: list[Listener] = []

    def subscribe(self, on_add: Listener, on_remove: Listener) -> None:
        self._on_add.append(on_add)
        self._on_remove.append(on_remove)

    def __len__(self) -> int:
        return len(self._eps)

    def __contains__(self, url: object) -> bool:
        return url in self._eps

    def get(self, url: str) -> Endpoint | None:
        return self._eps.get(url)

    def all(self) -> list[Endpoint]:
        return list(self._eps.values())

    def healthy(self) -> list[Endpoint]:
        return [ep for ep in self._eps.values() if ep.healthy]

    def replace(self, specs: Iterable[EndpointSpec]) -> tuple[list[str], list[str]]:
        """Make the pool exactly ``specs``; returns (added, removed) URLs.

        An endpoint whose event sockets changed (same URL, new pod behind it) is removed and re-added
        so its index entries and subscriber start fresh."""
        wanted = {s.url: s for s in specs}
        removed = [u for u, ep in self._eps.items() if u not in wanted or wanted[u] != ep.spec]
        for url in removed:
            ep = self._eps.pop(url)
            for cb in self._on_remove:
                cb(ep)
        added = [u for u in wanted if u not in self._eps]
        for url in added:
            ep = self._eps[url] = Endpoint(wanted[url])
            for cb in self._on_add:
                cb(ep)
        return added, removed
