"""Ask vLLM itself: run with the vLLM venv's python, as a file, JSON request on stdin, JSON reply on stdout.

The project's venv does not contain vLLM (it pins its own torch and ~60 libraries), so tests that must
agree with vLLM run this script in vLLM's venv through ``kvstrata_dev.testing.vllm_probe_client``. It uses
only the standard library and vLLM, never the kvstrata package.

Operations (``{"op": ..., ...}`` on stdin):

``kv-spec``  ``{"cases": [{"config": {HF config.json}, "kv_cache_dtype": "auto", "block_size": 32,
             "tensor_parallel": 1, "dtype": "auto"}]}`` → per case the KV bytes per token per layer and in
             total on one TP rank, from vLLM's own ``ModelConfig`` (head counts, head size, MLA, layers,
             sliding windows) and its KV-cache spec classes (``FullAttentionSpec``, ``SlidingWindowSpec``,
             ``MLAAttentionSpec``: ``page_size_bytes / block_size``).
``kv-capacity`` ``{"cases": [{...kv-spec case..., "max_model_len": L, "available_bytes": N,
             "num_gpu_blocks_override": null, "max_num_batched_tokens": 2048, "async_scheduling": false}]}`` → vLLM's own pool sizing for N bytes of KV memory on one
             rank (``get_kv_cache_configs``): blocks, the logged capacity and concurrency, or its start-up
             refusal with the estimated maximum model length.
``parse-args`` ``{"argvs": [[flag, ...], ...], "from_cli_args": true}`` → per argv whether vLLM's own
             server parser accepts it, with its error message when not.

Run by hand: ``echo '{"op": "parse-args", "argvs": [["--kv-cache-dtype", "int8"]]}' |
VLLM_TARGET_DEVICE=cpu ~/.cache/kvstrata/vllm-0.32.0/bin/python dev/kvstrata_dev/testing/vllm_probe.py``
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import re
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

# ---------------------------------------------------------------------------------------------------
# kv-spec


_MODEL_CONFIGS: dict[str, Any] = {}


def _model_config(config: dict[str, Any], dtype: str) -> Any:
    # Built once per (config, dtype): cases often vary only the KV dtype, block size or TP size.
    key = json.dumps([config, dtype], sort_keys=True)
    if key not in _MODEL_CONFIGS:
        _MODEL_CONFIGS[key] = _build_model_config(config, dtype)
    return _MODEL_CONFIGS[key]


def _build_model_config(config: dict[str, Any], dtype: str) -> Any:
    """vLLM's ModelConfig for a directory holding only this config.json: no weights, no tokenizer.

    Built for real (not re-derived from the dict), so head counts, head size, MLA detection, layer count
    and sliding windows are vLLM's own reading of the config. No model in the catalog needed the
    class-level fallback the brief allowed, so there is none: a config vLLM cannot read is an error."""
    from vllm.config import ModelConfig

    tmp = Path(tempfile.mkdtemp(prefix="kvstrata-probe-"))
    (tmp / "config.json").write_text(json.dumps(config))
    return ModelConfig(model=str(tmp), tokenizer=str(tmp), skip_tokenizer_init=True, dtype=dtype)


def _layer_windows(model_config: Any, num_layers: int) -> list[int | None]:
    """Per-layer sliding window, by vLLM's two rules:
    engine/arg_utils.py sets CacheConfig.sliding_window (applied to every layer) only when the config
    has no ``layer_types`` or all layers slide; otherwise the model code (llama.py, gemma2.py, ...) gives
    ``sliding_window`` to exactly the layers whose ``layer_types`` entry is ``sliding_attention``."""
    if model_config.disable_sliding_window:
        return [None] * num_layers
    window = model_config.get_sliding_window()
    layer_types = getattr(model_config.hf_text_config, "layer_types", None)
    if layer_types is None or all(t == "sliding_attention" for t in layer_types):
        return [window] * num_layers
    return [window if t == "sliding_attention" else None for t in layer_types[:num_layers]]


def _layer_specs(mc: Any, pc: Any, kv_dtype_str: str, block_size: int) -> list[Any]:
    """One KV-cache spec per attention layer on one rank, built as vLLM's attention layers build them."""
    from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
        get_kv_quant_mode,
    )

    kv_dtype = kv_cache_dtype_str_to_dtype(kv_dtype_str, mc)
    num_layers = mc.get_num_layers_by_block_type(pc, "attention")
    quant_mode = get_kv_quant_mode(kv_dtype_str)
    if mc.use_mla:
        # As MLAAttention.get_kv_cache_spec (layers/attention/mla_attention.py) builds it.
        spec = MLAAttentionSpec(
            block_size=block_size,
            num_kv_heads=1,
            max_tp_shards=1,
            head_size=mc.get_head_size(),
            dtype=kv_dtype,
            cache_dtype_str=kv_dtype_str,
            kv_quant_mode=quant_mode,
            state_content_bytes={"fp8_ds_mla": 656, "nvfp4_ds_mla": 352}.get(kv_dtype_str),
        )
        return [spec] * num_layers
    # As Attention.get_kv_cache_spec (layers/attention/attention.py) builds it. The engine gives
    # sliding-window layers their own block size; the bytes per token do not depend on it.
    specs = []
    for window in _layer_windows(mc, num_layers):
        common = dict(
            block_size=block_size,
            num_kv_heads=mc.get_num_kv_heads(pc),
            head_size=mc.get_head_size(),
            dtype=kv_dtype,
            kv_quant_mode=quant_mode,
        )
        if window is None:
            specs.append(FullAttentionSpec(**common))
        else:
            specs.append(SlidingWindowSpec(**common, sliding_window=window))
    return specs


