"""The router benchmark's workload family: draws are seeded and pure, stay in their ranges and the
machine budget, say what was scaled; prompts extend turn by turn; pooled figures pair draws."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import pytest
from bench import family
from bench.family import Draw, conversations, draw, fit_budget, paired, schedule
from bench.family_bench import KVSTRATA, combine, pooled, render
from bench.report import read_json

from kvstrata_dev.repo import REPO

RESULTS = REPO / "bench" / "results"


def words(text: str) -> int:
    return len(text.split())


def test_draws_are_pure_and_cover_the_family() -> None:
    draws = [draw(s) for s in range(1, 41)]
    assert draws == [draw(s) for s in range(1, 41)]
    for d in draws:
        assert family.TENANTS[0] <= d.tenants <= family.TENANTS[1]
        assert family.TURNS[0] <= d.turns <= family.TURNS[1]
        assert family.CAPACITY_RATIO[0] <= d.capacity_ratio <= family.CAPACITY_RATIO[1]
        assert d.requests <= family.MAX_REQUESTS or d.tenants * d.turns > family.MAX_REQUESTS
        assert d.prompt_len_estimate(d.turns - 1) + d.max_tokens <= family.MAX_PROMPT_LEN
    # Every categorical choice and both regimes occur in 40 draws.
    assert {d.api for d in draws} == {"completions", "chat"}
    assert {d.arrival for d in draws} == {"closed", "poisson", "bursty"}
    assert {d.regime() for d in draws} == {"pressure", "rich"}


def test_budget_lowers_counts_together_and_records_it() -> None:
    big = Draw(
        seed=0, tenants=24, users_per_tenant=4, turns=6, system_tokens=200, user_tokens=20, reply_tokens=10,
        max_tokens=4, api="chat", arrival="closed", concurrency=4, rate=0.5, think_s=1.0, burst=3,
        capacity_ratio=0.5,
    )  # fmt: skip
    d = fit_budget(big)
    assert d.requests <= family.MAX_REQUESTS and d.prompt_tokens_estimate() <= family.MAX_PROMPT_TOKENS
    assert d.tenants > 2 and d.users_per_tenant > 1 and d.turns > 2  # the shape survives
    assert any(s.startswith("tenants 24->") for s in d.scaled)
    small = dataclasses.replace(big, tenants=2, users_per_tenant=1, turns=2)
    assert fit_budget(small) == small


def test_turns_extend_each_other_and_tenants_share_their_system_prompt() -> None:
    d = dataclasses.replace(draw(3), user_tokens=20, reply_tokens=10, system_tokens=60)
    convs = conversations(d, words)
    assert len(convs) == d.conversations
    for c in convs:
        for k in range(1, d.turns):
            assert c.prompt(k - 1).removesuffix("\nassistant:") in c.prompt(k)
            assert c.messages(k)[: 2 * k] == c.messages(k - 1)
    systems = {c.tenant: c.turns[0][0] for c in convs}
    assert all(c.turns[0][0] == systems[c.tenant] for c in convs) and len(systems) == d.tenants
    assert convs[0].scripted("chat").requests[0][0] == "/v1/chat/completions"
    assert "prompt" in convs[0].scripted("completions").requests[-1][1]


def test_schedules() -> None:
    closed = dataclasses.replace(draw(1), arrival="closed")
    assert schedule(closed) is None
    bursty = dataclasses.replace(draw(1), arrival="bursty", burst=3, tenants=4, users_per_tenant=3)
    plan = schedule(bursty)
    assert plan is not None and len(plan) == 12
    starts = [a.start_s for a in plan]
    assert starts == sorted(starts) and len(set(starts)) == 4  # four bursts of three


def test_paired_mean_and_standard_error() -> None:
    assert paired([]) is None
    assert paired([2.0]) == (2.0, 0.0)
    m, se = paired([1.0, 3.0])
    assert m == 2.0 and se == pytest.approx(1.0)


def _row(
    name: str,
    requests: list[dict[str, Any]] | None = None,
    *,
    hit: float = 0.5,
    mean: float = 100.0,
    p99: float | None = None,
) -> dict[str, Any]:
    """A router's row of a draw: its hit rate, TTFT mean and p99 (the mean unless given), no errors, and
    its requests where the test reads them."""
    row: dict[str, Any] = {
        "router": name,
        "hit_rate": hit,
        "ttft_ms_mean": mean,
        "ttft_ms_p99": mean if p99 is None else p99,
        "errors": 0,
    }
    if requests is not None:
        row["per_request"] = requests
    return row


def _draw_row(regime: str, mine: float, peer: float, ttft_mine: float, ttft_peer: float) -> dict[str, object]:
    return {
        "regime": regime,
        "results": [
            _row(KVSTRATA, hit=mine, mean=ttft_mine, p99=2 * ttft_mine),
            _row("peer/x", hit=peer, mean=ttft_peer, p99=2 * ttft_peer),
        ],
    }


def test_pooled_pairs_draws_per_regime() -> None:
    draws = [
        _draw_row("pressure", 0.6, 0.5, 100, 200),
        _draw_row("pressure", 0.4, 0.5, 300, 200),
        _draw_row("rich", 0.8, 0.8, 100, 100),
    ]
    out = pooled(draws, [KVSTRATA, "peer/x"])
    pressure = out["pressure"]["vs"]["peer/x"]
    assert out["pressure"]["draws"] == 2 and pressure["pairs"] == 2
    assert pressure["hit_points"][0] == pytest.approx(0.0)
    assert pressure["ttft_mean_ratio"][0] == pytest.approx((0.5 + 1.5) / 2)
    assert pressure["hit_ge_peer_draws"] == 1
    assert out["rich"]["hit_ge_best_peer_draws"] == 1 and out["all"]["draws"] == 3


def test_runs_of_two_seed_windows_pool_as_one_and_a_seed_twice_is_refused() -> None:
    def run(*draws: tuple[int, dict[str, Any]]) -> dict[str, Any]:
        rows = [{**d, "seed": seed} for seed, d in draws]
        routers = [KVSTRATA, "peer/x"]
        return {
            "routers": routers,
            "machine": {},
            "draws_planned": len(rows),
            "draws": rows,
            "pooled": pooled(rows, routers),
            "total_s": 10.0,
        }

    first = run((1, _draw_row("pressure", 0.6, 0.5, 100, 200)))
    second = run((3, _draw_row("pressure", 0.4, 0.5, 300, 200)), (2, _draw_row("rich", 0.8, 0.8, 100, 100)))
    both = combine([second, first])
    assert [d["seed"] for d in both["draws"]] == [1, 2, 3] and both["total_s"] == 20.0
    assert both["pooled"] == pooled(both["draws"], [KVSTRATA, "peer/x"])
    assert both["pooled"]["pressure"]["vs"]["peer/x"]["pairs"] == 2
    with pytest.raises(SystemExit, match="more than one run"):
        combine([first, first])
    # A run with one more router (a variant) pools with the others over the routers both have.
    variant = f"{KVSTRATA}@v"
    third = run((4, _draw_row("pressure", 0.7, 0.5, 100, 200)))
    third["routers"] = [KVSTRATA, variant, "peer/x"]
    third["draws"][0]["results"].append({**third["draws"][0]["results"][0], "router": variant})
    mixed = combine([first, third])
    assert mixed["routers"] == [KVSTRATA, "peer/x"] and mixed["left_out"] == [variant]
    assert all(r["router"] != variant for d in mixed["draws"] for r in d["results"])
    assert mixed["pooled"]["pressure"]["vs"]["peer/x"]["pairs"] == 2
    lone = run((5, _draw_row("rich", 0.8, 0.8, 100, 100)))
    lone["routers"] = [KVSTRATA, "peer/y"]
    with pytest.raises(SystemExit, match="share no comparison"):
        combine([first, {**lone, "draws": [{**lone["draws"][0], "seed": 6}]}])


def test_the_kept_runs_pool_and_render() -> None:
    """The family runs kept in bench/results/ are what docs/benchmarks.md's figures are recomputed
    from: each still reads, they pool as one (no seed twice), and the report renders them."""
    runs = [read_json(path) for path in sorted(RESULTS.glob("family-*.json.gz"))]
    assert runs, f"no kept run in {RESULTS}"
    both = combine(runs)
    assert len(both["draws"]) == sum(len(r["draws"]) for r in runs) >= 20
    assert {"pressure", "rich"} <= {d["regime"] for d in both["draws"]}
    report = render(both)
    assert "pressure:" in report and "rich:" in report


def test_the_best_peer_is_taken_figure_by_figure_and_a_kvstrata_variant_is_no_peer() -> None:
    draw_row = {
        "regime": "pressure",
        "results": [
            _row(KVSTRATA, hit=0.5, mean=100, p99=400),
            _row("peer/a", hit=0.6, mean=200, p99=200),  # the best hit rate and p99
            _row("peer/b", hit=0.4, mean=50, p99=800),  # the best mean
            _row(
                "kvstrata/kv-aware@no-admission", hit=0.9, mean=10, p99=10
            ),  # an ablation: never the best peer
        ],
    }
    routers = [KVSTRATA, "peer/a", "peer/b", "kvstrata/kv-aware@no-admission"]
    out = pooled([draw_row], routers)["pressure"]
    assert out["vs_best_peer_hit_points"][0] == pytest.approx(-10.0)
    assert out["vs_best_peer_ttft_mean_ratio"][0] == pytest.approx(2.0)
    assert out["vs_best_peer_ttft_p99_ratio"][0] == pytest.approx(2.0)
    assert out["hit_ge_best_peer_draws"] == 0
    assert out["vs"]["kvstrata/kv-aware@no-admission"]["pairs"] == 1  # still paired, as an ablation


def test_every_router_is_held_to_the_per_draw_goals_against_the_best_of_the_others() -> None:
    draws = [
        {
            "regime": "pressure",
            "results": [
                _row(KVSTRATA, hit=0.5, mean=100, p99=400),
                _row("peer/a", hit=0.6, mean=200, p99=200),  # the best hit rate and p99, not the best mean
                _row("peer/b", hit=0.4, mean=50, p99=800),
                _row(
                    "kvstrata/kv-aware@no-admission", hit=0.9, mean=10, p99=10
                ),  # an ablation: not held, not a bar
            ],
        },
        {
            "regime": "pressure",
            "results": [
                _row(KVSTRATA, hit=0.7, mean=100, p99=200),  # the best on every figure
                _row("peer/a", hit=0.7, mean=150, p99=300),  # ties the hit rate
                _row("peer/b", hit=0.5, mean=120, p99=250),
            ],
        },
    ]
    routers = [KVSTRATA, "peer/a", "peer/b", "kvstrata/kv-aware@no-admission"]
    out = pooled(draws, routers)["pressure"]["every_draw_yardstick"]
    assert out == {
        KVSTRATA: {"draws": 2, "hit_ge_best_other": 1, "no_worse_on_every_figure": 1},
        "peer/a": {"draws": 2, "hit_ge_best_other": 2, "no_worse_on_every_figure": 0},
        "peer/b": {"draws": 2, "hit_ge_best_other": 0, "no_worse_on_every_figure": 0},
    }
    report = render({"draws": [], "routers": routers, "pooled": pooled(draws, routers), "total_s": 0})
    assert f"{KVSTRATA} hit ≥ in 1 of 2, no worse on every figure in 1" in report


def test_reruns_give_the_spread_of_one_router_and_a_loss_is_weighed_against_it() -> None:
    peer, kv_again, peer_again = "peer/a", f"{KVSTRATA}@rerun", "peer/a@rerun"
    routers = [KVSTRATA, peer, kv_again, peer_again]

    def draw_of(hits: tuple[float, ...], means: tuple[float, ...] = (100, 100, 100, 100)) -> dict[str, Any]:
        rows = [_row(n, hit=h, mean=m, p99=2 * m) for n, h, m in zip(routers, hits, means, strict=True)]
        return {"regime": "pressure", "results": rows}

    draws = [
        # A loss of 2 points where each router's rerun moved by up to 5: within the noise.
        draw_of((0.50, 0.52, 0.55, 0.51), (100, 100, 150, 50)),
        # A loss of 10 points where the reruns moved by 1: beyond it.
        draw_of((0.40, 0.50, 0.41, 0.50)),
        # A win: no loss to weigh.
        draw_of((0.70, 0.60, 0.70, 0.60)),
    ]
    out = pooled(draws, routers)["pressure"]
    spread = out["rerun_spread"][KVSTRATA]
    assert spread["pairs"] == 3
    assert spread["hit_points_abs_mean"] == pytest.approx((5 + 1 + 0) / 3)
    assert spread["hit_points_abs_max"] == pytest.approx(5.0)
    assert spread["ttft_mean_ratio_range"] == pytest.approx((100 / 150, 1.0))
    assert out["rerun_spread"][peer]["ttft_mean_ratio_range"] == pytest.approx((1.0, 2.0))
    assert out["hit_losses_beyond_rerun"] == (2, 1)
    # A peer's rerun is no second peer: the best peer of draw 1 is peer/a's first run (0.52), not 0.51.
    assert out["vs_best_peer_hit_points"][0] == pytest.approx((-2 - 10 + 10) / 3)
    # Without reruns there is nothing to weigh a loss against.
    assert pooled(draws, [KVSTRATA, peer])["pressure"]["hit_losses_beyond_rerun"] is None


def test_seed_lists_and_router_variants() -> None:
    from bench.family_bench import _seed_list
    from bench.procs import BenchError
    from bench.routers import variant_env

    assert _seed_list("1,3,5-7") == [1, 3, 5, 6, 7]
    for bad in ("", "1,1", "a-b"):
        with pytest.raises(argparse.ArgumentTypeError):
            _seed_list(bad)
    assert variant_env("kvstrata/kv-aware@no-admission") == {
        "KVSTRATA_ROUTER_ADMISSION": '{"enabled": false}'
    }
    assert variant_env("sglang-router/cache_aware") == {}
    assert variant_env("sglang-router/cache_aware@rerun") == variant_env("kvstrata/kv-aware@rerun") == {}
    # The variants' variables are settings the router takes: each changes exactly its field.
    from kvstrata.api.router_config import RouterSettings
    from kvstrata.router.main import env_settings

    def settings(variant: str) -> RouterSettings:
        base = {"model": "m"}
        return RouterSettings.model_validate({**base, **env_settings(variant_env(variant), base)})

    assert settings("kvstrata/kv-aware@share-bound").share_bound_factor == 1.3
    assert settings("kvstrata/kv-aware").share_bound_factor is None
    assert settings("kvstrata/kv-aware@no-admission").admission.enabled is False
    assert settings("kvstrata/kv-aware@wait-move").admission.move_when_held_past_prefill is True
    assert settings("kvstrata/kv-aware").admission.move_when_held_past_prefill is False
    spare = settings("kvstrata/kv-aware@move-to-spare-room").admission
    assert spare.move_to_spare_room is True and spare.move_when_held_past_prefill is False
    assert settings("kvstrata/kv-aware").admission.move_to_spare_room is False
    every = settings("kvstrata/kv-aware@anticipate").admission
    assert every.anticipate_seconds == 0.25 and not every.anticipate_only_evicted
    assert every.move_when_held_past_prefill is False
    default = settings("kvstrata/kv-aware").admission
    assert default.anticipate_seconds == 0.25 and default.anticipate_only_evicted
    assert settings("kvstrata/kv-aware@no-anticipate").admission.anticipate_seconds == 0
    for bad in ("kvstrata/kv-aware@nope", "sglang-router/cache_aware@no-admission"):
        with pytest.raises(BenchError, match="variant"):
            variant_env(bad)


def test_a_request_record_has_its_ttft_in_ms_and_what_the_engine_found_cached() -> None:
    from bench.client import Result

    late = Result(
        3, 1, True, 0.25, 0.4, start_s=2.0, prompt_tokens=300, cached_tokens=256, router={"held-ms": "12"}
    )
    failed = Result(1, 0, False, None, 0.1, "HTTP 503: busy", start_s=0.5)
    records = [r.record() for r in (failed, late)]
    assert records == [
        {
            "cid": 1,
            "turn": 0,
            "start_s": 0.5,
            "ttft_ms": None,
            "ok": False,
            "prompt_tokens": None,
            "cached_tokens": None,
        },
        {
            "cid": 3,
            "turn": 1,
            "start_s": 2.0,
            "ttft_ms": 250.0,
            "ok": True,
            "prompt_tokens": 300,
            "cached_tokens": 256,
            "router": {"held-ms": "12"},
        },
    ]


def _request(cid: int, turn: int, ttft: float | None, cached: int, **router: str) -> dict[str, Any]:
    """A request of a router's run, 100 prompt tokens; ``router``: the kvstrata headers it carries."""
    q: dict[str, Any] = {
        "cid": cid,
        "turn": turn,
        "ttft_ms": ttft,
        "prompt_tokens": 100,
        "cached_tokens": cached,
    }
    if router:
        q["router"] = dict(router)
    return q


