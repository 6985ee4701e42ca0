"""OpenAI's Responses API in terms of chat completions, both ways; pure, no I/O.

Used where an engine does not serve /v1/responses itself. The router keeps the state
(previous_response_id) itself (conversations.py); what reaches this module is one
stateless request whose input already holds the whole conversation. What chat cannot
carry is refused with the field named (`Untranslatable`), never dropped.
"""

import secrets
import time

from llmgw_router import sse
from llmgw_router.errors import Untranslatable

# Fields the router itself handles before translation (state), or that only describe
# the answer and are echoed back in it.
_ECHOED = ("metadata", "user", "store", "previous_response_id", "truncation")
_CARRIED = frozenset(
    (
        "model",
        "input",
        "instructions",
        "max_output_tokens",
        "temperature",
        "top_p",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "text",
        "stream",
        *_ECHOED,
    )
)
_ROLES = frozenset(("user", "assistant", "system", "developer"))
_TEXT_PARTS = frozenset(("input_text", "output_text", "text"))


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(24)}"


# -- requests ------------------------------------------------------------------------------


def items(value) -> list[dict]:
    """A request's input as a list of items (a string is one user message), each with
    its type said: OpenAI's API takes `{"role", "content"}` as a message, and
    llama-server refuses it ("Cannot determine type of 'item'")."""
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    return [
        {"type": "message", **item} if isinstance(item, dict) and "type" not in item else item
        for item in value
    ]


def to_chat(body: dict) -> dict:
    """A (stateless, expanded) Responses request as a chat completion request."""
    for name in body:
        if name not in _CARRIED:
            raise Untranslatable(name)
    if body.get("truncation") not in (None, "disabled"):
        raise Untranslatable("truncation")
    messages: list[dict] = []
    if body.get("instructions"):
        messages.append({"role": "system", "content": body["instructions"]})
    for i, item in enumerate(items(body["input"])):
        _item(item, f"input[{i}]", messages)
    chat: dict = {"model": body["model"], "messages": messages}
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    for name in ("temperature", "top_p", "parallel_tool_calls", "user"):
        if body.get(name) is not None:
            chat[name] = body[name]
    if body.get("tools"):
        chat["tools"] = [_tool(t, f"tools[{i}]") for i, t in enumerate(body["tools"])]
    if "tool_choice" in body:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    fmt = (body.get("text") or {}).get("format")
    for name in body.get("text") or {}:
        if name != "format":
            raise Untranslatable(f"text.{name}")
    if fmt is not None:
        rf = _format(fmt)
        if rf is not None:
            chat["response_format"] = rf
    if body.get("stream"):
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    return chat


def _item(item, where: str, messages: list[dict]) -> None:
    if not isinstance(item, dict):
        raise Untranslatable(where)
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in _ROLES:
            raise Untranslatable(f"{where}.role")
        content = item.get("content")
        if not isinstance(content, str):
            content = _parts(content, f"{where}.content")
        messages.append({"role": "system" if role == "developer" else role, "content": content})
    elif kind == "function_call":
        call = {
            "id": item["call_id"],
            "type": "function",
            "function": {"name": item["name"], "arguments": item.get("arguments", "")},
        }
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant" and "tool_calls" in last:
            last["tool_calls"].append(call)
        elif last is not None and last["role"] == "assistant" and not last.get("tool_calls"):
            last["tool_calls"] = [call]
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        output = item.get("output", "")
        if not isinstance(output, str):
            output = _parts(output, f"{where}.output")
        messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
    else:
        raise Untranslatable(f"{where}.type")


def _parts(parts, where: str) -> str:
    if not isinstance(parts, list):
        raise Untranslatable(where)
    text = []
    for j, part in enumerate(parts):
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS:
            raise Untranslatable(f"{where}[{j}].type")
        text.append(part.get("text", ""))
    return "".join(text)


