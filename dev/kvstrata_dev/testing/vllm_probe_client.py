"""Project-side calls into vLLM's own code, through ``vllm_probe.py`` run by the vLLM venv's python.

One probe process per call (vLLM takes ~10 s of CPU to import), so batch: pass many cases or argvs at once.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvstrata_dev.testing.engines import vllm_python

PROBE = Path(__file__).with_name("vllm_probe.py")


class ProbeError(RuntimeError):
    """The probe failed as a whole, or vLLM could not read a given config."""


def run_probe(request: Mapping[str, Any], *, timeout: float = 1800.0) -> dict[str, Any]:
    """Send one JSON request to the probe and return its JSON reply."""
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
    proc = subprocess.run(
        [str(vllm_python()), str(PROBE)],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        check=False,
    )
    try:
        reply = json.loads(proc.stdout)
    except ValueError:
        raise ProbeError(
            f"probe exited {proc.returncode} without a JSON reply; stderr tail:\n{proc.stderr[-3000:]}"
        ) from None
    if "error" in reply:
        raise ProbeError(f"probe: {reply['error']}\n{proc.stderr[-3000:]}")
    return reply


def kv_spec_case(
    config: Mapping[str, Any],
    kv_dtype: str = "auto",
    block_size: int = 16,
    *,
    tensor_parallel: int = 1,
    dtype: str = "auto",
) -> dict[str, Any]:
    return {
        "config": dict(config),
        "kv_cache_dtype": kv_dtype,
        "block_size": block_size,
        "tensor_parallel": tensor_parallel,
        "dtype": dtype,
    }


def vllm_kv_specs(cases: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """vLLM's own KV spec for each case (see :func:`kv_spec_case`); a case vLLM rejects has ``ok: False``.

    Each result holds ``bytes_per_token`` (all attention layers, one TP rank),
    ``bytes_per_token_per_layer``, ``num_layers``, ``num_kv_heads`` (per rank), ``head_size``,
    ``use_mla``, ``spec_classes``, ``sliding_windows``, ``kv_cache_dtype``, ``kv_dtype_bytes``."""
    return run_probe({"op": "kv-spec", "cases": [dict(c) for c in cases]})["results"]


def vllm_kv_spec(
    config: Mapping[str, Any], kv_dtype: str, block_size: int, *, tensor_parallel: int = 1
) -> dict[str, Any]:
    """One case of :func:`vllm_kv_specs`; raises ProbeError when vLLM cannot read the config."""
    (result,) = vllm_kv_specs([kv_spec_case(config, kv_dtype, block_size, tensor_parallel=tensor_parallel)])
    if not result["ok"]:
        raise ProbeError(result["error"])
    return result


def vllm_kv_capacities(cases: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """vLLM's own pool sizing per case: a :func:`kv_spec_case` plus ``max_model_len``,
    ``available_bytes`` (KV memory of one rank) and optionally ``num_gpu_blocks_override``.

    Each result has ``refused``; when False ``num_blocks``, ``kv_cache_size_tokens`` and
    ``max_concurrency`` (the figures vLLM logs), when True ``estimated_max_model_len`` and ``error``
    (vLLM's start-up message)."""
    return run_probe({"op": "kv-capacity", "cases": [dict(c) for c in cases]})["results"]


def vllm_parse_args(
    argvs: Sequence[Sequence[str]], *, server: bool = True, from_cli_args: bool = True
) -> list[tuple[bool, str]]:
    """Whether vLLM's own api_server parser accepts each argv (flags after the program), and why not.

    ``server=False`` parses engine arguments only; ``from_cli_args`` also builds ``AsyncEngineArgs``
    from the namespace (catches bad JSON in --kv-transfer-config and the like)."""
    reply = run_probe(
        {
            "op": "parse-args",
            "argvs": [[str(a) for a in argv] for argv in argvs],
            "server": server,
            "from_cli_args": from_cli_args,
        }
    )
    return [(bool(r["ok"]), str(r["error"])) for r in reply["results"]]
