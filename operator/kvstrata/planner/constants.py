"""Ports, paths and defaults shared by the engine flags and the rendered pods (the ones the router must
agree on live in the contract module, kvstrata.api.router_config, and are re-exported here)."""

from kvstrata.api.router_config import KV_EVENTS_PORT, KV_EVENTS_TOPIC, KV_REPLAY_PORT

__all__ = [
    "HF_HOME",
    "KV_EVENTS_PORT",
    "KV_EVENTS_TOPIC",
    "KV_REPLAY_PORT",
    "LMCACHE_PORT",
    "MODEL_MOUNT",
    "NVME_MOUNT",
    "engine_cpus",
]
LMCACHE_PORT = 5555
NVME_MOUNT = "/kv-cache"
MODEL_MOUNT = "/models"
HF_HOME = "/cache/huggingface"


def engine_cpus(device: str, tensor_parallel_size: int, requested: str | None) -> str:
    """The engine container's CPU request: what the manifest asks, else 4 per GPU (tokenizer, scheduler,
    API server) or 2 on device cpu."""
    return requested or (str(4 * tensor_parallel_size) if device == "gpu" else "2")
