"""The operator↔router contract: the router's one typed settings object and every value the CRD, the
planner, the renderer and the router must agree on (policies, hash algorithms, weight defaults, ports, the
KV-events topic, label keys). Each is defined here once; the others import it.

The operator renders the settings as `router.json` in the ConfigMap `<name>-router` (key `router.json`);
local runs build them from flags. Field names are camelCase on the wire so the ConfigMap reads like the CRD.
"""

from __future__ import annotations

from typing import Final, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

Policy = Literal["kv-aware", "prefix-hash", "least-load", "round-robin"]
POLICIES: Final[tuple[Policy, ...]] = get_args(Policy)
DEFAULT_POLICY: Final[Policy] = "kv-aware"
# Who serves the router's HTTP: the native front (router/native_http.py) or the Python app alone.
DataPlane = Literal["native", "python"]
DEFAULT_DATA_PLANE: Final[DataPlane] = "native"
DATA_PLANE_HELP: Final[str] = (
    "Who serves the router's HTTP: native (hyper, in the router's native core: it makes the first try "
    "of a short plain generation request itself and hands everything else to the Python app) or python "
    "(the Python app alone). Decisions and every rule are the same Python either way; native costs "
    "about a third less CPU per request"
)
# Only what the router reproduces (router/hashing.py): vLLM's xxhash variants seed their first block's
# parent randomly per engine process, so no router can match them; the API refuses them at admission.
HashAlgo = Literal["sha256", "sha256_cbor"]
HASH_ALGOS: Final[tuple[HashAlgo, ...]] = get_args(HashAlgo)
DEFAULT_HASH_ALGO: Final[HashAlgo] = "sha256"
Medium = Literal["GPU", "CPU", "STORAGE"]

# Ports and topic: engine flags (planner), pod/Service ports (render) and router discovery.
ENGINE_PORT: Final = 8000
ROUTER_PORT: Final = 8080
KV_EVENTS_PORT: Final = 5557
KV_REPLAY_PORT: Final = 5558
# The engine pod's fs-janitor sidecar (NVMe tier): its metrics and the evictions the router fetches.
FS_JANITOR_PORT: Final = 9402
KV_EVENTS_TOPIC: Final = "kv-events"

# Label keys on every rendered child; the controller and the router select on them.
LABEL_NAME: Final = "app.kubernetes.io/name"
LABEL_INSTANCE: Final = "app.kubernetes.io/instance"
LABEL_COMPONENT: Final = "app.kubernetes.io/component"
LABEL_MANAGED_BY: Final = "app.kubernetes.io/managed-by"
LABEL_PART_OF: Final = "app.kubernetes.io/part-of"
# Set by Kubernetes on a Service's EndpointSlices; router discovery selects on it.
SERVICE_NAME_LABEL: Final = "kubernetes.io/service-name"

# Scorer weight defaults (router/scoring.py), shared by the CRD's RouterWeights and the router's Weights.
WEIGHT_PREFILL: Final = 1.0
WEIGHT_PREFIX: Final = 0.0
WEIGHT_LOAD: Final = 0.2
WEIGHT_KV_USAGE: Final = 0.1
WEIGHT_SESSION: Final = 2.0
WEIGHT_CACHE_ROOM: Final = 1.0
# The history scorer: a prompt goes back to its group's home unless the estimated prefill wait there is more
# than twice that of an idle engine (prefill scores are cheapest / cost, so a gap above 0.5).
WEIGHT_HISTORY: Final = 0.5
# Fit and history pull equally: a group's home that no longer fits it and an engine it fits tie, and
# the prefill estimate decides.
WEIGHT_FIT: Final = 0.5
WEIGHT_RECENT: Final = 0.3
# The evicts scorer: as much as room (cache_room), which it stands in for once every pool is full; against
# history (0.5), a group's home that would evict blocks used a moment ago loses to an engine whose blocks
# to evict have faded by more than half.
WEIGHT_EVICTS: Final = 1.0
QUEUE_WEIGHT: Final = 0.25
# Tier credit: the share of a block's prefill a hit on that tier saves (TierWeights). On accelerators it
# depends on the model and the links (a prefill on a GPU is fast, so a copy from host DRAM or a read from
# NVMe saves a smaller share): assumed, not measured here (no GPU on the project's machines); set it per
# cluster (spec.router.tierWeights) from `make bench-tier-credit` on the cluster's hardware.
TIER_GPU: Final = 1.0
TIER_CPU: Final = 0.8
TIER_STORAGE: Final = 0.5
# device cpu: measured (`make bench-tier-credit`, 2026-11-24: tiny model, 1,024-token prompts, 8 rounds,
# cold 4.4 s, pool 25 ms, CPU tier 84 ms, fs tier 109 ms): a CPU-tier hit saved 0.98-0.99 of the prefill,
# an fs-tier hit 0.98. A prefill on a CPU is slow; a copy from DRAM or a file read is not.
TIER_CPU_ON_CPU: Final = 0.99
TIER_STORAGE_ON_CPU: Final = 0.98


