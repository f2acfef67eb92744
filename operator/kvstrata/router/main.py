"""``kvstrata router``: run the KV-cache-aware prefix-affinity router.

    kvstrata router --config /etc/kvstrata/router.json
    kvstrata router --model tiny --tokenizer ./tiny-llama --block-size 32 \\
        --endpoint http://127.0.0.1:8001,events=tcp://127.0.0.1:5557,replay=tcp://127.0.0.1:5558

Flags override ``KVSTRATA_ROUTER_<FIELD>`` environment variables, which override the config file;
``--endpoint`` (repeatable) replaces its endpoint list with a static one.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import logging
import os
import signal
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from kvstrata.api.router_config import POLICIES, ROUTER_PORT, RouterSettings, StaticEndpoint
from kvstrata.router import COMPILED
from kvstrata.router.discovery import DiscoveryError
from kvstrata.router.hashing import UnsupportedHashAlgo, check_algo
from kvstrata.router.loop import new_loop
from kvstrata.router.prompts import ChatTemplateError, LocalTokenizer, TokenizerLoadError

log = logging.getLogger("kvstrata.router")
# Allocations (less frees) between two young collections: collect_rarely.
_YOUNG_COLLECTION_ALLOCATIONS = 50_000


class UsageError(ValueError):
    pass


def parse_endpoint(value: str) -> StaticEndpoint:
    """``URL[,events=tcp://H:P][,replay=tcp://H:P]``."""
    url, *opts = [part.strip() for part in value.split(",")]
    if not url.startswith(("http://", "https://")):
        raise UsageError(f"--endpoint {value!r}: the first part must be an http(s) URL")
    fields: dict[str, str] = {}
    for opt in opts:
        key, sep, val = opt.partition("=")
        if not sep or key not in ("events", "replay") or not val.startswith("tcp://"):
            raise UsageError(
                f"--endpoint {value!r}: expected events=tcp://HOST:PORT or replay=tcp://HOST:PORT, got {opt!r}"
            )
        fields[key] = val
    if "replay" in fields and "events" not in fields:
        raise UsageError(f"--endpoint {value!r}: replay= needs events=")
    return StaticEndpoint(url=url.rstrip("/"), kv_events=fields.get("events"), kv_replay=fields.get("replay"))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvstrata router", description="KV-cache-aware prefix-affinity router")
    p.add_argument("--config", type=Path, help="router.json (RouterSettings, camelCase keys)")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=ROUTER_PORT)
    p.add_argument("--model", help="served model name")
    p.add_argument("--tokenizer", help="directory with the engine's tokenizer.json (+ tokenizer_config.json)")
    p.add_argument("--block-size", type=int)
    p.add_argument("--policy", choices=POLICIES)
    p.add_argument(
        "--endpoint",
        action="append",
        default=[],
        metavar="URL[,events=tcp://H:P][,replay=tcp://H:P]",
        help="static engine endpoint (repeatable); replaces discovery from the config",
    )
    p.add_argument(
        "--log-level", default="INFO", type=str.upper, choices=["DEBUG", "INFO", "WARNING", "ERROR"]
    )
    p.add_argument(
        "--log-decisions",
        action="store_true",
        help="log every routing decision with each endpoint's scores (whatever --log-level says)",
    )
    return p


