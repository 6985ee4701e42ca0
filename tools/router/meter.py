"""What an engine's answer says it cost: the request path's only reader of usage.

A `Meter` holds one attempt's tokens as the engine reported them (prompt, completion,
cached) and, for a stream, the content events seen (what a stream cut short before its
usage is billed by). A whole answer is read by `Meter.whole`; a stream by the reader for
its API, which also decides, event by event, whether the stream has ended:

- `OpenAIStream`: chat and completions, and the chat stream a translation reads. It ends
  on a whole `data: [DONE]` event. It takes the usage chunk, and drops it (or cuts the
  usage member out of a chunk that also carries choices) for a client that did not ask.
- `NativeStream`: another API's own stream passed through (Anthropic's Messages, the
  Responses API), which ends on one of its named events (`message_stop`,
  `response.completed`) and counts its delta events.

Framing is sse.py's: a reader is given whole events, never bytes to search, so no text
a model writes can end a stream or make up its usage (seen: a chat answer that repeated
`data: [DONE]` was billed 0 prompt and 2 completion tokens for 11 and 7).
"""

import json
import re

from llmgw_router import sse, tokens
from llmgw_router.exchange import loads
from llmgw_router.prefix import cached_tokens, decode_weight
from llmgw_router.splice import without_usage

_USAGE = b'"usage"'
_LF = b"\n"


class Meter:
    """One attempt's cost as its engine said it. `ended`: the stream reached its API's
    end (a whole answer always has)."""

    __slots__ = (
        "prompt_tokens",
        "completion_tokens",
        "events",
        "cached",
        "decode_weight",
        "ended",
        "weigh",
        "cached_tokens",
        "progress",
    )

    def __init__(self, weigh: bool = False):
        self.weigh = weigh  # learn what a decoded token costs (prefix routing wants it)
        self.reset()

    def reset(self) -> None:
        """A new attempt: nothing counted."""
        self.prompt_tokens = self.completion_tokens = self.events = 0
        # `cached` is the prefix index's, cleared after each attempt; `cached_tokens` the
        # usage row's. `progress`: llama-server's early prompt counts (tokens.py).
        self.cached = self.decode_weight = self.cached_tokens = None
        self.progress: tokens.Progress | None = None
        self.ended = False

    @property
    def completion(self) -> int:
        """Completion tokens to bill: the engine's count of a stream that ended; of one
        cut short, at least one per content event relayed (its usage, if any came, was
        only the count so far: Anthropic's message_start says 1)."""
        if self.ended:
            return self.completion_tokens or self.events
        return max(self.completion_tokens, self.events)

    def whole(self, data: bytes) -> None:
        """A whole answer's usage."""
        self.ended = True
        try:
            answer = loads(data)
            usage = answer.get("usage")
        except (ValueError, AttributeError):
            return
        if isinstance(usage, dict):
            self.take(usage, answer)

    def take(self, usage: dict, answer: dict | None = None) -> None:
        """A usage object, in OpenAI's names or Anthropic's and the Responses API's."""
        cached = cached_tokens(answer if answer is not None else {"usage": usage})
        if answer is not None and self.weigh:
            self.decode_weight = decode_weight(answer)
        p, c, said = tokens.counts(usage)
        cached = cached if cached is not None else said
        if cached is not None:
            self.cached = self.cached_tokens = cached
        if p is not None:
            self.prompt_tokens = p
        if c is not None:
            self.completion_tokens = c

    def prompt_counts(self) -> tuple[int, int | None]:
        """(prompt tokens, of which cached) for the usage row: the engine's usage, else
        what its first prompt-progress event said (a stream cut before its end)."""
        progress = self.progress
        if self.prompt_tokens or progress is None or progress.total is None:
            return self.prompt_tokens, self.cached_tokens
        return progress.total, progress.cached


