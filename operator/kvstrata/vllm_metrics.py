"""vLLM's load gauges from its Prometheus text: the one parser the router's scraper and the controller's
cache status both use (here, so the router need not import the controller).

vLLM 0.32.0 names: ``vllm:num_requests_running``, ``vllm:num_requests_waiting`` and
``vllm:kv_cache_usage_perc`` (a 0..1 fraction despite the name), one sample per engine core / DP rank;
the KV pool's size is the ``num_gpu_blocks`` label of the info gauge ``vllm:cache_config_info``.
A line scan, not ``prometheus_client``'s parser: the router scrapes every engine every second on its event
loop, and a full parse of a real engine's /metrics (55 kB, histograms) takes ~30 ms there against ~0.5 ms
for the scan. Unparseable lines are skipped, never fatal.
"""

from __future__ import annotations

from dataclasses import dataclass, field

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
CACHE_CONFIG = "vllm:cache_config_info"
_NUM_BLOCKS_LABEL = 'num_gpu_blocks="'


@dataclass(frozen=True, slots=True)
class LoadGauges:
    """Each gauge's samples, one per label set (engine core / DP rank); empty when not exported."""

    running: list[float] = field(default_factory=list)
    waiting: list[float] = field(default_factory=list)
    kv_usage: list[float] = field(default_factory=list)
    kv_blocks: list[int] = field(default_factory=list)  # num_gpu_blocks per engine core


def scan_load_gauges(text: str) -> LoadGauges:
    out = LoadGauges()
    by_name = {RUNNING: out.running, WAITING: out.waiting, KV_USAGE: out.kv_usage}
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name, _, rest = line.partition("{")
        if name == CACHE_CONFIG:
            _, found, tail = rest.partition(_NUM_BLOCKS_LABEL)
            blocks = tail.partition('"')[0]
            if found and blocks.isdigit():
                out.kv_blocks.append(int(blocks))
            continue
        if not rest:
            name, _, value_text = line.partition(" ")
        else:
            value_text = rest.rpartition("}")[2]
        values = by_name.get(name.strip())
        if values is None:
            continue
        try:
            values.append(float(value_text.split()[0]))
        except (IndexError, ValueError):
            continue
    return out
