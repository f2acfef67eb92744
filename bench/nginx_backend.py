"""A static, fast OpenAI-shaped backend: nginx (Debian's nginx-light) answering from canned bodies.

nginx's `return` directive answers any method, POST included, without reading a file, so one worker
process serves far more requests per second than any router in front of it: the benchmark measures the
router, not the backend. Each "worker" the routers see is one listen port of the same nginx process:
`json` ports answer `/v1/completions` with a canned completion, `sse` ports with a canned SSE stream of
`SSE_CHUNKS` content events plus `data: [DONE]` (in one write; routers may re-chunk it).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from bench.procs import BenchError, Proc, ProcGroup, free_port, http_get, wait_until

MODEL = "tiny"
SSE_CHUNKS = 16
_COMPLETION_TOKENS = 16


def _answer(id_: str, kind: str, choice: dict[str, object]) -> str:
    """A canned non-streamed answer of _COMPLETION_TOKENS tokens: ``choice`` is the text or message."""
    usage = {
        "prompt_tokens": 100,
        "total_tokens": 100 + _COMPLETION_TOKENS,
        "completion_tokens": _COMPLETION_TOKENS,
    }
    body = {
        "id": id_,
        "object": kind,
        "created": 1,
        "model": MODEL,
        "choices": [{"index": 0, **choice, "logprobs": None, "finish_reason": "length"}],
        "usage": usage,
    }
    return json.dumps(body, separators=(",", ":"))


def completion_body() -> str:
    return _answer(
        "cmpl-bench", "text_completion", {"text": " lorem" * _COMPLETION_TOKENS, "stop_reason": None}
    )


def chat_body() -> str:
    message = {"role": "assistant", "content": " lorem" * _COMPLETION_TOKENS}
    return _answer("chatcmpl-bench", "chat.completion", {"message": message})


def sse_body() -> str:
    events = []
    for i in range(SSE_CHUNKS):
        finish = "length" if i == SSE_CHUNKS - 1 else None
        chunk = {
            "id": "cmpl-bench",
            "object": "text_completion",
            "created": 1,
            "model": MODEL,
            "choices": [{"index": 0, "text": " lorem", "logprobs": None, "finish_reason": finish}],
        }
        events.append("data: " + json.dumps(chunk, separators=(",", ":")) + "\n\n")
    events.append("data: [DONE]\n\n")
    return "".join(events)


def models_body() -> str:
    return json.dumps(
        {
            "object": "list",
            "data": [
                {
                    "id": MODEL,
                    "object": "model",
                    "created": 1,
                    "owned_by": "bench",
                    "root": MODEL,
                    "max_model_len": 4096,
                }
            ],
        }
    )


def _nginx_string(text: str) -> str:
    """Quote for nginx.conf: single quotes, with backslash and quote escaped; newlines kept literally."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def render_conf(prefix: Path, json_ports: list[int], sse_ports: list[int]) -> str:
    def server(port: int, default_type: str, body: str) -> str:
        return f"""
    server {{
        listen 127.0.0.1:{port} backlog=4096;
        location = /health {{ return 200 ''; }}
        location = /v1/models {{ default_type application/json; return 200 {_nginx_string(models_body())}; }}
        location = /v1/completions {{ default_type {default_type}; return 200 {_nginx_string(body)}; }}
        location = /v1/chat/completions {{ default_type application/json; return 200 {_nginx_string(chat_body())}; }}
        location / {{ default_type application/json; return 200 '{{}}'; }}
    }}"""

    servers = [server(p, "application/json", completion_body()) for p in json_ports]
    servers += [server(p, "text/event-stream", sse_body()) for p in sse_ports]
    temp = "\n".join(
        f"    {kind}_temp_path {prefix}/tmp/{kind};"
        for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    return f"""worker_processes 1;
daemon off;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log warn;
events {{ worker_connections 8192; }}
http {{
    access_log off;
{temp}
    keepalive_requests 10000000;
    keepalive_timeout 300s;
    client_max_body_size 16m;
{"".join(servers)}
}}
"""


@dataclass(frozen=True)
class Backend:
    proc: Proc
    json_urls: list[str]
    sse_urls: list[str]


def start_backend(procs: ProcGroup, workdir: Path, workers: int) -> Backend:
    nginx = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
    if nginx is None:
        raise BenchError("nginx not found: `make bench-proxy` installs it (apt-get install nginx-light)")
    prefix = (workdir / "nginx").resolve()  # nginx resolves relative paths against -p, not the cwd
    (prefix / "tmp").mkdir(parents=True, exist_ok=True)
    json_ports = [free_port() for _ in range(workers)]
    sse_ports = [free_port() for _ in range(workers)]
    conf = prefix / "nginx.conf"
    conf.write_text(render_conf(prefix, json_ports, sse_ports))
    proc = procs.start("nginx", [nginx, "-p", str(prefix), "-c", str(conf), "-e", str(prefix / "error.log")])
    backend = Backend(
        proc, [f"http://127.0.0.1:{p}" for p in json_ports], [f"http://127.0.0.1:{p}" for p in sse_ports]
    )
    for url in backend.json_urls + backend.sse_urls:
        wait_until(f"nginx on {url}", lambda u=url: http_get(u + "/health")[0] == 200, 15, [proc])
    return backend