# What a chunk says when it carries no generated token: the role-only first chunk, the
# finish chunk. Found on the bytes, compact or spaced as JSON writers put them: an
# unescaped quote never stands inside a string, so no text a model writes can look like
# these. One search each (a generator over eight marks cost ~1.5 µs a chunk).
_EMPTY = re.compile(rb'"(?:content|text)": ?(?:""|null)|"delta": ?\{\}')
_GENERATED = re.compile(rb'"tool_calls": ?\[|"reasoning')  # not finish_reason "tool_calls"


def _empty(data: bytes) -> bool:
    """A chunk with no content, tool call or reasoning: not billed as a token when the
    stream is cut short (a cut chat stream billed its role and finish chunks)."""
    return _EMPTY.search(data) is not None and _GENERATED.search(data) is None


class OpenAIStream:
    """An OpenAI stream's events in, the events the client gets out (see the module)."""

    __slots__ = ("meter", "client_usage")

    def __init__(self, meter: Meter, client_usage: bool):
        self.meter, self.client_usage = meter, client_usage

    def read(self, events: list[bytes]) -> list[bytes]:
        meter = self.meter
        if meter.ended:
            return []  # nothing after the end is part of the answer
        kept = None  # a copy, once an event is changed or dropped
        for i, event in enumerate(events):
            out = event
            if event.startswith(b"data: {") and _LF not in event:  # a chunk: the usual
                data = event[6:]
                if _USAGE in data:
                    out = self._usage(event, data)
                elif not _empty(data):
                    meter.events += 1
            else:  # a comment, another framing, the end
                data = sse.data_of(event)
                if data == sse.DONE:
                    meter.ended = True
                    if kept is None:
                        return events[: i + 1]
                    kept.append(event)
                    return kept
                if data is not None and data[:1] == b"{":
                    if _USAGE in data:
                        out = self._usage(event, data)
                    elif not _empty(data):
                        meter.events += 1
            if out is not event and kept is None:
                kept = events[:i]
            if kept is not None and out is not None:
                kept.append(out)
        return events if kept is None else kept

    def _usage(self, event: bytes, data: bytes) -> bytes | None:
        """A chunk that mentions usage: take it; the chunk as the client is to get it
        (None: dropped), `event` itself when it goes on unchanged."""
        try:
            obj = json.loads(data)
        except ValueError:
            obj = None
        if not (isinstance(obj, dict) and isinstance(obj.get("usage"), dict)):
            self.meter.events += 1  # "usage" in its text only
            return event
        self.meter.take(obj["usage"], obj)
        if obj.get("choices") and not _empty(data):
            self.meter.events += 1
        if self.client_usage:
            return event
        if not obj.get("choices"):
            return None  # the usage-only chunk the client did not ask for
        # Cut out of the bytes rather than parsed and written again.
        cut = without_usage(event) if event.startswith(b"data: ") and _LF not in event else None
        if cut is None:
            del obj["usage"]
            cut = b"data: " + json.dumps(obj, separators=(",", ":")).encode()
        return cut


class NativeStream:
    """Another API's own stream (see the module): `ends`, the event names that end a
    complete one; `content`, whether an event name is generated content."""

    __slots__ = ("meter", "ends", "content")

    def __init__(self, meter: Meter, ends: frozenset, content):
        self.meter, self.ends, self.content = meter, ends, content

    def read(self, events: list[bytes]) -> list[bytes]:
        meter = self.meter
        if meter.ended:
            return []
        for i, event in enumerate(events):
            e = sse.parse(event)
            name, obj = e.name, None
            data = e.data
            if data is not None and data[:1] == b"{" and (not name or _USAGE in data):
                obj = e.json()
                if not name and isinstance(obj, dict) and isinstance(obj.get("type"), str):
                    name = obj["type"]  # unnamed: the data says its type
            if self.content(name):
                meter.events += 1
            if isinstance(obj, dict):
                for holder in (obj, obj.get("message"), obj.get("response")):
                    if isinstance(holder, dict) and isinstance(holder.get("usage"), dict):
                        meter.take(holder["usage"])
            if name in self.ends:
                meter.ended = True
                return events[: i + 1]
        return events