def kv_spec_case(case: dict[str, Any]) -> dict[str, Any]:
    import torch
    from vllm.config import ParallelConfig
    from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype, resolve_kv_cache_dtype_string

    block_size = int(case.get("block_size", 16))
    tp = int(case.get("tensor_parallel", 1))
    mc = _model_config(case["config"], str(case.get("dtype", "auto")))
    pc = ParallelConfig(tensor_parallel_size=tp)
    kv_dtype_str = resolve_kv_cache_dtype_string(str(case.get("kv_cache_dtype", "auto")), mc)
    kv_dtype = kv_cache_dtype_str_to_dtype(kv_dtype_str, mc)
    num_layers = mc.get_num_layers_by_block_type(pc, "attention")
    head_size = mc.get_head_size()
    num_kv_heads = mc.get_num_kv_heads(pc)
    specs = _layer_specs(mc, pc, kv_dtype_str, block_size)
    per_layer = []
    for spec in specs:
        if spec.page_size_bytes % block_size:
            raise ValueError(f"page size {spec.page_size_bytes} is not a whole number of bytes per token")
        per_layer.append(spec.page_size_bytes // block_size)
    return {
        "method": "ModelConfig",
        "architectures": list(mc.architectures),
        "use_mla": bool(mc.use_mla),
        "num_layers": num_layers,
        "num_kv_heads": num_kv_heads,
        "total_num_kv_heads": mc.get_total_num_kv_heads(),
        "head_size": head_size,
        "model_dtype": str(mc.dtype).removeprefix("torch."),
        "kv_cache_dtype": kv_dtype_str,
        "kv_cache_torch_dtype": str(kv_dtype).removeprefix("torch."),
        "kv_dtype_bytes": torch.tensor([], dtype=kv_dtype).element_size(),
        "block_size": block_size,
        "max_model_len": mc.max_model_len,
        "spec_classes": [type(s).__name__ for s in specs],
        "sliding_windows": [getattr(s, "sliding_window", None) for s in specs],
        "page_size_bytes": [s.page_size_bytes for s in specs],
        "bytes_per_token_per_layer": per_layer,
        "bytes_per_token": sum(per_layer),
    }


def op_kv_spec(req: dict[str, Any]) -> dict[str, Any]:
    results = []
    for case in req["cases"]:
        try:
            results.append({"ok": True, **kv_spec_case(case)})
        except Exception as exc:
            results.append({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
    return {"results": results}


# ---------------------------------------------------------------------------------------------------
# kv-capacity

_REFUSAL_ESTIMATE = re.compile(r"the estimated maximum model length is (\d+)")


def kv_capacity_case(case: dict[str, Any]) -> dict[str, Any]:
    """vLLM's own pool sizing for a given KV memory: get_kv_cache_configs, as the engine core runs it
    after the workers report their available memory (v1/core/kv_cache_utils.py). Either the block count
    and the logged capacity, or vLLM's start-up refusal with its estimated maximum model length."""
    from vllm.config import CacheConfig, ParallelConfig, SchedulerConfig, VllmConfig
    from vllm.utils.torch_utils import resolve_kv_cache_dtype_string
    from vllm.v1.core.kv_cache_utils import get_kv_cache_capacity, get_kv_cache_configs

    block_size = int(case.get("block_size", 16))
    tp = int(case.get("tensor_parallel", 1))
    mc = copy.deepcopy(_model_config(case["config"], str(case.get("dtype", "auto"))))
    if case.get("max_model_len"):
        mc.max_model_len = int(case["max_model_len"])
    pc = ParallelConfig(tensor_parallel_size=tp)
    kv_dtype_str = resolve_kv_cache_dtype_string(str(case.get("kv_cache_dtype", "auto")), mc)
    cc = CacheConfig(
        block_size=block_size,
        cache_dtype=kv_dtype_str,
        num_gpu_blocks_override=case.get("num_gpu_blocks_override"),
    )
    # The engine core resolves the layout from the attention backends; a layer-outer layout (the GPU
    # default, NHD) adds no per-block padding for uniform full-attention or MLA layers.
    cc.kv_cache_layout = "LBNHC"
    # Sliding-window layers reserve the window plus every in-flight token (max_concurrent_batches x
    # max_num_batched_tokens, VllmConfig.max_in_flight_tokens), so both are inputs here.
    sched = SchedulerConfig(
        max_model_len=mc.max_model_len,
        is_encoder_decoder=False,
        max_num_batched_tokens=int(
            case.get("max_num_batched_tokens") or SchedulerConfig.DEFAULT_MAX_NUM_BATCHED_TOKENS
        ),
        async_scheduling=bool(case.get("async_scheduling", False)),
    )
    vllm_config = VllmConfig(model_config=mc, parallel_config=pc, cache_config=cc, scheduler_config=sched)
    specs = _layer_specs(mc, pc, kv_dtype_str, block_size)
    spec_by_layer = {f"model.layers.{i}.self_attn.attn": spec for i, spec in enumerate(specs)}
    try:
        (kv_config,) = get_kv_cache_configs(vllm_config, [spec_by_layer], [int(case["available_bytes"])])
    except ValueError as exc:
        estimate = _REFUSAL_ESTIMATE.search(str(exc))
        return {
            "refused": True,
            "error": str(exc),
            "estimated_max_model_len": int(estimate.group(1)) if estimate else 0,
            "max_model_len": mc.max_model_len,
        }
    tokens, concurrency = get_kv_cache_capacity(vllm_config, kv_config)
    return {
        "refused": False,
        "num_blocks": kv_config.num_blocks,
        "kv_cache_size_tokens": tokens,
        "max_concurrency": concurrency,
        "max_model_len": mc.max_model_len,
        "block_size": block_size,
        "max_in_flight_tokens": vllm_config.max_in_flight_tokens,
        "num_groups": len(kv_config.kv_cache_groups),
    }


def op_kv_capacity(req: dict[str, Any]) -> dict[str, Any]:
    results = []
    for case in req["cases"]:
        try:
            results.append({"ok": True, **kv_capacity_case(case)})
        except Exception as exc:
            results.append({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
    return {"results": results}


# ---------------------------------------------------------------------------------------------------
# parse-args


def op_parse_args(req: dict[str, Any]) -> dict[str, Any]:
    """By default the api_server's own parser and checks (entrypoints/launchers/api_server/entry.py:
    engine args + frontend flags such as --host, --port, --served-model-name), which is what a container
    running `python -m vllm.entrypoints.openai.api_server` parses. server=false: engine args only
    (FlexibleArgumentParser + AsyncEngineArgs.add_cli_args)."""
    import vllm.engine.arg_utils as arg_utils
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    # With HF_HUB_OFFLINE (kept on so nothing here can reach a hub) __post_init__ rewrites --model into a
    # local snapshot path and fails for paths that exist only inside a container (/models/...). That
    # rewrite is a convenience, not a check of the flags, so it is neutralised here.
    arg_utils.get_model_path = lambda model, revision=None: model
    server = bool(req.get("server", True))
    run_from_cli_args = bool(req.get("from_cli_args", True))
    results = []
    for argv in req["argvs"]:
        parser = FlexibleArgumentParser(prog="vllm.entrypoints.openai.api_server")
        if server:
            parser = make_arg_parser(parser)
        else:
            AsyncEngineArgs.add_cli_args(parser)
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                ns = parser.parse_args([str(a) for a in argv])
                if server:
                    validate_parsed_serve_args(ns)
            if run_from_cli_args:
                AsyncEngineArgs.from_cli_args(ns)
            results.append({"ok": True, "error": ""})
        except SystemExit:
            # argparse prints "usage: ..." then "error: ..."; the last line is the reason.
            lines = [ln for ln in err.getvalue().splitlines() if ln.strip()]
            results.append({"ok": False, "error": lines[-1] if lines else "rejected"})
        except Exception as exc:
            results.append({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
    return {"results": results}


# ---------------------------------------------------------------------------------------------------

OPS = {"kv-spec": op_kv_spec, "kv-capacity": op_kv_capacity, "parse-args": op_parse_args}


def main() -> int:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    # vLLM logs to stdout; keep the real stdout for the one JSON reply and send everything else to stderr.
    reply_fd = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = io.TextIOWrapper(os.fdopen(1, "wb", closefd=False), line_buffering=True)
    try:
        req = json.load(sys.stdin)
        op = OPS.get(req.get("op", ""))
        if op is None:
            reply: dict[str, Any] = {"error": f"unknown op {req.get('op')!r}; known: {', '.join(OPS)}"}
        else:
            reply = op(req)
        code = 0
    except Exception as exc:
        traceback.print_exc()
        reply, code = {"error": f"{type(exc).__name__}: {exc}"}, 1
    with os.fdopen(reply_fd, "w") as out:
        json.dump(reply, out)
        out.write("\n")
    return code


if __name__ == "__main__":
    raise SystemExit(main())
