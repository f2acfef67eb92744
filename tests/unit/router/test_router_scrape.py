"""Background load scraping: load from /metrics, unhealthy after failed scrapes, healthy again after one."""

from __future__ import annotations

import aiohttp
from aiohttp import web

from kvstrata.router.loadscrape import UNHEALTHY_AFTER, LoadScraper
from kvstrata.router.pool import Endpoint, EndpointPool, EndpointSpec
from kvstrata_dev.testing.engines import free_port


async def test_scrape_load_and_health(metrics_text: str) -> None:
    body = metrics_text.replace(
        'vllm:num_requests_waiting{engine="0",model_name="tiny"} 0.0',
        'vllm:num_requests_waiting{engine="0",model_name="tiny"} 3.0',
    )

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text=body)

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    pool = EndpointPool()
    pool.replace([EndpointSpec(f"http://127.0.0.1:{port}")])
    (ep,) = pool.all()
    downs: list[Endpoint] = []
    async with aiohttp.ClientSession() as session:
        scraper = LoadScraper(pool, session)
        scraper.on_down = downs.append
        # Nothing listens yet: refused connections make it unhealthy after UNHEALTHY_AFTER scrapes.
        for i in range(UNHEALTHY_AFTER):
            assert ep.healthy, f"unhealthy too early, after {i} failures"
            await scraper.scrape_all()
        assert not ep.healthy and downs == [ep]
        site = web.TCPSite(runner, "127.0.0.1", port)
        await site.start()
        await scraper.scrape_all()
        assert ep.healthy and ep.failures == 0
        assert (ep.waiting, ep.running, ep.scraped) == (3.0, 0.0, True)
        assert ep.load == 3.0
    await runner.cleanup()


def test_pool_size_comes_from_the_cache_config_info_label() -> None:
    from pathlib import Path

    from kvstrata.router.loadscrape import parse_load

    sample = Path(__file__).resolve().parents[3] / "fixtures" / "status-vllm-0.32.0-metrics-sample.txt"
    assert parse_load(sample.read_text()).kv_blocks == 320  # the real engine's num_gpu_blocks="320"
    assert parse_load('vllm:cache_config_info{engine="0",num_gpu_blocks="None"} 1.0').kv_blocks == 0
    assert parse_load("vllm:num_requests_running 2.0").kv_blocks == 0
