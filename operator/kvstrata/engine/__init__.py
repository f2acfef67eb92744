"""Code that runs inside the engine pod, not in the operator: vLLM's CPU-platform offloading worker
(`cpu_offload`, imported only by vLLM) and the NVMe-tier janitor (`fsjanitor`, a sidecar process).

Nothing else in the product imports this package's modules: `cpu_offload` imports vLLM, which only the
engine image has (a unit test enforces the rule)."""
