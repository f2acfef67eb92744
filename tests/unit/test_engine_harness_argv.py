"""The test engines run the operator's rendered engine flags, changed only where a local process must be.

The harness used to write its own vLLM command line; now it renders the engine's InferenceCluster spec
with planner/flags.py (what the operator puts in the pod) and `localize`s it. The argvs below are what
the old harness produced, recorded before the change: every flag and value in them is still there, but
the dtype, which now follows the machine's CPU (`engine_dtype`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvstrata.planner import plan
from kvstrata.render import render
from kvstrata.render.objects import ENGINE_CONTAINER
from kvstrata_dev.testing.engines import VllmEngine, engine_args, engine_dtype, engine_spec, native_bf16
from kvstrata_dev.testing.tinymodel import TinyModelParams, hf_config

EVENTS = '{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5600","topic":"kv-events"'
# engine_args("/m", host="127.0.0.1", port=8100, kv_events_port=5600, kv_replay_port=5601), before.
OLD_WITH_EVENTS = [
    "--model", "/m", "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", "8100",
    "--load-format", "dummy", "--dtype", engine_dtype(), "--block-size", "32", "--enable-prefix-caching",
    "--prefix-caching-hash-algo", "sha256", "--max-model-len", "4096", "--max-num-seqs", "16",
    "--kv-events-config", EVENTS + ',"replay_endpoint":"tcp://127.0.0.1:5601"}',
]  # fmt: skip
# The router tests' engines: block 32, 96 blocks, maxModelLen 2048, 8 sequences, events without replay.
OLD_SMALL_POOL = [
    "--model", "/m", "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", "8100",
    "--load-format", "dummy", "--dtype", engine_dtype(), "--block-size", "32", "--enable-prefix-caching",
    "--prefix-caching-hash-algo", "sha256", "--max-model-len", "2048", "--max-num-seqs", "8",
    "--num-gpu-blocks-override", "96", "--kv-events-config", EVENTS + "}", "--enable-prompt-tokens-details",
]  # fmt: skip
# What the renderer adds that the old harness left to vLLM: the KV dtype and the CPU batch budget are
# vLLM's own defaults (auto; 2048 for the CPU API server), prompt-token details add usage fields only.
RENDERER_ONLY = {
    "--kv-cache-dtype": "auto",
    "--max-num-batched-tokens": "2048",
    "--enable-prompt-tokens-details": None,
}


def flag_map(argv: list[str]) -> dict[str, str | None]:
    """Flag → value (None for a switch); the KV-event config parsed so key order does not matter."""
    out: dict[str, str | None] = {}
    for i, arg in enumerate(argv):
        if not arg.startswith("--"):
            continue
        value = argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else None
        if arg == "--kv-events-config" and value is not None:
            value = json.dumps(json.loads(value), sort_keys=True)
        out[arg] = value
    return out


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(
        json.dumps(hf_config(TinyModelParams("llama", 4, 512, 8, 8, 64, 4096, 4096, 0)))
    )
    return tmp_path


def _model(argv: list[str], model_dir: Path) -> list[str]:
    return [("/m" if a == str(model_dir) else a) for a in argv]


def test_typical_engine_keeps_every_old_flag(model_dir: Path) -> None:
    new = _model(
        engine_args(model_dir, host="127.0.0.1", port=8100, kv_events_port=5600, kv_replay_port=5601),
        model_dir,
    )
    assert flag_map(new) == {**flag_map(OLD_WITH_EVENTS), **RENDERER_ONLY}


def test_small_pool_engine_keeps_every_old_flag(model_dir: Path) -> None:
    new = engine_args(
        model_dir,
        host="127.0.0.1",
        port=8100,
        kv_events_port=5600,
        block_size=32,
        num_gpu_blocks_override=96,
        max_model_len=2048,
        max_num_seqs=8,
        extra_args=["--enable-prompt-tokens-details"],
    )
    assert flag_map(_model(new, model_dir)) == {**flag_map(OLD_SMALL_POOL), **RENDERER_ONLY}


def test_without_listeners_no_kv_event_sockets(model_dir: Path) -> None:
    new = engine_args(model_dir, host="127.0.0.1", port=8100)
    assert "--kv-events-config" not in new
    with pytest.raises(ValueError, match="kv_replay_port needs kv_events_port"):
        engine_args(model_dir, host="127.0.0.1", port=8100, kv_replay_port=5601)


def test_harness_argv_is_the_rendered_pods_args_but_for_the_local_step(model_dir: Path) -> None:
    spec = engine_spec(model_dir, num_gpu_blocks_override=96, max_model_len=2048, max_num_seqs=8)
    p = plan(spec)
    assert p.feasible, p.summary()
    sts = next(o for o in render("tiny", "ns", spec, p, uid="u") if o["kind"] == "StatefulSet")
    container = next(
        c for c in sts["spec"]["template"]["spec"]["containers"] if c["name"] == ENGINE_CONTAINER
    )
    pod = flag_map(container["args"])
    local = flag_map(
        engine_args(
            model_dir,
            host="127.0.0.1",
            port=8100,
            kv_events_port=5600,
            kv_replay_port=5601,
            num_gpu_blocks_override=96,
            max_model_len=2048,
            max_num_seqs=8,
        )
    )
    changed = {k for k in pod if pod[k] != local.get(k)}
    assert changed == {"--model", "--host", "--port", "--kv-events-config"}
    assert set(local) == set(pod)
    assert (local["--model"], local["--host"], local["--port"]) == (str(model_dir), "127.0.0.1", "8100")
    pod_events, local_events = (json.loads(m["--kv-events-config"] or "") for m in (pod, local))
    assert {k: v for k, v in local_events.items() if "endpoint" not in k} == {
        k: v for k, v in pod_events.items() if "endpoint" not in k
    }
    assert (local_events["endpoint"], local_events["replay_endpoint"]) == (
        "tcp://*:5600",
        "tcp://127.0.0.1:5601",
    )


AVX2_EPYC = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx avx2 fma\n"
SAPPHIRE_RAPIDS = "flags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
COOPER_LAKE = "flags\t\t: fpu avx2 avx512f avx512_bf16\n"


@pytest.mark.parametrize(
    ("cpuinfo", "native"),
    [(AVX2_EPYC, False), (SAPPHIRE_RAPIDS, True), (COOPER_LAKE, True), ("processor\t: 0\n", False)],
    ids=["avx2-only", "amx", "avx512-bf16", "no-flags-line"],
)
def test_bfloat16_only_where_the_cpu_computes_it(cpuinfo: str, native: bool) -> None:
    assert native_bf16(cpuinfo) is native


def test_test_engines_render_the_dtype_chosen_for_this_cpu(model_dir: Path) -> None:
    """The dtype is the spec's, so the planner prices the engine's KV in it (4 bytes in float32)."""
    spec = engine_spec(model_dir)
    assert spec.model.dtype == engine_dtype() in {"bfloat16", "float32"}
    per_token = plan(spec, suggest_fixes=False).kv_bytes_per_token_per_rank
    bf16 = plan(spec.model_copy(update={"model": spec.model.model_copy(update={"dtype": "bfloat16"})}))
    assert per_token == bf16.kv_bytes_per_token_per_rank * (2 if engine_dtype() == "float32" else 1)


def test_rebound_engine_keeps_every_flag_but_its_ports_and_log(tmp_path: Path) -> None:
    """What start_all boots in place of an engine whose port was taken before vLLM bound it."""
    first = VllmEngine.from_argv(["/bin/python", "-m", "api", *OLD_WITH_EVENTS], log_path=tmp_path / "e.log")
    again = first.rebound()
    fresh = {again.port, again.kv_events_port, again.kv_replay_port}
    assert None not in fresh and len(fresh) == 3
    assert not fresh & {first.port, first.kv_events_port, first.kv_replay_port}
    assert again.log_path != first.log_path and again.log_path.parent == tmp_path
    events = json.loads(again.argv[again.argv.index("--kv-events-config") + 1])
    assert events["endpoint"] == f"tcp://*:{again.kv_events_port}"
    assert events["replay_endpoint"] == f"tcp://127.0.0.1:{again.kv_replay_port}"
    assert again.argv[again.argv.index("--port") + 1] == str(again.port)
    changed = {i for i, (a, b) in enumerate(zip(first.argv, again.argv, strict=True)) if a != b}
    assert {first.argv[i - 1] for i in changed} == {"--port", "--kv-events-config"}
    assert again.env == first.env and not again.running()
