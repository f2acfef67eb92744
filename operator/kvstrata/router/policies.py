"""Routing policies: one class each behind :class:`RoutingPolicy`, registered by name in :data:`POLICIES`
(llm-d's plugin registry: a dict name → factory). The names are the contract's ``Policy`` values."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from kvstrata.api.router_config import Policy
from kvstrata.router.decision import Decision
from kvstrata.router.pool import Endpoint
from kvstrata.router.reasons import Reason
from kvstrata.router.requests import ParsedRequest
from kvstrata.router.scoring import rendezvous

if TYPE_CHECKING:
    from kvstrata.router.core import Router


class RoutingPolicy(Protocol):
    async def decide(self, req: ParsedRequest, eps: list[Endpoint], session_id: str | None) -> Decision:
        """Order ``eps`` (non-empty) for ``req``: the first is tried first, the rest are retries."""
        ...


class KvAwarePolicy:
    """Prompt blocks → the router's index → filters, weighted scorers and the picker (router/scoring.py)."""

    def __init__(self, router: Router) -> None:
        self.router = router

    async def decide(self, req: ParsedRequest, eps: list[Endpoint], session_id: str | None) -> Decision:
        return await self.router.kv_aware(req, eps, session_id)


class PrefixHashPolicy:
    """Consistent hashing of the prompt's first blocks: a prefix always goes to the same endpoint."""

    def __init__(self, router: Router) -> None:
        self.router = router

    async def decide(self, req: ParsedRequest, eps: list[Endpoint], session_id: str | None) -> Decision:
        key = self.router.prefix_key(req)
        return Decision(sorted(eps, key=lambda ep: -rendezvous(key, ep.url)), Reason.PREFIX_HASH)


class LeastLoadPolicy:
    """Fewest requests running and waiting; ties rotate."""

    def __init__(self, router: Router) -> None:
        self._turn = 0

    async def decide(self, req: ParsedRequest, eps: list[Endpoint], session_id: str | None) -> Decision:
        self._turn += 1
        n = len(eps)
        order = sorted(range(n), key=lambda i: (eps[i].load, (i - self._turn) % n))
        return Decision([eps[i] for i in order], Reason.LEAST_LOAD)


class RoundRobinPolicy:
    def __init__(self, router: Router) -> None:
        self._turn = 0

    async def decide(self, req: ParsedRequest, eps: list[Endpoint], session_id: str | None) -> Decision:
        self._turn += 1
        k = self._turn % len(eps)
        return Decision(_rotated(eps, k), Reason.ROUND_ROBIN)


def _rotated(eps: Sequence[Endpoint], k: int) -> list[Endpoint]:
    return [*eps[k:], *eps[:k]]


PolicyFactory = Callable[["Router"], RoutingPolicy]

POLICIES: dict[Policy, PolicyFactory] = {
    "kv-aware": KvAwarePolicy,
    "prefix-hash": PrefixHashPolicy,
    "least-load": LeastLoadPolicy,
    "round-robin": RoundRobinPolicy,
}
