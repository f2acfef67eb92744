"""A routing decision: the endpoints to try in order, why, and what the router predicts about them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvstrata.router.index import PrefixMatch
from kvstrata.router.native import Prediction
from kvstrata.router.pool import Endpoint
from kvstrata.router.reasons import Reason
from kvstrata.router.scoring import Ranked, RouteRequest, uncached_tokens


@dataclass(slots=True)
class Decision:
    order: list[Endpoint]
    reason: Reason
    hashes: Sequence[int] = ()
    approximate: bool = False
    matches: dict[str, PrefixMatch] = field(default_factory=dict)
    prompt_tokens: int | None = None
    ranked: list[Ranked] | None = None
    # False for requests forwarded without routing (/tokenize, /v1/models): not conversation traffic.
    routed: bool = True
    # The index prediction of the last attempt (commit), re-timed when its prefill is over (settle).
    prediction: Prediction | None = None
    # The endpoint the last commit counted it on (a held request is committed when it starts waiting).
    committed: Endpoint | None = None
    # What the scorers ranked (kv-aware decisions): a retry ranks the endpoints left again on it.
    request: RouteRequest | None = None
    # A follow-up kept on its conversation's engine (stickyConversations): the admission gate never moves it
    # while that engine is in rotation and heard from.
    sticky: bool = False

    def predicted_cached_tokens(self, ep: Endpoint, block_size: int) -> int:
        if self.approximate:
            return 0
        m = self.matches.get(ep.url)
        if not m:
            return 0
        cached = m.blocks * block_size
        if self.prompt_tokens is not None:
            # vLLM always computes the prompt's last token, so a fully cached prompt hits one block less.
            cached = min(cached, (self.prompt_tokens - 1) // block_size * block_size)
        return max(cached, 0)

    def uncached_tokens(self, ep: Endpoint, block_size: int) -> int:
        """Prompt tokens ``ep`` will compute for this request (the prefill it queues there)."""
        m = self.matches.get(ep.url)
        return round(uncached_tokens(self.prompt_tokens, len(self.hashes), m.blocks if m else 0, block_size))