def _report(draw_row: dict[str, Any]) -> str:
    """The report's text for one draw, pooled."""
    return render(
        {"draws": [], "routers": [KVSTRATA], "pooled": pooled([draw_row], [KVSTRATA]), "total_s": 0}
    )


def _group(
    n: int, share: float, ttft: float, peer_ttft: float, cached: float, peer_cached: float
) -> dict[str, Any]:
    """A group of a split as the report gives it (shares compared approximately)."""
    return {
        "requests": n,
        "share": pytest.approx(share),
        "ttft_ms": ttft,
        "peer_ttft_ms": peer_ttft,
        "cached_share": pytest.approx(cached),
        "peer_cached_share": pytest.approx(peer_cached),
    }


def test_kvstrata_requests_are_split_by_admission_beside_the_same_requests_through_the_best_peer() -> None:
    draw_row = {
        "regime": "pressure",
        "results": [
            _row(
                KVSTRATA,
                [
                    _request(0, 0, 100, 50, admission="direct"),
                    _request(0, 1, 500, 0, admission="stolen"),
                    _request(1, 0, 300, 80, admission="direct"),
                    _request(1, 1, None, 0, admission="queued"),
                ],
                mean=300,
            ),
            _row("peer/slow", [_request(c, t, 1, 0) for c in (0, 1) for t in (0, 1)], mean=900),
            # the best peer by TTFT mean: the one each request is compared with
            _row(
                "peer/fast",
                [
                    _request(0, 0, 200, 40),
                    _request(0, 1, 100, 60),
                    _request(1, 0, 100, 20),
                    _request(1, 1, 50, 90),
                ],
                mean=200,
            ),
        ],
    }
    out = pooled([draw_row], [KVSTRATA, "peer/slow", "peer/fast"])["pressure"]["by_admission"]
    # The failed request (no TTFT) is in no group: it has no time to compare.
    assert out == {
        "direct": _group(2, 2 / 3, 200.0, 150.0, 0.65, 0.3),
        "stolen": _group(1, 1 / 3, 500.0, 100.0, 0.0, 0.6),
    }
    report = _report(draw_row)
    assert "stolen 1 (33 %) 500 against 100, 0.0 against 60.0" in report


