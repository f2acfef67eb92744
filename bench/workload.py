"""The shared-prefix, multi-turn workload of `make bench-router`, generated from a seed.

`groups` long documents; each of `conversations` conversations belongs to one group (round-robin) and
asks `turns` questions about its document. Turn k's prompt is the document followed by the whole
conversation so far, so it extends turn k-1's prompt exactly: a router that sends a conversation back
to the engine that holds its prefix saves the prefill of everything but the new tail. Assistant turns
in the history are canned text from the same seed, not the model's output, so every router sees
byte-identical prompts. Pure: the same arguments always give the same workload.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

_ONSETS = ("b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "st", "tr", "ch")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ea", "ou")
_CODAS = ("", "", "n", "r", "s", "t", "l", "m")


@dataclass(frozen=True)
class WorkloadSpec:
    seed: int = 7
    groups: int = 6
    conversations: int = 18
    turns: int = 3
    doc_tokens: int = 768
    user_tokens: int = 48
    reply_tokens: int = 24
    max_tokens: int = 8

    def validate(self) -> None:
        for name in (
            "groups",
            "conversations",
            "turns",
            "doc_tokens",
            "user_tokens",
            "reply_tokens",
            "max_tokens",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.conversations < self.groups:
            raise ValueError(f"conversations ({self.conversations}) must be >= groups ({self.groups})")


@dataclass(frozen=True)
class Conversation:
    cid: int
    group: int
    prompts: tuple[str, ...]  # prompt of turn 0, 1, ...; each extends the previous one


def _words(rng: random.Random, n: int) -> list[str]:
    out = []
    for _ in range(n):
        syllables = rng.randint(1, 3)
        out.append(
            "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(syllables))
        )
    return out


def filler_text(rng: random.Random, tokens: int, count: Callable[[str], int]) -> str:
    """Text of about `tokens` tokens: grow by words, trim back to the target."""
    words: list[str] = []
    while count(" ".join(words)) < tokens:
        words += _words(rng, max(4, (tokens - count(" ".join(words))) // 2))
    while len(words) > 1 and count(" ".join(words[:-1])) >= tokens:
        words.pop()
    return " ".join(words)


def build(spec: WorkloadSpec, count_tokens: Callable[[str], int]) -> list[Conversation]:
    spec.validate()
    rng = random.Random(spec.seed)
    docs = [
        f"Document {g}.\n" + filler_text(rng, spec.doc_tokens, count_tokens) + "\n\n"
        for g in range(spec.groups)
    ]
    convs = []
    for cid in range(spec.conversations):
        group = cid % spec.groups
        history = docs[group]
        prompts = []
        for _ in range(spec.turns):
            history += f"User {cid}: " + filler_text(rng, spec.user_tokens, count_tokens) + "\nAssistant:"
            prompts.append(history)
            history += " " + filler_text(rng, spec.reply_tokens, count_tokens) + "\n"
        convs.append(Conversation(cid, group, tuple(prompts)))
    return convs


def schedule(convs: Sequence[Conversation], seed: int) -> list[Conversation]:
    """The order conversations are started in: shuffled, so groups interleave."""
    order = list(convs)
    random.Random(seed + 1).shuffle(order)
    return order


@dataclass(frozen=True)
class Arrival:
    """When a conversation opens (seconds from the start) and how long its user thinks before each
    later turn (seconds after the previous turn's response ended)."""

    start_s: float
    think_s: tuple[float, ...]


def arrivals(conversations: int, turns: int, rate: float, think_mean_s: float, seed: int) -> list[Arrival]:
    """An open-loop schedule: conversations open as a Poisson process of ``rate`` per second (the first
    at 0), think times are exponential with mean ``think_mean_s``. Unlike a fixed-concurrency client,
    a request here is not held back until an earlier one finished, so queueing at a busy engine shows in
    its TTFT instead of being absorbed by the client (coordinated omission). Pure and seeded: every
    router and round gets the same schedule."""
    if rate <= 0:
        raise ValueError(f"arrival rate must be > 0 conversations/s, got {rate}")
    if think_mean_s < 0:
        raise ValueError(f"think time must be >= 0 s, got {think_mean_s}")
    rng = random.Random(seed + 2)
    out, t = [], 0.0
    for i in range(conversations):
        if i:
            t += rng.expovariate(rate)
        think = tuple(rng.expovariate(1 / think_mean_s) if think_mean_s else 0.0 for _ in range(turns - 1))
        out.append(Arrival(round(t, 3), tuple(round(x, 3) for x in think)))
    return out


def distinct_blocks(token_lists: Sequence[Sequence[int]], block_size: int) -> int:
    """Number of distinct full KV blocks (as prefix-chained keys) over all prompts: the working set."""
    seen: set[object] = set()
    for ids in token_lists:
        key: object = None
        for end in range(block_size, len(ids) + 1, block_size):
            key = (key, tuple(ids[end - block_size : end]))  # chained like vLLM's block hashes
            seen.add(key)
    return len(seen)


def ideal_hit_rate(token_lists: Sequence[Sequence[int]], block_size: int) -> float:
    """Hit rate with one unbounded prefix cache, prompts served one by one in the given order: the
    ceiling for any router. Like vLLM, the last prompt token is always computed, so only full blocks
    within the first len-1 tokens can hit; every full block is cached, the last one too (a prompt that
    ends on a block boundary leaves that block for the next turn)."""
    seen: set[object] = set()
    hits = total = 0
    for ids in token_lists:
        key: object = None
        matching = True
        for end in range(block_size, len(ids) + 1, block_size):
            key = (key, tuple(ids[end - block_size : end]))
            if matching and end < len(ids) and key in seen:
                hits += block_size
            else:
                matching = False
            seen.add(key)
        total += len(ids)
    return hits / total if total else 0.0


def bounded_hit_rate(token_lists: Sequence[Sequence[int]], block_size: int, capacity_blocks: int) -> float:
    """The most any router can reach when the cluster holds ``capacity_blocks`` KV blocks in all,
    prompts served one by one in the given order: the lower of the oracle (:func:`ideal_hit_rate`) and
    one cache of that size evicting by Belady's rule (the block used again furthest in the future).

    Why it bounds every placement over engines whose pools sum to ``capacity_blocks``: at any moment the
    blocks the engines hold, pooled, fit in one such cache (copies only waste room), every block a
    prompt computes is cached, and no eviction order finds blocks more often than Belady's. To stay a
    bound it counts every block found, even past a missed one or in a prompt's last token (vLLM reuses a
    prefix only up to its first miss, and always computes the last token). The oracle minus this is
    what capacity costs, which no router can win back."""
    refs: list[object] = []  # block keys, chained like vLLM's hashes, in the order requests use them
    for ids in token_lists:
        key: object = None
        for end in range(block_size, len(ids) + 1, block_size):
            key = (key, tuple(ids[end - block_size : end]))
            refs.append(key)
    never = len(refs)
    next_use = [never] * len(refs)
    later: dict[object, int] = {}
    for i in range(len(refs) - 1, -1, -1):
        next_use[i] = later.get(refs[i], never)
        later[refs[i]] = i
    cached: dict[object, int] = {}  # block -> its next use
    heap: list[tuple[int, int, object]] = []  # (-next use, tie, block); stale entries are skipped
    found = 0
    for i, key in enumerate(refs):
        if key in cached:
            found += 1
        elif len(cached) >= capacity_blocks:
            if capacity_blocks <= 0:
                continue
            while True:
                neg, _, victim = heapq.heappop(heap)
                if cached.get(victim) == -neg:
                    del cached[victim]
                    break
        cached[key] = next_use[i]
        heapq.heappush(heap, (-next_use[i], i, key))
    total = sum(len(ids) for ids in token_lists)
    belady = found * block_size / total if total else 0.0
    return min(belady, ideal_hit_rate(token_lists, block_size))
