"""Start, watch and stop real vLLM CPU engines for tests, benchmarks and the e2e launcher.

vLLM lives in its own venv (``make vllm``; see scripts/install-vllm.sh), so engines run as
subprocesses of that venv's python. Each engine gets its own process group: vLLM forks an engine-core
process, and stopping the group is the only way to be sure nothing is left behind.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import signal
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from kvstrata.api.models import InferenceClusterSpec
from kvstrata.planner import flags, plan
from kvstrata.planner.arch import architecture_from_hf_config
from kvstrata.planner.constants import KV_EVENTS_TOPIC
from kvstrata.planner.flags import ENGINE_PYTHONPATH, unpinned_omp_env
from kvstrata_dev.localcluster.layout import service_port
from kvstrata_dev.repo import REPO
from kvstrata_dev.testing.tinymodel import kvstrata_cache

API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
_STOP_GRACE_S = 20.0
# vLLM log lines start with "(EngineCore pid=1) ERROR 11-22 18:35:32 [core.py:1510] ".
_LOG_PREFIX = re.compile(r"^\([^)]*\) [A-Z]+ \S+ \S+ \[[^\]]*\] ")
# "ValueError: ...": the summary line of a traceback.
_EXCEPTION_LINE = re.compile(r"^(?:[\w.]+\.)?\w*(?:Error|Exception): .*$")


# CPU flags (/proc/cpuinfo) under which vLLM's CPU backend computes bfloat16 natively (oneDNN).
_NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def cpuinfo_field(cpuinfo: str, name: str) -> str | None:
    """The first CPU's ``name`` field in a ``/proc/cpuinfo`` text (the CPUs of one machine are alike)."""
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == name:
            return value.strip()
    return None


def native_bf16(cpuinfo: str) -> bool:
    """Whether a CPU with this ``/proc/cpuinfo`` computes bfloat16 natively."""
    return not _NATIVE_BF16_FLAGS.isdisjoint((cpuinfo_field(cpuinfo, "flags") or "").split())


@functools.cache
def engine_dtype() -> str:
    """The test engines' weights dtype on this machine: bfloat16 where the CPU computes it natively,
    else float32. Without AVX512-BF16 or AMX, vLLM's CPU backend cannot build its oneDNN linear for
    bfloat16 and falls back to torch's emulated matmuls: on an AVX2-only EPYC the tiny model served 290
    prompt tokens/s in bfloat16 and 1,340 in float32, so every engine test and benchmark ran ~4.6x
    slower. The spec carries the dtype, so the planner's KV bytes per token follow it."""
    try:
        return "bfloat16" if native_bf16(Path("/proc/cpuinfo").read_text()) else "float32"
    except OSError:
        return "bfloat16"


# Restarts, with fresh ports, of an engine that found one of its ports taken (see start_engines).
PORT_RETRIES = 2


class EngineError(RuntimeError):
    """An engine failed to start, died, or the vLLM venv is missing."""


def vllm_venv() -> Path:
    return Path(os.environ.get("VLLM_VENV") or kvstrata_cache() / "vllm-0.32.0").expanduser()


def vllm_python() -> Path:
    """The python of the vLLM venv (``$VLLM_VENV``, default ``$KVSTRATA_CACHE/vllm-0.32.0``)."""
    venv = vllm_venv()
    python = venv / "bin" / "python"
    if not (venv / ".ok").exists() or not python.exists():
        raise EngineError(f"vLLM venv not found at {venv} (set VLLM_VENV, or run `make vllm` to install it)")
    return python


_handed_out: set[int] = set()
_handed_out_lock = threading.Lock()


def http_ok(url: str) -> bool:
    """Whether ``url`` answers 200 within 2 s."""
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return bool(resp.status == 200)
    except OSError:  # URLError included
        return False