def test_kvstrata_follow_ups_are_split_by_whether_they_left_their_conversations_engine() -> None:
    mine = [
        _request(0, 0, 100, 0, endpoint="a"),
        _request(0, 1, 50, 90, endpoint="a"),  # stayed
        _request(0, 2, 300, 0, endpoint="b"),  # moved: its previous turn went to a
        _request(1, 0, 100, 0, endpoint="b"),
        _request(1, 1, 400, 10, endpoint="c"),  # moved
        _request(2, 1, 70, 80, endpoint="c"),  # its previous turn is missing: in no group
        _request(3, 0, 100, 0),
        _request(3, 1, 70, 80, endpoint="a"),  # its previous turn's engine is unknown: in no group
    ]
    peer = [_request(q["cid"], q["turn"], 200, 60) for q in mine]
    draw_row = {"regime": "pressure", "results": [_row(KVSTRATA, mine), _row("peer/one", peer)]}
    out = pooled([draw_row], [KVSTRATA, "peer/one"])["pressure"]["follow_ups_by_move"]
    assert out == {
        "moved": _group(2, 2 / 3, 350.0, 200.0, 0.05, 0.6),
        "stayed": _group(1, 1 / 3, 50.0, 200.0, 0.9, 0.6),
    }
    report = _report(draw_row)
    assert "follow-ups by engine (stayed with the previous turn's or moved)" in report
    assert "moved 2 (67 %) 350 against 200, 5.0 against 60.0" in report
