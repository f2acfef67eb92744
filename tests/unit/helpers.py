"""Small builders for unit tests: manifests, and stand-in HTTP servers on loopback."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from aiohttp import web

from kvstrata_dev.testing.manifests import with_changes

__all__ = ["EXAMPLES", "example", "serve", "with_changes"]

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def example(name: str) -> dict[str, Any]:
    return yaml.safe_load((EXAMPLES / name).read_text())


async def serve(app: web.Application) -> tuple[web.AppRunner, int]:
    """Start ``app`` on a free loopback port; the caller cleans the runner up."""
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
