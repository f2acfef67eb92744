"""EndpointSlice → endpoint mapping, the watcher's event handling, static endpoints and CLI flags."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from kvstrata.api.router_config import Discovery, StaticEndpoint
from kvstrata.router.discovery import (
    ApiAccess,
    EndpointSliceWatcher,
    slice_endpoints,
    static_specs,
    union_specs,
)
from kvstrata.router.main import UsageError, build_parser, load_settings, parse_endpoint
from kvstrata.router.pool import EndpointPool, EndpointSpec

DISC = Discovery(service="demo-engine", engine_port=8000, kv_events_port=5557, kv_replay_port=5558)


def eps_slice(name: str, endpoints: list[dict[str, Any]], address_type: str = "IPv4") -> dict[str, Any]:
    return {"metadata": {"name": name}, "addressType": address_type, "endpoints": endpoints}


def test_ready_endpoints_become_engine_specs() -> None:
    s = eps_slice(
        "demo-engine-abc",
        [
            {"addresses": ["10.0.0.1"], "conditions": {"ready": True}},
            {"addresses": ["10.0.0.2"], "conditions": {"ready": False}},
            {"addresses": ["10.0.0.3"], "conditions": {"ready": True, "terminating": True}},
            {"addresses": ["10.0.0.4"]},  # ready unknown → treated as ready
        ],
    )
    assert slice_endpoints(s, DISC) == [
        EndpointSpec("http://10.0.0.1:8000", "tcp://10.0.0.1:5557", "tcp://10.0.0.1:5558"),
        EndpointSpec("http://10.0.0.4:8000", "tcp://10.0.0.4:5557", "tcp://10.0.0.4:5558"),
    ]


def test_an_nvme_tiers_janitor_is_found_next_to_its_engine() -> None:
    disc = DISC.model_copy(update={"fs_janitor_port": 9402})
    (spec,) = slice_endpoints(eps_slice("s", [{"addresses": ["10.0.0.1"]}]), disc)
    assert spec.fs_janitor == "http://10.0.0.1:9402"
    (static,) = static_specs([StaticEndpoint(url="http://e:8000/", fs_janitor="http://e:9402/")])
    assert static == EndpointSpec("http://e:8000", fs_janitor="http://e:9402")


def test_ipv6_fqdn_and_empty_slices() -> None:
    v6 = eps_slice("s6", [{"addresses": ["fd00::1"], "conditions": {"ready": True}}], "IPv6")
    assert slice_endpoints(v6, DISC)[0].url == "http://[fd00::1]:8000"
    assert slice_endpoints(eps_slice("f", [{"addresses": ["a.b"]}], "FQDN"), DISC) == []
    assert slice_endpoints({"metadata": {"name": "e"}, "endpoints": None}, DISC) == []


def test_union_over_slices_deduplicates() -> None:
    a = eps_slice("a", [{"addresses": ["10.0.0.1"]}, {"addresses": ["10.0.0.2"]}])
    b = eps_slice("b", [{"addresses": ["10.0.0.2"]}, {"addresses": ["10.0.0.3"]}])
    assert [s.url for s in union_specs({"b": b, "a": a}, DISC)] == [
        "http://10.0.0.1:8000",
        "http://10.0.0.2:8000",
        "http://10.0.0.3:8000",
    ]


def test_watch_events_add_and_remove_pool_members_at_once() -> None:
    pool = EndpointPool()
    removed: list[str] = []
    pool.subscribe(lambda ep: None, lambda ep: removed.append(ep.url))
    w = EndpointSliceWatcher(DISC, "ns", ApiAccess("https://127.0.0.1:6443"), pool.replace)
    w.apply_event("ADDED", eps_slice("a", [{"addresses": ["10.0.0.1"]}, {"addresses": ["10.0.0.2"]}]))
    assert sorted(e.url for e in pool.all()) == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]
    # Pod 2 goes not-ready: it leaves the pool in the same call.
    w.apply_event(
        "MODIFIED",
        eps_slice(
            "a", [{"addresses": ["10.0.0.1"]}, {"addresses": ["10.0.0.2"], "conditions": {"ready": False}}]
        ),
    )
    assert [e.url for e in pool.all()] == ["http://10.0.0.1:8000"] and removed == ["http://10.0.0.2:8000"]
    w.apply_event("DELETED", eps_slice("a", []))
    assert len(pool) == 0
    w.apply_event("BOOKMARK", {"metadata": {"name": "x"}})
    assert "labelSelector=kubernetes.io%2Fservice-name%3Ddemo-engine" in w._url
    assert "/namespaces/ns/endpointslices" in w._url


def test_pool_replace_reports_changes_and_renews_changed_specs() -> None:
    pool = EndpointPool()
    added, removed = pool.replace([EndpointSpec("http://a"), EndpointSpec("http://b", "tcp://b:1")])
    assert (added, removed) == (["http://a", "http://b"], [])
    a = pool.get("http://a")
    added, removed = pool.replace([EndpointSpec("http://a"), EndpointSpec("http://b", "tcp://b:2")])
    assert (added, removed) == (["http://b"], ["http://b"])
    assert pool.get("http://a") is a  # unchanged endpoints keep their state


def test_static_specs_strip_trailing_slash() -> None:
    assert static_specs([StaticEndpoint(url="http://x:1/", kv_events="tcp://x:2")]) == [
        EndpointSpec("http://x:1", "tcp://x:2", None)
    ]


def test_endpoint_flag() -> None:
    e = parse_endpoint("http://127.0.0.1:8001,events=tcp://127.0.0.1:5557,replay=tcp://127.0.0.1:5558")
    assert (e.url, e.kv_events, e.kv_replay) == (
        "http://127.0.0.1:8001",
        "tcp://127.0.0.1:5557",
        "tcp://127.0.0.1:5558",
    )
    assert parse_endpoint("http://h:1").kv_events is None
    for bad in ("h:1", "http://h:1,events=h:2", "http://h:1,foo=tcp://h:2", "http://h:1,replay=tcp://h:3"):
        with pytest.raises(UsageError):
            parse_endpoint(bad)


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


def test_flags_override_the_config_file(tmp_path: Path) -> None:
    cfg = tmp_path / "router.json"
    cfg.write_text(
        json.dumps(
            {
                "model": "m",
                "blockSize": 64,
                "policy": "round-robin",
                "discovery": {"service": "eng", "namespace": "ns"},
            }
        )
    )
    s = load_settings(_args("--config", str(cfg)))
    assert (s.model, s.block_size, s.policy, s.discovery.service) == ("m", 64, "round-robin", "eng")
    s = load_settings(_args("--config", str(cfg), "--block-size", "32", "--endpoint", "http://h:1"))
    assert s.block_size == 32 and s.discovery.service is None and s.discovery.namespace == "ns"
    assert [e.url for e in s.discovery.static] == ["http://h:1"]
    with pytest.raises(UsageError, match="model"):
        load_settings(_args())
    cfg.write_text("[1]")
    with pytest.raises(UsageError, match="JSON object"):
        load_settings(_args("--config", str(cfg)))


def test_environment_sits_between_the_config_file_and_flags(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = tmp_path / "router.json"
    cfg.write_text(json.dumps({"model": "m", "blockSize": 64, "queueWeight": 0.5, "weights": {"load": 0.3}}))
    monkeypatch.setenv("KVSTRATA_ROUTER_QUEUE_WEIGHT", "1")
    monkeypatch.setenv("KVSTRATA_ROUTER_SCRAPE_INTERVAL_SECONDS", "5")
    monkeypatch.setenv("KVSTRATA_ROUTER_WEIGHTS", '{"load": 0.9, "cacheRoom": 0}')
    monkeypatch.setenv("KVSTRATA_ROUTER_BLOCK_SIZE", "16")
    monkeypatch.setenv("KVSTRATA_ROUTER_SESSION_HEADER", "x-session-id")  # not JSON: taken as a string
    s = load_settings(_args("--config", str(cfg), "--block-size", "32"))
    assert (s.queue_weight, s.scrape_interval_seconds, s.weights.load, s.weights.cache_room) == (1, 5, 0.9, 0)
    assert s.block_size == 32 and s.session_header == "x-session-id"  # the flag wins over the environment
    monkeypatch.setenv("KVSTRATA_ROUTER_QUEUE_WEIGHT", "-1")
    with pytest.raises(ValidationError, match=r"queue_?[wW]eight"):
        load_settings(_args("--config", str(cfg)))
