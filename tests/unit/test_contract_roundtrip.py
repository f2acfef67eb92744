"""The operator↔router contract round-trips: every router-relevant value the CRD admits is rendered into
router.json, and the router starts from that file (its settings, hash check and core, as `kvstrata router`
does) and routes with it."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, get_args

import pytest
from helpers import example, with_changes
from pydantic import ValidationError

from kvstrata.api.manifest import ManifestError, validate
from kvstrata.api.models import HashAlgo, KvCacheSpec, RouterSpec, RoutingPolicy
from kvstrata.api.router_config import HASH_ALGOS, POLICIES, RouterSettings
from kvstrata.planner import plan
from kvstrata.render import render
from kvstrata.router.core import Router
from kvstrata.router.hashing import block_hashes, check_algo
from kvstrata.router.main import build_parser, load_settings
from kvstrata.router.metrics import RouterMetrics


def _router_json(doc: dict[str, Any]) -> str:
    ic = validate(doc)
    p = plan(ic.spec)
    assert p.feasible, p.summary()
    (cm,) = [o for o in render(ic.metadata.name, "ns1", ic.spec, p, "uid") if o["kind"] == "ConfigMap"]
    body: str = cm["data"]["router.json"]
    return body


def _start(body: str, tmp_path: Path) -> tuple[RouterSettings, Router]:
    path = tmp_path / "router.json"
    path.write_text(body)
    args: argparse.Namespace = build_parser().parse_args(["--config", str(path)])
    settings = load_settings(args)
    check_algo(settings.hash_algo)
    # The tokenizer path is a mount inside the router pod; the hashing under test needs no tokenizer.
    return settings, Router(settings.model_copy(update={"tokenizer": None}), RouterMetrics())


def test_the_crd_and_the_router_admit_the_same_values() -> None:
    assert get_args(HashAlgo) == HASH_ALGOS
    assert get_args(RoutingPolicy) == POLICIES
    assert (
        RouterSettings.model_fields["hash_algo"].annotation
        == KvCacheSpec.model_fields["hash_algo"].annotation
    )
    assert RouterSettings.model_fields["policy"].annotation == RouterSpec.model_fields["policy"].annotation


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_every_admitted_value_is_rendered_and_accepted_by_the_router(
    policy: str, algo: str, tmp_path: Path
) -> None:
    doc = with_changes(
        example("tiny-cpu.yaml"), {"spec.router.policy": policy, "spec.kvCache.hashAlgo": algo}
    )
    settings, router = _start(_router_json(doc), tmp_path)
    try:
        assert (settings.policy, settings.hash_algo) == (policy, algo)
        ids = list(range(3 * settings.block_size))
        assert router._hash_tokens(ids) == (
            len(ids),
            block_hashes(ids, settings.block_size, settings.hash_algo),
        )
    finally:
        router.close()


def test_the_hash_algorithms_hash_differently() -> None:
    ids = list(range(64))
    assert block_hashes(ids, 32, "sha256") != block_hashes(ids, 32, "sha256_cbor")


@pytest.mark.parametrize("algo", ["xxhash", "xxhash_cbor", "md5"])
def test_unreproducible_hash_algorithms_are_refused_at_admission(algo: str) -> None:
    doc = with_changes(example("tiny-cpu.yaml"), {"spec.kvCache.hashAlgo": algo})
    with pytest.raises(ManifestError, match="hashAlgo"):
        validate(doc)
    with pytest.raises(ValidationError, match="hash"):
        RouterSettings.model_validate({"model": "m", "hashAlgo": algo})


def test_a_hash_seed_on_the_engines_is_refused_at_admission() -> None:
    env = [{"name": "PYTHONHASHSEED", "value": "0"}]
    with pytest.raises(ManifestError, match="PYTHONHASHSEED"):
        validate(with_changes(example("tiny-cpu.yaml"), {"spec.engine.env": env}))