def _tool(tool: dict, where: str) -> dict:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise Untranslatable(f"{where}.type")
    fn = {"name": tool["name"], "parameters": tool.get("parameters") or {"type": "object"}}
    for name in ("description", "strict"):
        if tool.get(name) is not None:
            fn[name] = tool[name]
    return {"type": "function", "function": fn}


def _tool_choice(choice):
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice["name"]}}
    raise Untranslatable("tool_choice")


def _format(fmt: dict):
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema = {"name": fmt.get("name", "output"), "schema": fmt.get("schema") or {}}
        if fmt.get("strict") is not None:
            schema["strict"] = fmt["strict"]
        return {"type": "json_schema", "json_schema": schema}
    raise Untranslatable("text.format.type")


# -- answers -------------------------------------------------------------------------------


def shell(request: dict, rid: str, model: str, created: float) -> dict:
    """The response object before its output: what the request asked for, echoed."""
    resp = {"id": rid, "object": "response", "created_at": int(created),
            "completed_at": None, "status": "in_progress", "model": model, "output": [],
            "usage": None}  # fmt: skip
    return spec_shaped(resp, request, created)


# What the OpenResponses specification's ResponseResource requires besides what the
# answer itself holds (tests/fixtures/openresponses/), each with its default: the
# request's value where it has one that is not null, else this. Nullable fields default
# to None; the rest to the API's own default.
_ECHO_DEFAULTS = (
    ("previous_response_id", None),
    ("instructions", None),
    ("tool_choice", "auto"),
    ("truncation", "disabled"),
    ("parallel_tool_calls", True),
    ("temperature", 1.0),
    ("top_p", 1.0),
    ("presence_penalty", 0.0),
    ("frequency_penalty", 0.0),
    ("top_logprobs", 0),
    ("user", None),
    ("max_output_tokens", None),
    ("max_tool_calls", None),
    ("store", True),
    ("background", False),
    ("service_tier", "default"),
    ("safety_identifier", None),
    ("prompt_cache_key", None),
)


def spec_shaped(resp: dict, request: dict, now: float | None = None) -> dict:
    """`resp` (a response object, changed in place and returned) with every field the
    OpenResponses ResponseResource requires: what the answer says where it says it, else
    the request's value, else the default. llama-server's own answers carry only id,
    object, times, status, model, output and usage, and clients that validate refuse
    them. Cheap: a few dict lookups, for whole answers and a stream's last event only."""
    resp.setdefault("incomplete_details", None)
    resp.setdefault("error", None)
    for name, default in _ECHO_DEFAULTS:
        if resp.get(name) is None:
            value = request.get(name)
            resp[name] = default if value is None else value
    resp["object"] = "response"
    now = time.time() if now is None else now
    if not isinstance(resp.get("created_at"), int):
        resp["created_at"] = int(resp.get("created_at") or now)
    resp.setdefault("status", "completed")
    if "completed_at" not in resp:
        resp["completed_at"] = int(now) if resp["status"] == "completed" else None
    resp.setdefault("model", request.get("model", ""))
    if not isinstance(resp.get("output"), list):
        resp["output"] = []
    if resp.get("metadata") is None:
        resp["metadata"] = request.get("metadata") or {}
    tools = resp.get("tools") if isinstance(resp.get("tools"), list) else request.get("tools")
    resp["tools"] = [_tool_echo(t) for t in tools or []]
    text = resp.get("text") if isinstance(resp.get("text"), dict) else request.get("text")
    resp["text"] = {**(text or {}), "format": (text or {}).get("format") or {"type": "text"}}
    reasoning = resp.get("reasoning") or request.get("reasoning")
    resp["reasoning"] = (
        {**reasoning, "effort": reasoning.get("effort"), "summary": reasoning.get("summary")}
        if isinstance(reasoning, dict)
        else None
    )
    if isinstance(resp.get("usage"), dict):
        resp["usage"] = _usage_echo(resp["usage"])
    else:
        resp["usage"] = None
    return resp


