"""Outlier ejection in the manner of Envoy's: an endpoint that fails ``ejectionConsecutiveFailures``
times in a row (connect errors, first-byte timeouts, 5xx, broken streams, failed or timed-out
scrapes) leaves rotation for ``n × ejectionBaseSeconds`` (n = its ejections in a row, capped at
``ejectionMaxSeconds``; n decays by one per base period spent back in rotation).

When the time is up it comes back on probation: one failure ejects it again at once, one success
clears it. If the load scraper is still failing on it when the time is up, it stays out for another
round (an active health check gates the return, as Envoy's does when both are configured).

Ejection also cuts off requests that wait on the endpoint for their first byte: they fail with
``FailureKind.EJECTED`` and are retried elsewhere, so a wedged engine holds nobody for long.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from types import TracebackType

from kvstrata.api.router_config import RouterSettings
from kvstrata.router.outcomes import FailureKind
from kvstrata.router.pool import Endpoint

log = logging.getLogger("kvstrata.router.outlier")


class AllEjected(Exception):
    """Every known endpoint is ejected: answer 503 now rather than wait on engines known to fail."""

    def __init__(self, retry_after: float) -> None:
        super().__init__(
            f"every engine endpoint is ejected after repeated failures; retry in {retry_after:.0f}s"
        )
        self.retry_after = retry_after


class Waiter:
    """A request waiting on an endpoint for its first byte, bound to the ``asyncio.timeout`` that
    bounds the wait: ejecting the endpoint expires the timeout now."""

    __slots__ = ("_state", "cut", "timeout")

    def __init__(self, state: EjectionState, timeout: asyncio.Timeout) -> None:
        self._state = state
        self.timeout = timeout
        self.cut = False

    def __enter__(self) -> Waiter:
        self._state.waiting.add(self)
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._state.waiting.discard(self)

    def cut_off(self) -> None:
        self.cut = True
        # A wait whose own deadline is firing right now cannot be rescheduled (asyncio raises
        # "Cannot change state of expiring Timeout"; seen under heavy load when several waits on one
        # engine time out together): it ends anyway.
        if not self.timeout.expired():
            self.timeout.reschedule(asyncio.get_running_loop().time())


@dataclass(eq=False, slots=True)
class EjectionState:
    consecutive: int = 0
    ejections: int = 0  # the backoff multiplier
    until: float = 0.0  # monotonic; ejected while now < until
    returned_at: float = 0.0
    reason: FailureKind | None = None
    probation: bool = False
    total: int = 0
    waiting: set[Waiter] = field(default_factory=set)


class OutlierDetector:
    def __init__(
        self,
        settings: RouterSettings,
        on_eject: Callable[[Endpoint, FailureKind], None] | None = None,
        pool_size: Callable[[], int] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.threshold = settings.ejection_consecutive_failures
        self.base = settings.ejection_base_seconds
        self.max = settings.ejection_max_seconds
        self.max_percent = settings.max_ejection_percent
        # Told of every ejection: the metric (on_eject), and the native front's waits (router/native_http.py).
        self.ejection_listeners: list[Callable[[Endpoint, FailureKind], None]] = (
            [on_eject] if on_eject is not None else []
        )
        self.clock = clock
        self.pool_size = pool_size or (lambda: len(self._states))
        self._states: dict[str, EjectionState] = {}

    def state(self, ep: Endpoint) -> EjectionState:
        st = self._states.get(ep.url)
        if st is None:
            st = self._states[ep.url] = EjectionState()
        return st

    def forget(self, url: str) -> None:
        self._states.pop(url, None)

    def ejected(self, ep: Endpoint, now: float | None = None) -> bool:
        st = self._states.get(ep.url)
        if st is None or not st.until:
            return False
        now = self.clock() if now is None else now
        if now < st.until:
            return True
        if ep.failures > 0 and st.reason is not None:
            # The scraper still cannot reach it: another round out, longer.
            self._eject(ep, st, st.reason, now)
            return True
        st.until = 0.0
        st.probation = True
        st.returned_at = now
        log.info("endpoint %s back in rotation on probation", ep.url)
        return False

    def remaining(self, ep: Endpoint, now: float | None = None) -> float:
        st = self._states.get(ep.url)
        now = self.clock() if now is None else now
        return max(st.until - now, 0.0) if st is not None and st.until else 0.0

    def available(self, eps: Iterable[Endpoint]) -> list[Endpoint]:
        """The endpoints not ejected; :class:`AllEjected` when there are some and all are."""
        now = self.clock()
        eps = list(eps)
        out = [ep for ep in eps if not self.ejected(ep, now)]
        if eps and not out:
            raise AllEjected(min(self.remaining(ep, now) for ep in eps))
        return out

    def waiter(self, ep: Endpoint, timeout: asyncio.Timeout) -> Waiter:
        return Waiter(self.state(ep), timeout)

    def success(self, ep: Endpoint) -> None:
        st = self._states.get(ep.url)
        if st is not None:
            st.consecutive = 0
            st.probation = False

    def failure(self, ep: Endpoint, kind: FailureKind) -> None:
        if kind is FailureKind.EJECTED:
            return
        st = self.state(ep)
        now = self.clock()
        if self.ejected(ep, now):
            return
        st.consecutive += 1
        if (st.probation or st.consecutive >= self.threshold) and self._room_to_eject(ep, now):
            self._eject(ep, st, kind, now)

    def eject(self, ep: Endpoint, kind: FailureKind) -> None:
        """Eject now (the scraper's verdict after its own run of failures), unless already out."""
        now = self.clock()
        if not self.ejected(ep, now) and self._room_to_eject(ep, now):
            self._eject(ep, self.state(ep), kind, now)

    def _room_to_eject(self, ep: Endpoint, now: float) -> bool:
        if self.max_percent >= 100:
            return True
        n = self.pool_size()
        # An ejection whose time is up counts until it is re-admitted (``ejected`` clears ``until``) or
        # re-ejected: else, in that gap, a healthy engine's slow answer took the wedged one's room (seen
        # in CI: the wedged engine then went out again too, and both were out at once).
        out = sum(1 for url, st in self._states.items() if url != ep.url and st.until)
        return out + 1 <= max(1, math.floor(n * self.max_percent / 100))

    def _eject(self, ep: Endpoint, st: EjectionState, kind: FailureKind, now: float) -> None:
        if st.returned_at and not st.until:
            decay = int((now - st.returned_at) / self.base)
            st.ejections = max(st.ejections - decay, 0)
        st.ejections += 1
        st.total += 1
        duration = min(self.base * st.ejections, self.max)
        st.until = now + duration
        st.reason = kind
        st.consecutive = 0
        st.probation = False
        log.warning(
            "endpoint %s ejected for %.0fs after %s (ejection %d in a row)",
            ep.url,
            duration,
            kind,
            st.ejections,
        )
        for w in list(st.waiting):
            w.cut_off()
        for listener in self.ejection_listeners:
            listener(ep, kind)
