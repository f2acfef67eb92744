"""kvstrata: a Kubernetes operator for KV-cache-aware LLM inference clusters."""

__version__ = "0.1.0"
