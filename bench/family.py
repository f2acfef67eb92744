"""The workload family of `make bench-router`: every seed draws a whole multi-tenant shape at random.

A benchmark of one shape, tuned over several sessions, said kvstrata led; users' own shapes said it
trailed. So no parameter of the workload is fixed here: each seed draws tenants (shared system prompts
or documents), users per tenant, turns, prompt and reply lengths (system prompts up to 3K tokens),
completions or chat, closed-loop or open-loop (Poisson or bursty) arrivals, and the cluster's KV
capacity as a multiple of the draw's working set (0.3x to 3x, log-uniform). The ranges are the
issue's; the seeds are 1..N in order, fixed before anything was measured.

One constraint is the machine's, not the family's: three CPU engines serve a few thousand prompt
tokens a second, so a draw is scaled down to at most ``MAX_REQUESTS`` requests and ``MAX_PROMPT_TOKENS``
prompt tokens by lowering tenants, users and turns together (each change is recorded in the draw).

Pure: the same seed and token counter always give the same draw and prompts.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from bench.client import CHAT, COMPLETIONS, Scripted
from bench.workload import Arrival, filler_text

Api = Literal["completions", "chat"]
ArrivalKind = Literal["closed", "poisson", "bursty"]
Message = tuple[str, str]  # (role, content)

TENANTS = (2, 24)
USERS_PER_TENANT = (1, 4)
TURNS = (2, 6)
SYSTEM_TOKENS = (128, 3200)  # log-uniform
USER_TOKENS = (16, 200)
REPLY_TOKENS = (8, 64)
MAX_TOKENS = (4, 16)
CAPACITY_RATIO = (0.3, 3.0)  # log-uniform: cluster KV blocks / working-set blocks
CONCURRENCY = (2, 8)
RATE = (0.2, 1.0)  # conversations opened per second, log-uniform
THINK_S = (0.5, 3.0)
BURST = (3, 8)  # conversations opening together in a bursty draw

MAX_REQUESTS = 48
MAX_PROMPT_TOKENS = 40_000
# The tiny model's positions (and the engines' max model len) cap the longest prompt.
MAX_PROMPT_LEN = 3900


@dataclass(frozen=True)
class Draw:
    seed: int
    tenants: int
    users_per_tenant: int
    turns: int
    system_tokens: int
    user_tokens: int
    reply_tokens: int
    max_tokens: int
    api: Api
    arrival: ArrivalKind
    concurrency: int
    rate: float
    think_s: float
    burst: int
    capacity_ratio: float
    # What the machine budget changed, e.g. ("users 4->2",).
    scaled: tuple[str, ...] = field(default=())

    @property
    def conversations(self) -> int:
        return self.tenants * self.users_per_tenant

    @property
    def requests(self) -> int:
        return self.conversations * self.turns

    def prompt_len_estimate(self, turn: int) -> int:
        """Tokens of turn ``turn``'s prompt (0-based), roughly: the system prompt and the history."""
        return self.system_tokens + (turn + 1) * (self.user_tokens + 8) + turn * (self.reply_tokens + 8)

    def prompt_tokens_estimate(self) -> int:
        return self.conversations * sum(self.prompt_len_estimate(k) for k in range(self.turns))

    def regime(self) -> str:
        return "pressure" if self.capacity_ratio < 1.0 else "rich"

    def label(self) -> str:
        return (
            f"seed {self.seed}: {self.tenants} tenants x {self.users_per_tenant} users x {self.turns} turns, "
            f"system {self.system_tokens} / user {self.user_tokens} / reply {self.reply_tokens} tokens, "
            f"{self.api}, {self._arrival_text()}, capacity {self.capacity_ratio:.2f}x working set"
            + (f" (scaled: {', '.join(self.scaled)})" if self.scaled else "")
        )

    def _arrival_text(self) -> str:
        if self.arrival == "closed":
            return f"closed loop x{self.concurrency}"
        burst = f" in bursts of {self.burst}" if self.arrival == "bursty" else ""
        return f"{self.arrival} {self.rate:.2f} conv/s{burst}, think {self.think_s:.1f} s"


def _log_uniform(rng: random.Random, lo: float, hi: float) -> float:
    return math.exp(rng.uniform(math.log(lo), math.log(hi)))


def draw(seed: int) -> Draw:
    """Every parameter at random from its range; then scaled to the machine budget."""
    rng = random.Random(f"kvstrata-family-{seed}")
    d = Draw(
        seed=seed,
        tenants=rng.randint(*TENANTS),
        users_per_tenant=rng.randint(*USERS_PER_TENANT),
        turns=rng.randint(*TURNS),
        system_tokens=round(_log_uniform(rng, *SYSTEM_TOKENS)),
        user_tokens=rng.randint(*USER_TOKENS),
        reply_tokens=rng.randint(*REPLY_TOKENS),
        max_tokens=rng.randint(*MAX_TOKENS),
        api=rng.choice(("completions", "chat")),
        arrival=rng.choice(("closed", "poisson", "bursty")),
        concurrency=rng.randint(*CONCURRENCY),
        rate=round(_log_uniform(rng, *RATE), 3),
        think_s=round(rng.uniform(*THINK_S), 2),
        burst=rng.randint(*BURST),
        capacity_ratio=round(_log_uniform(rng, *CAPACITY_RATIO), 3),
    )
    return fit_budget(d)