def _tool_echo(tool):
    """A function tool as the response object lists it: description, parameters and
    strict said, null where the request left them out."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        return tool
    return {"description": None, "parameters": None, "strict": None, **tool}


def _usage_echo(usage: dict) -> dict:
    i, o = usage.get("input_tokens") or 0, usage.get("output_tokens") or 0
    return {
        **usage,
        "input_tokens": i,
        "output_tokens": o,
        "total_tokens": usage.get("total_tokens") or i + o,
        "input_tokens_details": usage.get("input_tokens_details") or {"cached_tokens": 0},
        "output_tokens_details": usage.get("output_tokens_details") or {"reasoning_tokens": 0},
    }


def _usage(chat_usage: dict | None) -> dict:
    u = chat_usage or {}
    i, o = u.get("prompt_tokens", 0), u.get("completion_tokens", 0)
    return {
        "input_tokens": i,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": o,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": i + o,
    }


def _finish(resp: dict, finish: str | None, usage: dict | None) -> dict:
    resp["usage"] = _usage(usage)
    if finish == "length":
        resp["status"] = "incomplete"
        resp["incomplete_details"] = {"reason": "max_output_tokens"}
    else:
        resp["status"] = "completed"
        resp["completed_at"] = int(time.time())
    return resp


def message_item(text: str, status: str = "completed", item_id: str | None = None) -> dict:
    return {
        "type": "message",
        "id": item_id or new_id("msg"),
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }


def call_item(call_id: str, name: str, arguments: str, item_id: str | None = None) -> dict:
    return {
        "type": "function_call",
        "id": item_id or new_id("fc"),
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": "completed",
    }


def from_chat(chat: dict, request: dict, model: str, created: float | None = None) -> dict:
    """A chat completion as a response object."""
    resp = shell(request, new_id("resp"), model, created or time.time())
    choice = (chat.get("choices") or [{}])[0]
    msg = choice.get("message") or {}
    if msg.get("content"):
        resp["output"].append(message_item(msg["content"]))
    for call in msg.get("tool_calls") or []:
        fn = call.get("function") or {}
        resp["output"].append(
            call_item(
                call.get("id") or new_id("call"), fn.get("name") or "", fn.get("arguments") or ""
            )
        )
    return _finish(resp, choice.get("finish_reason"), chat.get("usage"))


def count_request(body: dict) -> dict:
    """An input_tokens request as a chat completion of one token: its usage says how many
    tokens the input is, counted by the engine's own tokenizer and template."""
    chat = to_chat({**body, "max_output_tokens": 1})
    chat.pop("stream", None)
    chat.pop("stream_options", None)
    return chat


def count_from_chat(chat: dict) -> dict:
    tokens = (chat.get("usage") or {}).get("prompt_tokens", 0)
    return {"object": "response.input_tokens", "input_tokens": tokens}


def history(output: list[dict]) -> list[dict]:
    """A response's output items as input items of the next turn."""
    out = []
    for item in output:
        if item.get("type") == "message":
            text = "".join(p.get("text", "") for p in item.get("content") or [])
            out.append({"type": "message", "role": "assistant", "content": text})
        elif item.get("type") == "function_call":
            out.append(
                {
                    "type": "function_call",
                    "call_id": item.get("call_id"),
                    "name": item.get("name"),
                    "arguments": item.get("arguments", ""),
                }
            )
    return out


# Its own stream, passed through (meter.NativeStream): what ends it, what is content. A
# response that stopped at max_output_tokens ends `response.incomplete`; one the engine
# failed, `response.failed`: both are the stream's end, not a cut.
ENDS = frozenset(("response.completed", "response.incomplete", "response.failed"))


def content(name: str) -> bool:
    # response.output_text.delta, response.function_call_arguments.delta, reasoning…
    return name.endswith(".delta")


