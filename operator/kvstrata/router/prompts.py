"""Prompt → token ids the way vLLM 0.32.0 does it, so the router's block hashes equal the engine's.

- Completions: ``tokenizer.encode(prompt, add_special_tokens=True)`` (vLLM's CompletionRequest default),
  i.e. tokenizer.json's post-processor adds BOS where the model wants it. Token-id prompts are used
  verbatim.
- Chat: the tokenizer's chat template rendered like transformers does (sandboxed jinja2,
  ``trim_blocks``/``lstrip_blocks``, ``raise_exception``, ``tojson``), with ``bos_token``/``eos_token``
  from tokenizer_config.json and ``add_generation_prompt`` (default true), then encoded with
  ``add_special_tokens=False`` (ChatCompletionRequest default): the template already holds BOS.

Encoding is CPU work: callers run these functions in a thread pool (``tokenizers`` releases the GIL).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
from tokenizers import Tokenizer

from kvstrata.api.router_config import HashAlgo
from kvstrata.router.incremental import PromptEncoder, Proof, prove
from kvstrata.router.incremental_native import make_encoder


class TokenizerLoadError(ValueError):
    pass


class ChatTemplateError(ValueError):
    pass


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json stores special tokens as strings or as AddedToken dicts.
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def message_text(content: Any) -> str:
    """OpenAI content is a string or a list of parts; vLLM joins the text parts with newlines."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(
            p.get("text", "") for p in content if isinstance(p, dict) and p.get("type", "text") == "text"
        )
    return str(content)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, **_: Any) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent)


def compile_chat_template(source: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"chat template does not compile: {exc}") from exc


class LocalTokenizer:
    """The engine's tokenizer from a model directory (tokenizer.json + tokenizer_config.json)."""

    def __init__(self, directory: str | Path) -> None:
        root = Path(directory)
        tok_file = root / "tokenizer.json"
        if not tok_file.is_file():
            raise TokenizerLoadError(f"{tok_file} not found (the router needs the engine's tokenizer.json)")
        try:
            self.tokenizer = Tokenizer.from_file(str(tok_file))
        except Exception as exc:  # tokenizers raises plain Exception subclasses from Rust
            raise TokenizerLoadError(f"cannot load {tok_file}: {exc}") from exc
        config: dict[str, Any] = {}
        cfg_file = root / "tokenizer_config.json"
        if cfg_file.is_file():
            try:
                config = json.loads(cfg_file.read_text())
            except (OSError, json.JSONDecodeError) as exc:
                raise TokenizerLoadError(f"cannot read {cfg_file}: {exc}") from exc
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        template = config.get("chat_template")
        jinja_file = root / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text()
        if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        self.chat_template = compile_chat_template(template) if isinstance(template, str) else None
        # The first encode pays a one-off set-up (~90 ms measured with the tiny model's byte-level BPE);
        # pay it here, not in the first requests' routing time.
        self._ids("warm up the tokenizer", add_special_tokens=True)
        self._proof: Proof | None = None
        self._encoders: dict[tuple[bool, int, str], PromptEncoder[Any]] = {}

    def incremental(self, add_special_tokens: bool, block_size: int, algo: HashAlgo) -> PromptEncoder[Any]:
        """The prompt → (tokens, block hashes) encoder that reuses earlier prompts' chunks
        (router/incremental.py, run natively where it can: router/incremental_native.py): one for
        completions (``add_special_tokens``), one for rendered chat."""
        key = (add_special_tokens, block_size, algo)
        enc = self._encoders.get(key)
        if enc is None:
            if self._proof is None:
                self._proof = prove(self.tokenizer)
            enc = make_encoder(
                self.tokenizer,
                add_special_tokens=add_special_tokens,
                block_size=block_size,
                algo=algo,
                proof=self._proof,
            )
            self._encoders[key] = enc
        return enc

    def encode_completion(self, prompt: str) -> list[int]:
        return self._ids(prompt, add_special_tokens=True)

    def _ids(self, text: str, add_special_tokens: bool) -> list[int]:
        # encode_batch_fast skips the offsets (and their Python objects) that routing never reads: a
        # third less CPU per prompt than encode (`make bench-proxy` profile); the ids are the same.
        return self.tokenizer.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids

    def render_chat(self, messages: Sequence[Mapping[str, Any]], **kwargs: Any) -> str:
        if self.chat_template is None:
            raise ChatTemplateError("the tokenizer has no chat template")
        msgs = [{**m, "content": message_text(m.get("content"))} for m in messages]
        ctx = {"add_generation_prompt": True, **kwargs}
        try:
            return self.chat_template.render(
                messages=msgs, bos_token=self.bos_token or "", eos_token=self.eos_token or "", **ctx
            )
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from exc

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], **kwargs: Any) -> list[int]:
        return self.encode_rendered(self.render_chat(messages, **kwargs))

    def encode_rendered(self, rendered: str) -> list[int]:
        """A rendered chat conversation's ids: the template wrote the special tokens already."""
        return self._ids(rendered, add_special_tokens=False)


def chat_template_kwargs(body: Mapping[str, Any]) -> dict[str, Any]:
    """The request fields vLLM passes into the chat template."""
    kwargs: dict[str, Any] = {}
    if "add_generation_prompt" in body:
        kwargs["add_generation_prompt"] = bool(body["add_generation_prompt"])
    if body.get("continue_final_message"):
        kwargs["continue_final_message"] = True
        kwargs.setdefault("add_generation_prompt", False)
    if body.get("tools") is not None:
        kwargs["tools"] = body["tools"]
    extra = body.get("chat_template_kwargs")
    if isinstance(extra, dict):
        kwargs.update(extra)
    return kwargs
