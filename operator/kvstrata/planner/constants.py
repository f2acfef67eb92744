"""Ports, paths and topics shared by the engine flags, the rendered pods and the router config."""

KV_EVENTS_PORT = 5557
KV_REPLAY_PORT = 5558
KV_EVENTS_TOPIC = "kv-events"
LMCACHE_PORT = 5555
NVME_MOUNT = "/kv-cache"
MODEL_MOUNT = "/models"
HF_HOME = "/cache/huggingface"