class Stream:
    """Chat completion chunks in, Responses stream events out, as they come."""

    def __init__(self, request: dict, model: str):
        self.resp = shell(request, new_id("resp"), model, time.time())
        self.seq = 0
        self.started = False
        self.text_item = None  # (output index, item) of the open message
        self.text = []
        self.calls: dict[int, tuple[int, dict]] = {}  # chat index → (output index, item)
        self.finish = None
        self.usage = None
        self.ended = False

    def _event(self, kind: str, **data) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **data}
        self.seq += 1
        return sse.json_event(data, kind)

    def feed(self, events: list[bytes]) -> bytes:
        """Events of a chat stream (sse.Framer's) → SSE events of a Responses stream."""
        return b"".join(
            self.end() if chunk is None else self.chunk(chunk) for chunk in sse.chat_chunks(events)
        )

    def _start(self) -> bytes:
        if self.started:
            return b""
        self.started = True
        return self._event("response.created", response=dict(self.resp)) + self._event(
            "response.in_progress", response=dict(self.resp)
        )

    def chunk(self, chunk: dict) -> bytes:
        out = [self._start()]
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                if self.text_item is None:
                    item = message_item("", "in_progress")
                    item["content"] = []
                    self.text_item = (len(self.resp["output"]), item)
                    self.resp["output"].append(item)
                    idx = self.text_item[0]
                    out.append(
                        self._event(
                            "response.output_item.added",
                            output_index=idx,
                            item=dict(item, content=[]),
                        )
                    )
                    out.append(
                        self._event(
                            "response.content_part.added",
                            item_id=item["id"],
                            output_index=idx,
                            content_index=0,
                            part={"type": "output_text", "text": "", "annotations": []},
                        )
                    )
                idx, item = self.text_item
                self.text.append(delta["content"])
                out.append(
                    self._event(
                        "response.output_text.delta",
                        item_id=item["id"],
                        output_index=idx,
                        content_index=0,
                        delta=delta["content"],
                    )
                )
            for call in delta.get("tool_calls") or []:
                fn = call.get("function") or {}
                n = call.get("index", 0)
                if n not in self.calls:
                    item = call_item(call.get("id") or new_id("call"), fn.get("name") or "", "")
                    item["status"] = "in_progress"
                    self.calls[n] = (len(self.resp["output"]), item)
                    self.resp["output"].append(item)
                    out.append(
                        self._event(
                            "response.output_item.added",
                            output_index=self.calls[n][0],
                            item=dict(item),
                        )
                    )
                idx, item = self.calls[n]
                if fn.get("arguments"):
                    item["arguments"] += fn["arguments"]
                    out.append(
                        self._event(
                            "response.function_call_arguments.delta",
                            item_id=item["id"],
                            output_index=idx,
                            delta=fn["arguments"],
                        )
                    )
            if choice.get("finish_reason"):
                self.finish = choice["finish_reason"]
        return b"".join(out)

    def end(self) -> bytes:
        if self.ended:
            return b""
        self.ended = True
        out = [self._start()]
        if self.text_item is not None:
            idx, item = self.text_item
            text = "".join(self.text)
            part = {"type": "output_text", "text": text, "annotations": []}
            out.append(
                self._event(
                    "response.output_text.done",
                    item_id=item["id"],
                    output_index=idx,
                    content_index=0,
                    text=text,
                )
            )
            out.append(
                self._event(
                    "response.content_part.done",
                    item_id=item["id"],
                    output_index=idx,
                    content_index=0,
                    part=part,
                )
            )
            item["content"], item["status"] = [part], "completed"
            out.append(self._event("response.output_item.done", output_index=idx, item=item))
        for idx, item in self.calls.values():
            item["status"] = "completed"
            out.append(
                self._event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=idx,
                    arguments=item["arguments"],
                )
            )
            out.append(self._event("response.output_item.done", output_index=idx, item=item))
        _finish(self.resp, self.finish, self.usage)
        out.append(self._event("response.completed", response=self.resp))
        return b"".join(out)


def error_event(message: str, status: int) -> bytes:
    data = {"type": "error", "code": f"upstream_{status}", "message": message, "param": None}
    return sse.json_event(data, "error")
