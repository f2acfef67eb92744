"""Why a request went where it went: the values of the ``x-kvstrata-route-reason`` header and of the
``reason`` label of ``kvstrata_router_decisions_total`` (dashboards and the operator read them)."""

from __future__ import annotations

from enum import StrEnum


class Reason(StrEnum):
    PREFIX = "prefix"  # the winner holds the longest cached prefix
    APPROX_PREFIX = "approx-prefix"  # the same, on the character-block fallback index
    SESSION = "session"  # the session id's rendezvous endpoint
    BOUNDED_LOAD = "bounded-load"  # the holder was over its load bound
    SHARE_BOUND = "share-bound"  # the holder, short of room, had more than its share of recent requests
    # a new conversation left an engine serving more than its fair share of live conversations
    CONVERSATION_BOUND = "conversation-bound"
    CONVERSATION = "conversation"  # a follow-up stayed on its conversation's engine (stickyConversations)
    QUEUE = "queue"  # the prefill queued at the holder outweighed its match
    RECENT = "recent"  # fewer live conversations decided it
    CACHE_ROOM = "cache-room"  # a new prefix went where the cache has most room
    HISTORY = "history"  # an evicted prefix went back to the engine that held it
    FIT = "fit"  # the prompt fits in this engine's pool beside what it serves now
    EVICTS = "evicts"  # a new prefix went where what its prefill evicts was used longest ago
    LOAD = "load"  # the weighted totals differed otherwise
    TIE_HASH = "tie-hash"  # equal totals: the rendezvous hash of the prompt's first block
    PREFIX_HASH = "prefix-hash"
    LEAST_LOAD = "least-load"
    ROUND_ROBIN = "round-robin"
    PASSTHROUGH = "passthrough"  # forwarded without routing (/tokenize, /v1/models)


AFFINITY_REASONS = frozenset({Reason.PREFIX, Reason.APPROX_PREFIX})