def wait_http(url: str, timeout: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    """Until ``url`` answers 200 (AssertionError after ``timeout`` seconds, or once ``proc`` exits)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc is None or proc.poll() is None, f"{proc.args!r} exited with {proc.returncode}"
        if http_ok(url):
            return
        time.sleep(0.1)
    raise AssertionError(f"{url} not ready after {timeout}s")


def free_port() -> int:
    """A TCP port free on every local address, never the same one twice in this process.

    From below the kernel's ephemeral range (`service_port`): the engine, router or fake binds it later,
    and in between an outgoing connection or a port-0 bind could take a port from that range (a
    clean-clone CI run lost a test router's port that way). Free on the wildcard address because
    vLLM's ZMQ publisher binds ``tcp://*:PORT``."""
    with _handed_out_lock:
        port = service_port(taken=_handed_out)
        _handed_out.add(port)
        return port


def base_env(kv_cache_space_gib: int | None = None) -> dict[str, str]:
    """Environment every test engine needs, on top of the caller's."""
    env = {
        "VLLM_TARGET_DEVICE": "cpu",
        # Enables POST /reset_prefix_cache, used to clear caches between benchmark runs.
        "VLLM_SERVER_DEV_MODE": "1",
        # Loopback only: no usage reports, no hub look-ups (the tiny model is local).
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    if kv_cache_space_gib is not None:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(int(kv_cache_space_gib))
    return env


def kv_events_config(pub_port: int, replay_host: str | None = None, replay_port: int | None = None) -> str:
    # vLLM binds the PUB socket only for wildcard endpoints (tcp://*:P); a concrete host makes it
    # *connect* instead (distributed/kv_events.py, _is_bind_endpoint). The replay ROUTER always binds.
    cfg: dict[str, Any] = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{pub_port}",
        "topic": KV_EVENTS_TOPIC,
    }
    if replay_port is not None:
        cfg["replay_endpoint"] = f"tcp://{replay_host or '127.0.0.1'}:{replay_port}"
    return json.dumps(cfg, separators=(",", ":"))


def engine_spec(
    model_dir: Path | str,
    *,
    served_model_name: str = "tiny",
    block_size: int = 32,
    num_gpu_blocks_override: int | None = None,
    max_model_len: int = 4096,
    max_num_seqs: int = 16,
    extra_args: Sequence[str] = (),
) -> InferenceClusterSpec:
    """The InferenceCluster spec of a test engine: device cpu, the model's own config.json as its
    architecture, dummy weights, :func:`engine_dtype`. The operator would render exactly this spec's
    engine flags."""
    config = Path(model_dir) / "config.json"
    if not config.exists():
        raise EngineError(f"{config} not found: a test engine needs a model directory (tinymodel.py)")
    arch = architecture_from_hf_config(json.loads(config.read_text()))
    gpu_tier: dict[str, Any] = {}
    if num_gpu_blocks_override is not None:
        gpu_tier["numBlocks"] = num_gpu_blocks_override
    return InferenceClusterSpec.model_validate(
        {
            "model": {
                "name": served_model_name,
                "source": "pvc://models/local",  # replaced by model_dir in localize()
                "servedName": served_model_name,
                "loadFormat": "dummy",
                "dtype": engine_dtype(),
                "architecture": arch.wire(),
            },
            "engine": {
                "device": "cpu",
                "maxModelLen": max_model_len,
                "maxNumSeqs": max_num_seqs,
                "extraArgs": list(extra_args),
            },
            "kvCache": {"blockSize": block_size, "hashAlgo": "sha256", "tiers": {"gpu": gpu_tier}},
        }
    )


def rendered_engine_args(spec: InferenceClusterSpec) -> list[str]:
    """The engine container's args as the operator renders them for `spec` (planner/flags.py).

    Taken from the flags module even when the plan is infeasible: tests start engines the planner
    predicts vLLM will refuse, to check that it does."""
    p = plan(spec, suggest_fixes=False)
    return p.engine_args if p.feasible else flags.engine_args(spec, p)


def engine_args(
    model_dir: Path | str,
    *,
    host: str,
    port: int,
    served_model_name: str = "tiny",
    block_size: int = 32,
    num_gpu_blocks_override: int | None = None,
    max_model_len: int = 4096,
    max_num_seqs: int = 16,
    kv_events_port: int | None = None,
    kv_replay_port: int | None = None,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """The api_server flags (after the program) of a test engine: the operator's rendered flags for
    the engine's spec (`rendered_engine_args`), then `localize` for this machine."""
    if kv_replay_port is not None and kv_events_port is None:
        raise ValueError("kv_replay_port needs kv_events_port")
    spec = engine_spec(
        model_dir,
        served_model_name=served_model_name,
        block_size=block_size,
        num_gpu_blocks_override=num_gpu_blocks_override,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        extra_args=extra_args,
    )
    return localize(
        rendered_engine_args(spec),
        model_dir=model_dir,
        host=host,
        port=port,
        kv_events_port=kv_events_port,
        kv_replay_port=kv_replay_port,
    )


def localize(
    args: Sequence[str],
    *,
    model_dir: Path | str,
    host: str,
    port: int,
    kv_events_port: int | None,
    kv_replay_port: int | None,
) -> list[str]:
    """Rendered engine flags made runnable as a local process: what a pod has that a process on this
    machine does not. The model is a local directory instead of a volume; the HTTP server binds a given
    address and port instead of the pod's own 0.0.0.0:8000; the KV-event PUB and replay sockets get
    free ports, or are left out when the caller does not listen (engines side by side share one
    network namespace, so the rendered fixed ports would collide). Every other flag is kept exactly."""
    out = rebind_engine_args(
        args,
        model_dir=model_dir,
        host=host,
        port=port,
        kv_events_port=kv_events_port,
        kv_replay_port=kv_replay_port,
    )
    if "--kv-events-config" not in out:
        return out
    i = out.index("--kv-events-config")
    if kv_events_port is None:
        del out[i : i + 2]
        return out
    if kv_replay_port is None:
        cfg = json.loads(out[i + 1])
        cfg.pop("replay_endpoint", None)
        out[i + 1] = json.dumps(cfg, separators=(",", ":"))
    return out


def rebind_engine_args(
    args: Sequence[str],
    *,
    model_dir: Path | str | None = None,
    host: str | None = None,
    port: int | None = None,
    kv_events_port: int | None = None,
    kv_replay_port: int | None = None,
    kv_cache_dir: Path | str | None = None,
) -> list[str]:
    """Rendered engine flags made runnable on this machine: local model path, loopback address, free
    ports, and the fs tier's directory (the pod's PVC mount) moved to `kv_cache_dir`. Every other flag
    is kept exactly, so the run still proves what the operator rendered."""
    out = list(args)
    replacements = {"--model": model_dir, "--host": host, "--port": port}
    for flag, value in replacements.items():
        if value is None:
            continue
        if flag in out:
            out[out.index(flag) + 1] = str(value)
        else:
            out += [flag, str(value)]
    if "--kv-events-config" in out and (kv_events_port is not None or kv_replay_port is not None):
        i = out.index("--kv-events-config") + 1
        cfg = json.loads(out[i])
        if kv_events_port is not None:
            cfg["endpoint"] = f"tcp://*:{kv_events_port}"
        if kv_replay_port is not None:
            cfg["replay_endpoint"] = f"tcp://{host or '127.0.0.1'}:{kv_replay_port}"
        out[i] = json.dumps(cfg, separators=(",", ":"))
    if "--kv-transfer-config" in out and kv_cache_dir is not None:
        i = out.index("--kv-transfer-config") + 1
        transfer = json.loads(out[i])
        for tier in transfer.get("kv_connector_extra_config", {}).get("secondary_tiers", []):
            if tier.get("type") == "fs":
                tier["root_dir"] = str(kv_cache_dir)
        out[i] = json.dumps(transfer, separators=(",", ":"))
    return out


def rebind_engine_env(env: Mapping[str, str]) -> dict[str, str]:
    """Rendered engine env made runnable on this machine: the image's copy of kvstrata's engine package
    (ENGINE_PYTHONPATH) is this checkout's `operator/`."""
    out = dict(env)
    if "PYTHONPATH" in out:
        out["PYTHONPATH"] = os.pathsep.join(
            str(REPO / "operator") if entry == ENGINE_PYTHONPATH else entry
            for entry in out["PYTHONPATH"].split(os.pathsep)
        )
    return out


def _flag_value(argv: Sequence[str], flag: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def _connect_host(host: str) -> str:
    return "127.0.0.1" if host in ("", "0.0.0.0", "::") else host


def spawn_logged(
    argv: Sequence[str], env: Mapping[str, str], log_path: Path, *, header: bool = True
) -> subprocess.Popen[bytes]:
    """Start `argv` in its own process group (so a stop reaches its children), output appended to
    `log_path` after a line naming the exact command."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        if header:
            log.write(f"# kvstrata: {json.dumps(list(argv))}\n".encode())
            log.flush()
        return subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **env},
            start_new_session=True,
        )


class VllmEngine:
    """One vLLM OpenAI API server process (plus its engine-core child) in its own process group."""

    def __init__(
        self,
        model_dir: Path | str,
        *,
        host: str = "127.0.0.1",
        port: int,
        served_model_name: str = "tiny",
        block_size: int = 32,
        kv_cache_space_gib: int | None = 1,
        num_gpu_blocks_override: int | None = None,
        max_model_len: int = 4096,
        max_num_seqs: int = 16,
        kv_events_port: int | None = None,
        kv_replay_port: int | None = None,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        log_path: Path,
    ) -> None:
        args = engine_args(
            model_dir,
            host=host,
            port=port,
            served_model_name=served_model_name,
            block_size=block_size,
            num_gpu_blocks_override=num_gpu_blocks_override,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            kv_events_port=kv_events_port,
            kv_replay_port=kv_replay_port,
            extra_args=extra_args,
        )
        self._init(
            argv=[str(vllm_python()), "-m", API_SERVER_MODULE, *args],
            env={**base_env(kv_cache_space_gib), **(env or {})},
            host=host,
            port=port,
            served_model_name=served_model_name,
            kv_events_port=kv_events_port,
            kv_replay_port=kv_replay_port,
            log_path=log_path,
        )

    @classmethod
    def from_argv(
        cls,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        *,
        log_path: Path,
        host: str | None = None,
        port: int | None = None,
        kv_cache_space_gib: int | None = 1,
    ) -> VllmEngine:
        """Run an exact command line, e.g. the container args the operator rendered.

        ``argv`` is either flags only (run with the vLLM venv's api_server), ``vllm serve MODEL ...``
        (the console script does not work for the vllm-cpu distribution, so it is run as the
        api_server module with ``--model MODEL``), or a full command that is run as is.
        Host, port, served name and KV-event ports are read from the flags unless given."""
        argv = list(argv)
        if not argv:
            raise ValueError("empty argv")
        if argv[0].startswith("-"):
            argv = [str(vllm_python()), "-m", API_SERVER_MODULE, *argv]
        elif Path(argv[0]).name == "vllm" and len(argv) > 1 and argv[1] == "serve":
            rest = argv[2:]
            model = ["--model", rest.pop(0)] if rest and not rest[0].startswith("-") else []
            argv = [str(vllm_python()), "-m", API_SERVER_MODULE, *model, *rest]
        host = host or _flag_value(argv, "--host") or "127.0.0.1"
        if port is None:
            port = int(_flag_value(argv, "--port") or 8000)
        events_port = replay_port = None
        raw_events = _flag_value(argv, "--kv-events-config")
        if raw_events:
            cfg = json.loads(raw_events)
            if cfg.get("enable_kv_cache_events") and cfg.get("endpoint"):
                events_port = int(str(cfg["endpoint"]).rsplit(":", 1)[1])
            if cfg.get("replay_endpoint"):
                replay_port = int(str(cfg["replay_endpoint"]).rsplit(":", 1)[1])
        engine = cls.__new__(cls)
        engine._init(
            argv=argv,
            env={**base_env(kv_cache_space_gib), **(env or {})},
            host=host,
            port=port,
            served_model_name=_flag_value(argv, "--served-model-name") or _flag_value(argv, "--model") or "",
            kv_events_port=events_port,
            kv_replay_port=replay_port,
            log_path=log_path,
        )
        return engine

    def _init(
        self,
        *,
        argv: list[str],
        env: dict[str, str],
        host: str,
        port: int,
        served_model_name: str,
        kv_events_port: int | None,
        kv_replay_port: int | None,
        log_path: Path,
    ) -> None:
        self.argv = argv
        self.env = env
        self.host = host
        self.port = port
        self.served_model_name = served_model_name
        self.kv_events_port = kv_events_port
        self.kv_replay_port = kv_replay_port
        self.log_path = Path(log_path)
        self._proc: subprocess.Popen[bytes] | None = None
        self.started_at: float | None = None
        self.ready_after_s: float | None = None

    def rebound(self) -> VllmEngine:
        """The same engine, not started, on fresh ports and with its own log: what replaces one whose
        port was taken between the pick and vLLM's bind."""
        port = free_port()
        replay = free_port() if self.kv_replay_port is not None else None
        argv = rebind_engine_args(
            self.argv,
            port=port,
            kv_events_port=free_port() if self.kv_events_port is not None else None,
            kv_replay_port=replay,
            # Only where the replay endpoint is rewritten: a --host the argv lacks stays vLLM's default.
            host=self.host if replay is not None else None,
        )
        # from_argv reads the new ports back from the flags; self.env already holds the base env.
        log = self.log_path.with_name(f"{self.log_path.stem}-port-{port}{self.log_path.suffix}")
        return type(self).from_argv(argv, self.env, log_path=log, host=self.host, kv_cache_space_gib=None)

    # --- addresses ---------------------------------------------------------------------------
    @property
    def base_url(self) -> str:
        return f"http://{_connect_host(self.host)}:{self.port}"

    @property
    def kv_events_endpoint(self) -> str | None:
        """Where a SUB socket connects to receive this engine's KV events."""
        if self.kv_events_port is None:
            return None
        return f"tcp://{_connect_host(self.host)}:{self.kv_events_port}"

    @property
    def kv_replay_endpoint(self) -> str | None:
        if self.kv_replay_port is None:
            return None
        return f"tcp://{_connect_host(self.host)}:{self.kv_replay_port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    # --- lifecycle ---------------------------------------------------------------------------
    def start(self) -> VllmEngine:
        if self._proc is not None:
            raise EngineError("engine already started")
        self._proc = spawn_logged(self.argv, self.env, self.log_path)
        self.started_at = time.monotonic()
        return self

    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def wait_ready(self, timeout: float = 300.0) -> VllmEngine:
        """Poll ``/health`` until it answers 200; fail fast with the log tail if the process dies."""
        if self._proc is None:
            raise EngineError("engine not started")
        deadline = time.monotonic() + timeout
        while True:
            code = self._proc.poll()
            if code is not None:
                raise EngineError(
                    f"vLLM on port {self.port} exited with code {code} before it was ready: "
                    f"{'; '.join(self.log_errors()) or 'no error line in the log'}\n"
                    f"log {self.log_path}, last lines:\n{self.log_tail()}"
                )
            if http_ok(self.base_url + "/health"):
                if self.ready_after_s is None and self.started_at is not None:
                    self.ready_after_s = time.monotonic() - self.started_at
                return self
            if time.monotonic() > deadline:
                raise EngineError(
                    f"vLLM on port {self.port} not ready after {timeout:.0f}s; log {self.log_path}:\n"
                    f"{self.log_tail()}"
                )
            time.sleep(1.0)

    def stop(self, grace: float = _STOP_GRACE_S) -> None:
        """SIGTERM the process group, then SIGKILL whatever is left after ``grace`` seconds."""
        if self._proc is None or self._gone():
            return
        pgid = self._proc.pid
        _signal_group(pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and (self._proc.poll() is None or group_alive(pgid)):
            time.sleep(0.2)
        self.kill()

    def kill(self) -> None:
        """SIGKILL the whole process group at once, as a crash would."""
        if self._proc is None or self._gone():
            return
        pgid = self._proc.pid
        _signal_group(pgid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        while group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.1)

    def _gone(self) -> bool:
        # Once the leader is reaped and the group is empty, its id may be reused: never signal it again.
        assert self._proc is not None
        return self._proc.poll() is not None and not group_alive(self._proc.pid)

    def __enter__(self) -> VllmEngine:
        if self._proc is None:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- observation -------------------------------------------------------------------------
    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_errors(self) -> list[str]:
        """The distinct exception lines of the log (``ValueError: ...``), root cause first."""
        seen: dict[str, None] = {}
        for line in self.log_text().splitlines():
            match = _EXCEPTION_LINE.match(_LOG_PREFIX.sub("", line))
            if match:
                seen.setdefault(match.group(0).strip(), None)
        return list(seen)

    def port_was_taken(self) -> bool:
        """Whether the engine failed because one of its ports was in use."""
        return any("Address already in use" in line for line in self.log_errors())

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def rss_bytes(self) -> int:
        """Resident memory of every process in the engine's group (API server + engine core)."""
        if self._proc is None:
            return 0
        return sum(_rss(pid) for pid in group_pids(self._proc.pid))

    def pss_bytes(self) -> int:
        """Proportional set size of the group: shared pages (torch libraries) counted once."""
        if self._proc is None:
            return 0
        return sum(_smaps_field(pid, "Pss:") for pid in group_pids(self._proc.pid))

    def get(self, path: str, timeout: float = 30.0) -> str:
        with urllib.request.urlopen(self.base_url + path, timeout=timeout) as resp:
            return resp.read().decode()

    def post_json(self, path: str, body: Mapping[str, Any] | None = None, timeout: float = 120.0) -> Any:
        req = urllib.request.Request(
            self.base_url + path,
            data=json.dumps(body or {}).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read().decode()
        return json.loads(raw) if raw.strip() else None

    def complete(self, prompt: str, max_tokens: int = 8, **extra: Any) -> dict[str, Any]:
        body = {"model": self.served_model_name, "prompt": prompt, "max_tokens": max_tokens, **extra}
        return self.post_json("/v1/completions", body)

    def metrics(self) -> str:
        return self.get("/metrics")

    def reset_prefix_cache(self) -> None:
        self.post_json("/reset_prefix_cache")


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def group_pids(pgid: int) -> list[int]:
    """Live (non-zombie) processes whose process group is ``pgid``, read from /proc."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # Fields after the parenthesised command: state ppid pgrp ...
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            pids.append(int(entry.name))
    return pids


def group_alive(pgid: int) -> bool:
    return bool(group_pids(pgid))


def _rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _smaps_field(pid: int, field: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def start_engines(
    n: int,
    model_dir: Path | str,
    *,
    base_port: int | None = None,
    kv_events: bool = True,
    kv_replay: bool = False,
    log_dir: Path,
    timeout: float = 600.0,
    **kwargs: Any,
) -> list[VllmEngine]:
    """Start ``n`` engines at once and wait until all are ready; on any failure stop them all.

    Ports are ``base_port + i`` when given, else free ports. Other keyword arguments go to
    :class:`VllmEngine` (block_size, kv_cache_space_gib, extra_args, env, ...)."""
    if n < 1:
        raise ValueError("n must be >= 1")
    if n > 1:
        # Side by side, vLLM's auto binding would put every engine on the same core.
        kwargs["env"] = {**unpinned_omp_env(1), **(kwargs.get("env") or {})}

    def make(i: int) -> VllmEngine:
        port = base_port + i if base_port is not None else free_port()
        return VllmEngine(
            model_dir,
            port=port,
            kv_events_port=free_port() if kv_events else None,
            kv_replay_port=free_port() if kv_events and kv_replay else None,
            log_path=Path(log_dir) / f"engine-{i}-{port}.log",
            **kwargs,
        )

    return start_all([make(i) for i in range(n)], timeout=timeout, remake=make)


def start_all(
    engines: Sequence[VllmEngine],
    *,
    timeout: float = 600.0,
    remake: Callable[[int], VllmEngine] | None = None,
) -> list[VllmEngine]:
    """Start engines at once (on 2 cores three boot in ~150 s instead of ~3 x 70 s) and wait for all;
    on any failure stop every one of them before raising. An engine that found one of its ports taken
    is replaced by ``remake(its index)``, by default :meth:`VllmEngine.rebound` (the same flags on
    fresh ports), at most PORT_RETRIES times: ports are picked
    free before the start but bound only when vLLM gets to them, and engines booting side by side pick
    their internal ports the same way, so one can take a port handed to another (seen: the KV-event
    publisher's bind failing)."""
    started = list(engines)
    try:
        for engine in started:
            engine.start()
        deadline = time.monotonic() + timeout
        for i in range(len(started)):
            for attempt in range(PORT_RETRIES + 1):
                try:
                    started[i].wait_ready(timeout=max(1.0, deadline - time.monotonic()))
                    break
                except EngineError:
                    if attempt == PORT_RETRIES or not started[i].port_was_taken():
                        raise
                    started[i].stop()
                    started[i] = (remake(i) if remake else started[i].rebound()).start()
    except BaseException:
        stop_all(started)
        raise
    return started


def stop_all(engines: Sequence[VllmEngine]) -> None:
    # SIGTERM everything first so the engines shut down in parallel, then reap one by one.
    for engine in engines:
        if engine.pid is not None:
            _signal_group(engine.pid, signal.SIGTERM)
    for engine in engines:
        engine.stop()


@contextlib.contextmanager
def engines(n: int, model_dir: Path | str, *, log_dir: Path, **kwargs: Any) -> Iterator[list[VllmEngine]]:
    """``with engines(2, model_dir, log_dir=tmp_path) as es: ...`` — always stopped on exit."""
    started = start_engines(n, model_dir, log_dir=log_dir, **kwargs)
    try:
        yield started
    finally:
        stop_all(started)
