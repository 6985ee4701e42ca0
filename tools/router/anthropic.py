"""Anthropic's Messages API in terms of OpenAI chat completions, both ways; pure, no I/O.

Used where an engine does not serve /v1/messages itself. What chat cannot carry is
refused with the field named (`Untranslatable`), never dropped: a client that asked
for it would otherwise get an answer to a different question.
"""

import json

from llmgw_router import sse
from llmgw_router.errors import Untranslatable

# A cache hint: the engine's own prompt cache does what it asks, so it changes nothing.
_IGNORED_BLOCK_KEYS = frozenset(("cache_control",))
_CARRIED = frozenset(
    (
        "model",
        "messages",
        "max_tokens",
        "system",
        "stop_sequences",
        "stream",
        "temperature",
        "top_p",
        "top_k",
        "tools",
        "tool_choice",
        "metadata",
    )
)

_STOP_REASONS = {
    "stop": "end_turn",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "function_call": "tool_use",
    "content_filter": "refusal",
}

# OpenAI-shaped error types and statuses as Anthropic's SDKs know them.
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    529: "overloaded_error",
}


# -- requests ------------------------------------------------------------------------------


def to_chat(body: dict) -> dict:
    """A Messages request as a chat completion request."""
    for name in body:
        if name not in _CARRIED:
            raise Untranslatable(name)
    chat: dict = {"model": body["model"], "messages": []}
    system = body.get("system")
    if system is not None:
        chat["messages"].append({"role": "system", "content": _text(system, "system")})
    for i, msg in enumerate(body["messages"]):
        chat["messages"].extend(_message(msg, f"messages[{i}]"))
    if "max_tokens" in body:
        chat["max_tokens"] = body["max_tokens"]
    if "stop_sequences" in body:
        chat["stop"] = body["stop_sequences"]
    for name in ("temperature", "top_p", "top_k"):
        if name in body:
            chat[name] = body[name]
    if body.get("stream"):
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    if "tools" in body:
        chat["tools"] = [_tool(t, f"tools[{i}]") for i, t in enumerate(body["tools"])]
    if "tool_choice" in body:
        _tool_choice(body["tool_choice"], chat)
    meta = body.get("metadata")
    if meta:
        for name in meta:
            if name != "user_id":
                raise Untranslatable(f"metadata.{name}")
        chat["user"] = meta["user_id"]
    return chat


def count_request(body: dict) -> dict:
    """A count_tokens request as a chat completion of one token: its usage says how many
    tokens the prompt is, counted by the engine's own tokenizer and template."""
    chat = to_chat({**body, "max_tokens": 1})
    chat.pop("stream", None)
    return chat


def _text(value, where: str) -> str:
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise Untranslatable(where)
    parts = []
    for j, block in enumerate(value):
        if not isinstance(block, dict) or block.get("type") != "text":
            raise Untranslatable(f"{where}[{j}].type")
        _only(block, ("type", "text"), f"{where}[{j}]")
        parts.append(block["text"])
    return "".join(parts)


def _only(block: dict, keys, where: str) -> None:
    for name in block:
        if name not in keys and name not in _IGNORED_BLOCK_KEYS:
            raise Untranslatable(f"{where}.{name}")


def _message(msg: dict, where: str) -> list[dict]:
    if not isinstance(msg, dict) or msg.get("role") not in ("user", "assistant"):
        raise Untranslatable(f"{where}.role")
    _only(msg, ("role", "content"), where)
    role, content = msg["role"], msg.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise Untranslatable(f"{where}.content")
    out: list[dict] = []  # tool results first, as chat wants them right after the call
    text: list[str] = []
    calls: list[dict] = []
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            _only(block, ("type", "text"), at)
            text.append(block["text"])
        elif kind == "tool_use" and role == "assistant":
            _only(block, ("type", "id", "name", "input"), at)
            calls.append(
                {
                    "id": block["id"],
                    "type": "function",
                    "function": {
                        "name": block["name"],
                        "arguments": json.dumps(block.get("input") or {}),
                    },
                }
            )
        elif kind == "tool_result" and role == "user":
            _only(block, ("type", "tool_use_id", "content"), at)
            result = block.get("content", "")
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": block["tool_use_id"],
                    "content": _text(result, f"{at}.content"),
                }
            )
        else:
            raise Untranslatable(f"{at}.type")
    if role == "assistant":
        msg_out: dict = {"role": "assistant", "content": "".join(text) or None}
        if calls:
            msg_out["tool_calls"] = calls
        out.append(msg_out)
    elif text or not out:
        out.append({"role": "user", "content": "".join(text)})
    return out


def _tool(tool: dict, where: str) -> dict:
    if not isinstance(tool, dict) or tool.get("type", "custom") != "custom":
        raise Untranslatable(f"{where}.type")
    _only(tool, ("type", "name", "description", "input_schema"), where)
    fn = {"name": tool["name"], "parameters": tool.get("input_schema") or {"type": "object"}}
    if "description" in tool:
        fn["description"] = tool["description"]
    return {"type": "function", "function": fn}


def _tool_choice(choice: dict, chat: dict) -> None:
    kind = choice.get("type")
    _only(choice, ("type", "name", "disable_parallel_tool_use"), "tool_choice")
    if kind == "auto":
        chat["tool_choice"] = "auto"
    elif kind == "any":
        chat["tool_choice"] = "required"
    elif kind == "none":
        chat["tool_choice"] = "none"
    elif kind == "tool":
        chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    else:
        raise Untranslatable("tool_choice.type")
    if choice.get("disable_parallel_tool_use"):
        chat["parallel_tool_calls"] = False


# -- answers -------------------------------------------------------------------------------


def stop_reason(finish: str | None) -> str | None:
    return _STOP_REASONS.get(finish, "end_turn") if finish else None


