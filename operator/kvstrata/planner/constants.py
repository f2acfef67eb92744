"""Ports, paths, topics and defaults shared by the engine flags, the rendered pods and the router config."""

KV_EVENTS_PORT = 5557
KV_REPLAY_PORT = 5558
KV_EVENTS_TOPIC = "kv-events"
LMCACHE_PORT = 5555
NVME_MOUNT = "/kv-cache"
MODEL_MOUNT = "/models"
HF_HOME = "/cache/huggingface"


def engine_cpus(device: str, tensor_parallel_size: int, requested: str | None) -> str:
    """The engine container's CPU request: what the manifest asks, else 4 per GPU (tokenizer, scheduler,
    API server) or 2 on device cpu."""
    return requested or (str(4 * tensor_parallel_size) if device == "gpu" else "2")