def fit_budget(d: Draw) -> Draw:
    """Scale ``d`` to the machine: the longest prompt shortened by its system prompt, then tenants, users
    and turns lowered together."""
    scaled = list(d.scaled)
    longest = d.prompt_len_estimate(d.turns - 1) + d.max_tokens
    if longest > MAX_PROMPT_LEN:
        system = max(SYSTEM_TOKENS[0], d.system_tokens - (longest - MAX_PROMPT_LEN))
        scaled.append(f"system {d.system_tokens}->{system}")
        d = replace(d, system_tokens=system)
        while d.turns > TURNS[0] and d.prompt_len_estimate(d.turns - 1) + d.max_tokens > MAX_PROMPT_LEN:
            scaled.append(f"turns {d.turns}->{d.turns - 1}")
            d = replace(d, turns=d.turns - 1)

    def over(x: Draw) -> bool:
        return x.requests > MAX_REQUESTS or x.prompt_tokens_estimate() > MAX_PROMPT_TOKENS

    # One step at a time off whichever of tenants, users and turns is furthest above its floor (as a
    # ratio), so a big draw keeps its shape (many tenants with several users each) at a smaller size.
    floors = {"tenants": TENANTS[0], "users_per_tenant": USERS_PER_TENANT[0], "turns": TURNS[0]}
    start = {name: getattr(d, name) for name in floors}
    while over(d):
        above = {n: getattr(d, n) / f for n, f in floors.items() if getattr(d, n) > f}
        if not above:
            break
        name = max(above, key=lambda n: above[n])
        d = replace(d, **{name: getattr(d, name) - 1})
    scaled += [
        f"{name.replace('_per_tenant', '')} {start[name]}->{getattr(d, name)}"
        for name in floors
        if getattr(d, name) != start[name]
    ]
    return replace(d, scaled=tuple(scaled))


@dataclass(frozen=True)
class FamilyConversation:
    """One user's conversation with a tenant's system prompt. ``turns[k]`` is the message list of
    request k (chat) and ``prompts[k]`` its completions prompt; each extends the previous exactly."""

    cid: int
    tenant: int
    turns: tuple[tuple[Message, ...], ...]

    def prompt(self, k: int) -> str:
        """The completions form of turn k: the messages as plain text, system prompt first."""
        lines = (content if role == "system" else f"{role}: {content}" for role, content in self.turns[k])
        return "\n".join(lines) + "\nassistant:"

    def messages(self, k: int) -> list[dict[str, str]]:
        return [{"role": role, "content": content} for role, content in self.turns[k]]

    def scripted(self, api: Api) -> Scripted:
        if api == "chat":
            return Scripted(
                self.cid, tuple((CHAT, {"messages": self.messages(k)}) for k in range(len(self.turns)))
            )
        return Scripted(
            self.cid, tuple((COMPLETIONS, {"prompt": self.prompt(k)}) for k in range(len(self.turns)))
        )


def conversations(d: Draw, count_tokens: Callable[[str], int]) -> list[FamilyConversation]:
    rng = random.Random(f"kvstrata-family-text-{d.seed}")
    systems = [
        f"You are assistant {t} of tenant {t}. Reference document follows.\n"
        + filler_text(rng, d.system_tokens, count_tokens)
        for t in range(d.tenants)
    ]
    out = []
    for cid in range(d.conversations):
        tenant = cid % d.tenants
        history: list[Message] = [("system", systems[tenant])]
        turns = []
        for _ in range(d.turns):
            history.append(("user", f"[user {cid}] " + filler_text(rng, d.user_tokens, count_tokens)))
            turns.append(tuple(history))
            history.append(("assistant", filler_text(rng, d.reply_tokens, count_tokens)))
        out.append(FamilyConversation(cid, tenant, tuple(turns)))
    order = list(out)
    random.Random(f"kvstrata-family-order-{d.seed}").shuffle(order)
    return order


def schedule(d: Draw) -> list[Arrival] | None:
    """None for a closed loop; otherwise when each conversation opens and its think times."""
    if d.arrival == "closed":
        return None
    rng = random.Random(f"kvstrata-family-arrivals-{d.seed}")
    burst = d.burst if d.arrival == "bursty" else 1
    out, t = [], 0.0
    for i in range(d.conversations):
        if i and i % burst == 0:
            # Bursts arrive at the same mean rate of conversations as a Poisson draw would.
            t += rng.expovariate(d.rate / burst)
        think = tuple(round(rng.expovariate(1 / d.think_s), 3) for _ in range(d.turns - 1))
        out.append(Arrival(round(t, 3), think))
    return out


def engine_blocks(d: Draw, working_set: int, longest: int, block_size: int, engines: int) -> int:
    """KV blocks per engine for the draw's capacity ratio, but never fewer than the longest request and
    vLLM's null block (below that vLLM refuses to start); the floor is why a draw's actual capacity can
    exceed its drawn ratio, and the regime is judged on the actual one."""
    floor = math.ceil(longest / block_size) + 1
    return max(math.ceil(d.capacity_ratio * working_set / engines), floor)


def paired(diffs: Sequence[float]) -> tuple[float, float] | None:
    """(mean, standard error) of paired per-draw differences; SE is 0 for a single draw."""
    n = len(diffs)
    if not n:
        return None
    m = sum(diffs) / n
    if n == 1:
        return m, 0.0
    var = sum((x - m) ** 2 for x in diffs) / (n - 1)
    return m, math.sqrt(var / n)