class _Wire(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


class StaticEndpoint(_Wire):
    """An engine the router reaches without Kubernetes discovery (local runs, tests, benchmarks)."""

    url: str = Field(description="Base URL of the engine's OpenAI server, e.g. http://127.0.0.1:8001")
    kv_events: str | None = Field(None, description="ZMQ PUB endpoint, e.g. tcp://127.0.0.1:5557")
    kv_replay: str | None = Field(None, description="ZMQ ROUTER replay endpoint, e.g. tcp://127.0.0.1:5558")
    fs_janitor: str | None = Field(
        None, description="Base URL of the engine's fs-janitor (NVMe tier), e.g. http://127.0.0.1:9402"
    )


class Discovery(_Wire):
    """Where engines come from: the engine Service's EndpointSlices, or a static list."""

    namespace: str | None = None
    service: str | None = Field(None, description="Headless engine Service whose EndpointSlices are watched")
    engine_port: int = ENGINE_PORT
    kv_events_port: int = KV_EVENTS_PORT
    kv_replay_port: int = KV_REPLAY_PORT
    fs_janitor_port: int | None = Field(
        None,
        description="The engine pods' fs-janitor port, on clusters with an NVMe tier: the router fetches "
        "the block files it evicted (vLLM reports none) and drops them from its index",
    )
    static: list[StaticEndpoint] = Field(default_factory=list)


class Weights(_Wire):
    """Picker weights: total = Σ weight × score (each scorer in [0, 1]); see router/scoring.py."""

    prefill: float = Field(
        WEIGHT_PREFILL,
        ge=0,
        description="Estimated prefill before the first token: uncached tokens + queued prefill",
    )
    prefix: float = Field(
        WEIGHT_PREFIX, ge=0, description="Share of the prompt cached (prefill counts it already)"
    )
    load: float = Field(WEIGHT_LOAD, ge=0)
    kv_usage: float = Field(WEIGHT_KV_USAGE, ge=0)
    session: float = Field(WEIGHT_SESSION, ge=0, description="Only when session_header is set and present")
    cache_room: float = Field(
        WEIGHT_CACHE_ROOM,
        ge=0,
        description="A prompt no engine holds goes where the router's index holds fewest blocks",
    )
    history: float = Field(
        WEIGHT_HISTORY,
        ge=0,
        description="A prompt no engine holds goes back to the engine that held and evicted it",
    )
    fit: float = Field(
        WEIGHT_FIT,
        ge=0,
        description="Prefer an engine whose KV pool holds its recent demand plus this prompt",
    )
    recent: float = Field(
        WEIGHT_RECENT,
        ge=0,
        description="Fewer requests sent lately (live conversations that will send follow-ups)",
    )
    evicts: float = Field(
        WEIGHT_EVICTS,
        ge=0,
        description="A prompt no engine holds goes where the blocks its prefill would evict were used "
        "longest ago",
    )


class TierWeights(_Wire):
    """Credit for a cached block by where it lives: a GPU hit saves the most prefill time."""

    gpu: float = Field(TIER_GPU, ge=0, alias="GPU")
    cpu: float = Field(TIER_CPU, ge=0, alias="CPU")
    storage: float = Field(TIER_STORAGE, ge=0, alias="STORAGE")


def default_tier_weights(device: Literal["gpu", "cpu"]) -> TierWeights:
    """The tier credit for engines on ``device`` when the cluster sets none: measured on CPUs, assumed
    on GPUs (see TIER_*)."""
    if device == "cpu":
        return TierWeights(gpu=TIER_GPU, cpu=TIER_CPU_ON_CPU, storage=TIER_STORAGE_ON_CPU)
    return TierWeights()


class AdmissionSettings(_Wire):
    """Holding requests in the router while their engine's KV pool has no room (router/admission.py)."""

    enabled: bool = Field(
        True,
        description="Hold a request whose engine's pool is full of this router's running requests, and "
        "send each engine the held request it can serve cheapest when room frees, instead of queueing "
        "everything first come, first served in the engine",
    )
    max_hold_seconds: float | None = Field(
        None,
        gt=0,
        description="Longest a request is held before it goes to its engine's own queue anyway; "
        "default a third of firstByteTimeoutSeconds",
    )
    # Off: on held-out pressure draws of the family benchmark it cost hit rate (1.7 +- 1.2 points, TTFT
    # mean 1.06x; 3.6 +- 1.6 before it counted evictions) (docs/benchmarks.md, sixteenth session); on
    # today's code it traded 1.1 +- 1.0 points (3.3 where it fired) for TTFT mean 0.94x and p99 0.84x and
    # failed the same rule (twenty-fifth session). Users who weigh p99 over hit rate may turn it on.
    move_when_held_past_prefill: bool = Field(
        False,
        description="Send a held request to another engine with room once it has waited as long as moving "
        "would cost there (its extra prefill and that of the cached blocks it evicts, at that engine's "
        "recent pace); off: it moves only if that costs no more prefill than its own engine",
    )
    # Off until measured (forty-seventh session, docs/benchmarks.md). The rent-or-buy move above lost hit
    # rate by evicting what the target's own conversations came back for; this one moves only where
    # nothing lately asked for is evicted (family draw 861: three requests held ~0.8 s for one engine
    # while another, idle for 47 s, had room).
    move_to_spare_room: bool = Field(
        False,
        description="Send a held request to another engine whose pool has room for it beside every block "
        "routed there in the last fitWindowSeconds (it evicts nothing lately asked for) once it has waited "
        "as long as its extra prefill there would take, at that engine's recent pace",
    )
    # On: off (a held request waits for its own engine) failed its rule on 14 held-out pressure draws,
    # off - on hit -0.3 +- 1.1 points, TTFT mean 0.99x, p99 0.97x (thirty-fourth session,
    # docs/benchmarks.md). Where steals happened the draws swung both ways (-9.4 to +9.9 points).
    steal_when_home_holds_no_more: bool = Field(
        True,
        description="Send a held request to another engine with room when its own engine no longer "
        "holds more of its prompt than that one (stolen); off: it waits for its own engine unless that "
        "engine is out of rotation or silent",
    )
    # Off: it failed its rule on 14 held-out pressure draws (fifty-first session, docs/benchmarks.md):
    # on - off hit -0.2 +- 0.7 points, TTFT mean 0.98x, p99 1.04x; it cut steals from 18 to 1 and the four
    # draws where the default stole swung both ways (937 +5.8, 939 -7.0). Built for family draw 923, where
    # two steals from a pool thrashed by two conversations landed on the engine serving one alone and
    # evicted it.
    steal_only_to_spare_room: bool = Field(
        False,
        description="Steal a held request (stealWhenHomeHoldsNoMore) only to an engine whose pool has room "
        "for the blocks it lacks there beside every block routed there in the last fitWindowSeconds, so "
        "the steal evicts nothing lately asked for; a held request whose engine is out of rotation or "
        "silent moves regardless",
    )
    # Off: it failed its rule on 14 held-out pressure draws (fifty-third session, docs/benchmarks.md): on
    # - off hit +0.1 +- 0.7 points, TTFT mean 0.98x, p99 1.00x. Built for family draw 1028: eight
    # conversations opened in one burst; the engine whose first requests ended first stole the held ones
    # and served four of the eight, and their next turns moved off it and evicted the others'.
    steal_keeps_conversations_even: bool = Field(
        False,
        description="Steal a held request (stealWhenHomeHoldsNoMore) only to an engine serving at most "
        "floor(N / engines) of the N live conversations (the stolen one counted at its home), so that a "
        "steal never leaves one engine serving more than its share of the conversations whose next turns "
        "will follow them; a held request whose engine is out of rotation or silent moves regardless",
    )
    assumed_output_tokens: int = Field(
        256,
        ge=0,
        description="Output tokens counted for a request that sets no max_tokens (its blocks grow as it "
        "decodes)",
    )
    # On, with anticipate_only_evicted: keeping a room for every group followed in time cost TTFT (mean
    # 1.18x, then 1.07x) for at most +1.2 +- 0.7 points (seventeenth session); kept only for groups
    # whose turns evict each other it passed its rule on 12 held-out pressure draws (+0.3 +- 0.9 points,
    # mean 0.91x, p99 0.98x; nineteenth session, docs/benchmarks.md).
    # Up to a minute: an agent's next call comes after its tool runs, and a slow engine's turn after a
    # long prefill elsewhere (a real-engine test on float32 CPU engines waits 6 s between turns). A long
    # window holds nothing past maxHoldSeconds: a held request then goes to its engine's queue anyway.
    anticipate_seconds: float = Field(
        0.25,
        ge=0,
        le=60,
        description="When a request ends and its prefix group's last requests were each followed within "
        "this many seconds by one extending them (agents, closed loops), keep its blocks' room on its "
        "engine that long for the follow-up instead of admitting a held request that would evict them; "
        "0: off",
    )
    anticipate_only_evicted: bool = Field(
        True,
        description="With anticipateSeconds: keep a room only for a prefix group whose follow-ups have "
        "lately found the blocks of the request they extend evicted from its engine (turns that evict "
        "each other); where nothing evicts them a kept room only holds other requests back",
    )
    # Off: built for family draw 251 (a cold prompt held 4.4 s behind other tenants' cheaper turns), it
    # failed its rule on 12 held-out pressure draws: on - off hit -0.9 +- 1.2 points, TTFT mean 1.09x,
    # p99 1.14x (twenty-first session, docs/benchmarks.md).
    overdue_after_prefills: float = Field(
        0.0,
        ge=0,
        description="A held request that has waited this many times its own prefill at its engine (its "
        "uncached tokens at the engine's recent pace) goes before cheaper ones, oldest first, and may "
        "take a room kept for a follow-up; 0: cheapest first always",
    )
    # Off: it failed its rule on 14 held-out pressure draws (fifty-seventh session, docs/benchmarks.md):
    # on / off TTFT mean 1.03 +- 0.04x, hit -1.5 +- 1.0 points, p99 0.88x. Built because two prefills
    # batched on one engine share its compute, so both first tokens come as late as the second's alone
    # would (in the kept pressure draws 1 in 5 of kvstrata's requests ran beside another's prefill on its
    # engine, at twice the time per uncached token); held for a turn, a request waited about as long.
    prefill_in_turn: bool = Field(
        False,
        description="Hold a request while its engine computes the prefill of another request of this "
        "router's (sent, no first token yet), so that prefills run one after another, the cheapest held "
        "first, instead of sharing the engine's steps; a prefill of one block or less never waits",
    )


class RouterSettings(_Wire):
    model: str = Field(description="Served model name engines answer to")
    tokenizer: str | None = Field(None, description="Directory with tokenizer.json (+ tokenizer_config.json)")
    block_size: int = Field(128, gt=0, description="Engine --block-size; KV events and hashes use it")
    hash_algo: HashAlgo = DEFAULT_HASH_ALGO
    kv_events_topic: str = KV_EVENTS_TOPIC
    policy: Policy = DEFAULT_POLICY
    weights: Weights = Field(default_factory=Weights)
    tier_weights: TierWeights = Field(default_factory=TierWeights)
    bounded_load_factor: float = Field(
        1.5, ge=1.0, description="No endpoint gets more than this × mean in-flight"
    )
    queue_weight: float = Field(
        QUEUE_WEIGHT,
        ge=0,
        description="Prefill scorer: queued prefill tokens counted per uncached prompt token; below 1 "
        "a request waits for the engine holding its prefix rather than recompute it elsewhere",
    )
    copy_with_room: bool = Field(
        False,
        description="Off unless set. Prefill scorer: at an engine whose KV pool has room for the prompt's "
        "new blocks (the fit scorer's recent demand plus them within its pool), count its uncached "
        "tokens at their prefill alone: queueWeight discounts the queue for the evictions a copy causes "
        "elsewhere, and there it causes none",
    )
    surviving_match: bool = Field(
        True,
        description="On by default. Score an engine's cached prefix of a prompt by what will still be "
        "there when the prompt can start: blocks this router's running requests there share with it stay, "
        "the rest only as far as the pool's room beside those requests goes (the engine evicts the "
        "excess before this prompt can run; its events say so only after the step that does it). The "
        "admission gate costs held requests the same way",
    )
    bounded_load_slack: int = Field(
        4,
        ge=0,
        description="...or more than mean + this many in-flight requests, whichever is larger: at low "
        "concurrency a factor alone spills a prefix group onto engines that miss",
    )
    share_bound_factor: float | None = Field(
        None,
        ge=1.0,
        description="Off unless set. An engine short of KV room (recent demand over its pool) gets no "
        "more than this × its fair share of the requests routed in the last fitWindowSeconds: a "
        "conversation moves off it instead. Evens the split at a cost in hit rate under memory pressure "
        "(measured in docs/benchmarks.md)",
    )
    share_bound_slack: float = Field(
        2.0,
        ge=0,
        description="...or more than its fair share + this many requests, whichever is larger: the first "
        "requests of a group are not spread",
    )
    conversation_bound: bool = Field(
        False,
        description="Off unless set. A prompt that opens a conversation (it continues none routed in the last "
        "fitWindowSeconds) skips engines already serving floor(N / engines) + 1 of the N live "
        "conversations, itself counted: a tenant's conversations no longer pile onto the engine holding its system "
        "prompt. Acts only while a prompt lately continued a conversation and no more ended than "
        "continued: one-shot requests over a shared document stay together (docs/router.md)",
    )
    projected_fit: bool = Field(
        False,
        description="Off unless set. The fit scorer's demand on an engine also counts the blocks its live "
        "conversations are expected to add with their next turns (their recent mean growth per turn, times "
        "the share of conversations continued rather than ended): a new conversation goes where it still fits "
        "once the others have grown (docs/router.md)",
    )
    # Off: it failed its rule on 14 held-out pressure draws (fifty-second session, docs/benchmarks.md):
    # on - off hit -0.6 +- 1.0 points, TTFT mean 1.04x, p99 1.15x. Built from the kept family runs (bursty
    # pressure losses went with moved follow-ups: -6.6 points where 5 % or more moved, -0.3 elsewhere); on
    # fresh draws it lost where it kept a follow-up home while another engine held more of it (955, 967).
    sticky_conversations: bool = Field(
        False,
        description="Off unless set. A prompt that continues a conversation routed in the last "
        "fitWindowSeconds goes to the engine its last turn went to while that engine is in rotation and "
        "under the load bound, and the admission gate never moves it elsewhere: no scorer, steal or move "
        "splits a conversation over engines (docs/router.md)",
    )
    fit_window_seconds: float = Field(
        30.0,
        gt=0,
        description="Fit scorer: blocks routed to an engine in this many seconds are its demand (a few "
        "chat turns of one conversation, so a prefix group's users overlap)",
    )
    recent_window_seconds: float = Field(
        10.0,
        gt=0,
        description="Recent scorer: a request sent to an engine counts exp(-age / this) (about one "
        "think time plus answer of a chat turn)",
    )
    session_header: str | None = Field(
        None, description="Optional header for session affinity, e.g. x-session-id"
    )
    prediction_ttl_seconds: float = Field(
        5.0,
        gt=0,
        description="How long a routed prompt's blocks count as cached on its engine after its prefill "
        "ended (first token) without the engine's events confirming them; until then they always count",
    )
    max_index_blocks: int = Field(2_000_000, gt=0, description="Bound on indexed (endpoint, block) entries")
    max_retries: int = Field(
        2,
        ge=0,
        description="Other endpoints a request is sent to after a failure before its first byte (5xx, "
        "dropped connection, first-byte timeout). Tries that never reached an engine (connect refused or "
        "timed out) are not counted",
    )
    upstream_timeout_seconds: float = Field(600.0, gt=0)
    connect_timeout_seconds: float = Field(3.0, gt=0)
    discovery: Discovery = Field(default_factory=Discovery)
    # Added by the router (defaults keep older router.json files valid).
    scrape_interval_seconds: float = Field(1.0, gt=0, description="Engine /metrics scrape period")
    remote_tokenize: bool = Field(
        True, description="Without a local tokenizer, ask an engine's /tokenize (else character blocks)"
    )
    approx_chunk_chars: int | None = Field(
        None, gt=0, description="Character-block size of the fallback index; default 4 × block_size"
    )
    approx_ttl_seconds: float = Field(
        300.0, gt=0, description="How long the fallback index remembers a route"
    )
    prefix_hash_blocks: int = Field(1, ge=1, description="prefix-hash policy: blocks that form the hash key")
    max_upstream_connections: int = Field(2048, ge=1, description="Pooled keep-alive connections to engines")
    tokenizer_threads: int = Field(2, ge=1, description="Thread pool for tokenization and hashing")
    data_plane: DataPlane = Field(DEFAULT_DATA_PLANE, description=DATA_PLANE_HELP)
    index_sync_timeout_seconds: float = Field(
        15.0,
        ge=0,
        description="At start, wait this long for every engine's KV-event replay before serving: a "
        "router that routes on a half-replayed history sends prompts to engines that no longer hold them",
    )
    # --- Timeouts, outlier ejection and limits (a wedged engine, hostile bodies, huge prompts) ---
    first_byte_timeout_seconds: float = Field(
        60.0,
        gt=0,
        description="Streamed requests: longest wait for the engine's first streamed byte (its queue "
        "and prefill); past it the request goes to the next-best engine and the miss counts toward "
        "ejection. Non-streamed requests are bounded by upstreamTimeoutSeconds (engines send nothing "
        "before the end) and by ejection, which cuts off their wait on an engine that stops answering",
    )
    stream_idle_timeout_seconds: float = Field(
        60.0, gt=0, description="Longest pause between two chunks of a stream that has started"
    )
    scrape_timeout_seconds: float = Field(
        3.0, gt=0, description="Engine /metrics scrape deadline; a scrape past it counts as a failure"
    )
    ejection_consecutive_failures: int = Field(
        3,
        ge=1,
        description="Consecutive connect errors, first-byte timeouts, 5xx answers or failed scrapes "
        "that eject an engine from rotation",
    )
    ejection_base_seconds: float = Field(
        10.0,
        gt=0,
        description="Ejection time; the n-th ejection in a row lasts n × this (the count decays by one "
        "per this much time back in rotation), up to ejectionMaxSeconds",
    )
    ejection_max_seconds: float = Field(300.0, gt=0, description="Longest ejection")
    max_ejection_percent: int = Field(
        50,
        ge=0,
        le=100,
        description="At most this share of engines ejected at once, but always at least one (Envoy's "
        "rule). When most engines fail together the cause is usually shared (overload): waiting on a "
        "slow engine beats failing every request. At 100 every engine can be, and requests then get a "
        "fast 503",
    )
    max_body_bytes: int = Field(
        64 * 1024**2, gt=0, description="Request body bound, before and after decompression (413 past it)"
    )
    max_response_bytes: int = Field(
        64 * 1024**2, gt=0, description="Bound on a non-streamed engine response the router buffers (502)"
    )
    max_prompt_chars: int = Field(
        2_000_000,
        gt=0,
        description="Longest prompt (characters of the prompt or of all message contents; token ids "
        "count 4 characters each) accepted; longer ones get a 413",
    )
    large_prompt_chars: int = Field(
        65_536,
        gt=0,
        description="Prompts longer than this are tokenized in a separate one-thread pool, so they "
        "never hold up short ones",
    )
    large_prompt_queue: int = Field(
        4,
        ge=1,
        description="Large prompts tokenizing or waiting at once; further ones route on character "
        "blocks (counted as fallback reason large_prompt_busy)",
    )
    header_read_timeout_seconds: float = Field(
        30.0,
        gt=0,
        description="A connection must send a complete request head within this (also the idle "
        "keep-alive timeout)",
    )
    body_read_timeout_seconds: float = Field(
        30.0, gt=0, description="A request body must arrive within this once its head has (408 past it)"
    )
    admission: AdmissionSettings = Field(default_factory=AdmissionSettings)
    admin_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="When set, /kvstrata/state is served only on this port (with /metrics, /health, "
        "/ready), not on the public one",
    )
