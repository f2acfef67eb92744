"""Parse and check OpenAI requests once, before routing; bad ones become OpenAI-shaped 4xx errors.

Only what routing needs is checked (model, prompt/messages, stream). Everything else is the engine's
business: the router forwards the client's original bytes and the engine validates the rest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import msgspec

Kind = Literal["completion", "chat"]
_decoder = msgspec.json.Decoder()


class BadRequest(Exception):
    def __init__(
        self, message: str, *, status: int = 400, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


@dataclass(slots=True)
class ParsedRequest:
    kind: Kind
    body: dict[str, Any]
    model: str
    stream: bool
    # Exactly one of these is set: text to tokenize, token ids, or chat messages.
    text: str | None = None
    token_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None

    def routing_text(self) -> str:
        """The prompt as plain text, for the character-block fallback and the prefix-hash policy."""
        if self.text is not None:
            return self.text
        if self.messages is not None:
            parts = []
            for m in self.messages:
                content = m.get("content")
                if isinstance(content, list):
                    content = "\n".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
                parts.append(f"{m.get('role', '')}:{content or ''}\n")
            return "".join(parts)
        return ""


def _is_int_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(type(t) is int for t in value)


def _prompt(body: dict[str, Any]) -> tuple[str | None, list[int] | None]:
    if "prompt" not in body:
        raise BadRequest("'prompt' is required", param="prompt")
    p = body["prompt"]
    if isinstance(p, str):
        return p, None
    if _is_int_list(p):
        return None, p
    if isinstance(p, list) and p:
        # A batch: route on its first prompt (vLLM runs the batch on one engine).
        first = p[0]
        if all(isinstance(x, str) for x in p):
            return first, None
        if all(_is_int_list(x) for x in p):
            return None, first
    raise BadRequest(
        "'prompt' must be a string, a non-empty list of strings, a list of token ids, or a list of token-id lists",
        param="prompt",
    )


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    msgs = body.get("messages")
    if msgs is None:
        raise BadRequest("'messages' is required", param="messages")
    if not isinstance(msgs, list) or not msgs:
        raise BadRequest("'messages' must be a non-empty list", param="messages")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a string 'role'", param="messages")
        content = m.get("content")
        if content is not None and not isinstance(content, str | list):
            raise BadRequest(f"messages[{i}].content must be a string or a list of parts", param="messages")
    return msgs


def parse_request(raw: bytes, kind: Kind, served_model: str) -> ParsedRequest:
    if not raw:
        raise BadRequest("request body is empty; expected a JSON object")
    try:
        body = _decoder.decode(raw)
    except msgspec.DecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    model = body.get("model")
    if model is None:
        raise BadRequest("'model' is required", param="model")
    if not isinstance(model, str):
        raise BadRequest("'model' must be a string", param="model")
    if model != served_model:
        raise BadRequest(
            f"The model `{model}` does not exist. This router serves `{served_model}`.",
            status=404,
            param="model",
            code="model_not_found",
        )
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean", param="stream")
    if kind == "completion":
        text, ids = _prompt(body)
        return ParsedRequest(kind, body, model, stream, text=text, token_ids=ids)
    return ParsedRequest(kind, body, model, stream, messages=_messages(body))