def load_settings(args: argparse.Namespace) -> RouterSettings:
    data: dict[str, Any] = {}
    if args.config is not None:
        try:
            data = json.loads(args.config.read_text())
        except OSError as exc:
            raise UsageError(f"cannot read --config {args.config}: {exc.strerror or exc}") from None
        except json.JSONDecodeError as exc:
            raise UsageError(f"--config {args.config} is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise UsageError(f"--config {args.config} must hold a JSON object")
    data.update(env_settings(os.environ, data))
    overrides = {
        "model": args.model,
        "tokenizer": args.tokenizer,
        "blockSize": args.block_size,
        "policy": args.policy,
    }
    for key, value in overrides.items():
        if value is not None:
            data.pop(_snake(key), None)
            data[key] = value
    if args.endpoint:
        eps = [parse_endpoint(e).model_dump(by_alias=True) for e in args.endpoint]
        disc = dict(data.get("discovery") or {})
        disc.pop("service", None)
        disc["static"] = eps
        data["discovery"] = disc
    if "model" not in data:
        raise UsageError('the served model name is required: --model NAME or "model" in --config')
    return RouterSettings.model_validate(data)


ENV_PREFIX = "KVSTRATA_ROUTER_"


def env_settings(environ: Mapping[str, str], data: Mapping[str, Any]) -> dict[str, Any]:
    """Settings from ``KVSTRATA_ROUTER_<FIELD>`` variables (e.g. ``KVSTRATA_ROUTER_QUEUE_WEIGHT=0.5``,
    ``KVSTRATA_ROUTER_WEIGHTS='{"load": 0.5}'``): over --config, under flags. Values are JSON when they
    parse as JSON, else strings; the settings model checks them like any other source."""
    out: dict[str, Any] = {}
    for name, field in RouterSettings.model_fields.items():
        raw = environ.get(ENV_PREFIX + name.upper())
        if raw is None:
            continue
        try:
            value: Any = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        alias = field.alias or name
        if alias not in data and name in data:
            out[name] = value  # keep the key spelling --config used, so one source wins, not both
        else:
            out[alias] = value
    return out


def _snake(camel: str) -> str:
    return "".join("_" + c.lower() if c.isupper() else c for c in camel)


def _explain(exc: ValidationError) -> str:
    lines = [f"  {'.'.join(str(p) for p in e['loc']) or '(root)'}: {e['msg']}" for e in exc.errors()]
    return "invalid router settings:\n" + "\n".join(lines)


async def run(
    settings: RouterSettings, host: str, port: int, tokenizer: LocalTokenizer | None = None
) -> None:
    from kvstrata.router.service import RouterService

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    async with RouterService(settings, tokenizer=tokenizer) as svc:
        await svc.serve(host, port)
        collect_rarely()
        assert svc.router is not None
        log.info(
            "kvstrata router on %s:%d: model %s, policy %s, block size %d, %d endpoint(s), tokenizer %s",
            host,
            port,
            settings.model,
            settings.policy,
            settings.block_size,
            len(svc.router.pool),
            settings.tokenizer
            or ("engine /tokenize" if settings.remote_tokenize else "none (character blocks)"),
        )
        if COMPILED.active:
            log.info("request path compiled by mypyc (%s)", COMPILED.directory)
        else:
            log.warning(
                "request path runs from source, at about 1.4x its CPU per request: %s", COMPILED.reason
            )
        await stop.wait()
        log.info("shutting down")


def collect_rarely() -> None:
    """Keep the cycle collector out of the request path: the router frees what a request made by
    reference counting (its collections find no cycles), so the collector's passes are pure cost.

    - Everything loaded so far (libraries, settings, the tokenizer) lives as long as the process: out of
      the collector's sight, a full collection walks only what requests made since. Each 4 MB prompt
      set one off, and over the ~80,000 objects of start-up it held every thread, the event loop too,
      for 100-115 ms (`make bench-router-overhead`, beside-huge).
    - A young collection runs every ``_YOUNG_COLLECTION_ALLOCATIONS`` objects allocated and not yet
      freed, not CPython's 700. At 700 one ran every few requests and moved the requests in flight and
      the index's live predictions (~60,000 objects at 2,000 requests/s) into the older generations,
      whose passes then walked them: 7.8 % of the router's CPU in `make bench-proxy`'s kv-aware load
      (6,084 young, 553 middle and 50 full collections in 30 s, the full ones 11.5 ms each). At 50,000:
      two young collections in those 30 s, of at most 9 ms."""
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(_YOUNG_COLLECTION_ALLOCATIONS, middle, old)


def _run_native(main: Any) -> None:
    with asyncio.Runner(loop_factory=new_loop) as runner:
        runner.run(main)


def _runner(settings: RouterSettings) -> Any:
    """How the router's event loop runs: uvloop, but for the native data plane, whose front shares the
    loop's lock (router/loop.py)."""
    if settings.data_plane == "native":
        return _run_native
    try:
        import uvloop

        return uvloop.run
    except ImportError:  # uvloop is optional at runtime (e.g. on platforms without wheels)
        return asyncio.run


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.log_decisions:
        logging.getLogger("kvstrata.router.route").setLevel(logging.DEBUG)
    try:
        settings = load_settings(args)
    except UsageError as exc:
        print(f"kvstrata router: {exc}", file=sys.stderr)
        return 2
    except ValidationError as exc:
        print(f"kvstrata router: {_explain(exc)}", file=sys.stderr)
        return 2
    try:
        # Load (and check) the tokenizer and hash settings before anything binds a port.
        check_algo(settings.hash_algo)
        tokenizer = LocalTokenizer(settings.tokenizer) if settings.tokenizer else None
    except (TokenizerLoadError, ChatTemplateError, UnsupportedHashAlgo) as exc:
        print(f"kvstrata router: {exc}", file=sys.stderr)
        return 2
    try:
        _runner(settings)(run(settings, args.host, args.port, tokenizer))
    except DiscoveryError as exc:
        print(f"kvstrata router: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(
            f"kvstrata router: cannot serve on {args.host}:{args.port}: {exc.strerror or exc}",
            file=sys.stderr,
        )
        return 1
    except KeyboardInterrupt:
        pass
    return 0