def from_chat(chat: dict, model: str) -> dict:
    """A chat completion as a Messages answer."""
    choice = (chat.get("choices") or [{}])[0]
    msg = choice.get("message") or {}
    content: list[dict] = []
    if msg.get("content"):
        content.append({"type": "text", "text": msg["content"]})
    for call in msg.get("tool_calls") or []:
        fn = call.get("function") or {}
        content.append(
            {
                "type": "tool_use",
                "id": call.get("id") or "",
                "name": fn.get("name"),
                "input": _arguments(fn.get("arguments")),
            }
        )
    usage = chat.get("usage") or {}
    return {
        "id": "msg_" + str(chat.get("id") or ""),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason(choice.get("finish_reason")),
        "stop_sequence": None,
        "usage": {
            "input_tokens": usage.get("prompt_tokens", 0),
            "output_tokens": usage.get("completion_tokens", 0),
        },
    }


def count_from_chat(chat: dict) -> dict:
    return {"input_tokens": (chat.get("usage") or {}).get("prompt_tokens", 0)}


def _arguments(text) -> dict:
    try:
        value = json.loads(text or "{}")
    except ValueError:
        return {"_raw": text}  # the model wrote broken JSON: hand it over as it came
    return value if isinstance(value, dict) else {"_value": value}


# Its own stream, passed through (meter.NativeStream): what ends it, what is content.
ENDS = frozenset(("message_stop",))


def content(name: str) -> bool:
    return name == "content_block_delta"


def _event(kind: str, data: dict) -> bytes:
    return sse.json_event(data, kind)


class Stream:
    """Chat completion chunks in, Messages stream events out, as they come."""

    def __init__(self, model: str):
        self.model = model
        self.started = False
        self.block = -1  # index of the open content block
        self.open_kind = ""  # "text" or the tool call's index as a string
        self.finish = None
        self.usage = {"input_tokens": 0, "output_tokens": 0}
        self.ended = False

    def feed(self, events: list[bytes]) -> bytes:
        """Events of a chat stream (sse.Framer's) → SSE events of a Messages stream."""
        return b"".join(
            self.end() if chunk is None else self.chunk(chunk) for chunk in sse.chat_chunks(events)
        )

    def chunk(self, chunk: dict) -> bytes:
        out = []
        if not self.started:
            self.started = True
            out.append(
                _event(
                    "message_start",
                    {
                        "type": "message_start",
                        "message": {
                            "id": "msg_" + str(chunk.get("id") or ""),
                            "type": "message",
                            "role": "assistant",
                            "model": self.model,
                            "content": [],
                            "stop_reason": None,
                            "stop_sequence": None,
                            "usage": dict(self.usage),
                        },
                    },
                )
            )
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            self.usage = {
                "input_tokens": usage.get("prompt_tokens", 0),
                "output_tokens": usage.get("completion_tokens", 0),
            }
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                if self.open_kind != "text":
                    out.append(self._open({"type": "text", "text": ""}, "text"))
                out.append(
                    _event(
                        "content_block_delta",
                        {
                            "type": "content_block_delta",
                            "index": self.block,
                            "delta": {"type": "text_delta", "text": delta["content"]},
                        },
                    )
                )
            for call in delta.get("tool_calls") or []:
                fn = call.get("function") or {}
                kind = f"tool{call.get('index', 0)}"
                if self.open_kind != kind:
                    out.append(
                        self._open(
                            {
                                "type": "tool_use",
                                "id": call.get("id") or "",
                                "name": fn.get("name") or "",
                                "input": {},
                            },
                            kind,
                        )
                    )
                if fn.get("arguments"):
                    out.append(
                        _event(
                            "content_block_delta",
                            {
                                "type": "content_block_delta",
                                "index": self.block,
                                "delta": {
                                    "type": "input_json_delta",
                                    "partial_json": fn["arguments"],
                                },
                            },
                        )
                    )
            if choice.get("finish_reason"):
                self.finish = choice["finish_reason"]
        return b"".join(out)

    def _open(self, block: dict, kind: str) -> bytes:
        out = self._close()
        self.block += 1
        self.open_kind = kind
        return out + _event(
            "content_block_start",
            {"type": "content_block_start", "index": self.block, "content_block": block},
        )

    def _close(self) -> bytes:
        if not self.open_kind:
            return b""
        self.open_kind = ""
        return _event("content_block_stop", {"type": "content_block_stop", "index": self.block})

    def end(self) -> bytes:
        if self.ended:
            return b""
        self.ended = True
        out = [] if self.started else [self.chunk({})]
        out.append(self._close())
        out.append(
            _event(
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {
                        "stop_reason": stop_reason(self.finish) or "end_turn",
                        "stop_sequence": None,
                    },
                    "usage": dict(self.usage),
                },
            )
        )
        out.append(_event("message_stop", {"type": "message_stop"}))
        return b"".join(out)


# -- errors --------------------------------------------------------------------------------


def error(status: int, body: dict) -> tuple[int, dict]:
    """An OpenAI-shaped error (the router's or an engine's) as Anthropic's, with
    Anthropic's status: saturation is 529 overloaded_error, as their SDKs retry it."""
    if body.get("type") == "error":
        return status, body  # already Anthropic's (a native engine's answer)
    err = body.get("error") if isinstance(body.get("error"), dict) else {}
    if err.get("code") == "model_saturated":
        status = 529
    kind = _ERROR_TYPES.get(status, "api_error")
    message = err.get("message") or str(body)[:300]
    return status, {"type": "error", "error": {"type": kind, "message": message}}


def error_event(message: str, status: int) -> bytes:
    kind = "overloaded_error" if status == 529 else "api_error"
    return _event("error", {"type": "error", "error": {"type": kind, "message": message}})
