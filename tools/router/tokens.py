"""What an engine says a request cost in tokens: its usage object, read alike for every
API, and the prompt counts llama-server sends at the start of a stream when asked.

Every token an engine evaluated or generated for a request is billed to it, once, and
`llmgw usage reconcile` checks the usage rows against the engines' own counters. Two
things stood in the way:

- Anthropic's usage names the prompt tokens read from the cache apart:
  `input_tokens` are only the others (llama-server says `input_tokens` = prompt −
  cached, `cache_read_input_tokens` = cached). Read as the prompt, a Messages request
  whose prompt the engine had cached was billed a few tokens for a long prompt.
- A stream's usage comes at its end. A client that went away mid-stream left a row
  with no prompt tokens, though the engine had evaluated the whole prompt. llama-server
  says the prompt's size as soon as it begins on it when the request has
  `"return_progress": true` (`prompt_progress`: total, cache, processed); the router
  asks for it and takes those events out before the client sees them (`Progress`).
  vLLM has no such event; its streams' prompts stay unknown until their usage chunk.
"""

import json

from llmgw import engines
from llmgw_router import sse
from llmgw_router.splice import first_member

_PROGRESS_KEY = b'"prompt_progress"'
_ASK_PROGRESS = b'"return_progress":true,'
_RETURN_PROGRESS = b'"return_progress"'


def _count(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def counts(usage: dict) -> tuple[int | None, int | None, int | None]:
    """(prompt, completion, cached) as a usage object says them, each None where it says
    nothing: OpenAI's names (chat, completions), the Responses API's (`input_tokens`,
    `input_tokens_details.cached_tokens`) and Anthropic's, whose prompt is its
    `input_tokens` plus the tokens read from and written to the cache."""
    prompt = _count(usage.get("prompt_tokens"))
    if prompt is None:
        prompt = _count(usage.get("input_tokens"))
    completion = _count(usage.get("completion_tokens"))
    if completion is None:
        completion = _count(usage.get("output_tokens"))
    cached = None
    details = usage.get("prompt_tokens_details", usage.get("input_tokens_details"))
    if isinstance(details, dict):
        cached = _count(details.get("cached_tokens"))
    read = _count(usage.get("cache_read_input_tokens"))
    written = _count(usage.get("cache_creation_input_tokens"))
    if "prompt_tokens" not in usage and (read is not None or written is not None):
        cached = read
        if prompt is not None:  # Anthropic's: the prompt less what the cache held
            prompt += (read or 0) + (written or 0)
    return prompt, completion, cached


def wants_progress(engine: str | None, native: bool, dialect: str | None) -> bool:
    """Whether a stream to this engine asks for prompt progress: where the engine says it
    has it (llmgw.engines: `prompt_progress`, llama.cpp's), its chat and completions
    streams (also another API's, translated to chat) and its own Responses API stream.
    Not its Messages stream, which says the prompt in `message_start` with the first
    token and has no event for progress."""
    found = engines.get(engine) if engine else None
    if found is None or not found.prompt_progress:
        return False
    return not (native and dialect == "anthropic")


def ask_progress(body: bytes) -> bytes | None:
    """A request body with `"return_progress": true` spliced in as its first member;
    None where it does not start like an object, or already names the field (a client
    that asked for the events itself gets them)."""
    if _RETURN_PROGRESS in body:
        return None
    return first_member(body, _ASK_PROGRESS)


class Progress:
    """llama-server's prompt-progress events in one attempt's stream: the first says the
    prompt's size (`total`) and how much of it the engine had cached (`cache`). They are
    taken out of what the client reads: a chat or completion chunk carrying progress
    holds nothing else (the role the first one says comes again with the first token),
    and in a Responses stream the first `response.in_progress` (which the progress event
    brings, as the first token would have) is kept without its `prompt_progress`, the
    later ones dropped."""

    __slots__ = ("total", "cached", "_kept")

    def __init__(self):
        self.total: int | None = None
        self.cached: int | None = None
        self._kept = False

    def take(self, events: list[bytes]) -> list[bytes]:
        """Whole events in (sse.Framer's); the same without progress out."""
        if not any(_PROGRESS_KEY in e for e in events):
            return events
        out = []
        for event in events:
            kept = self._event(event) if _PROGRESS_KEY in event else event
            if kept:
                out.append(kept)
        return out

    def _event(self, event: bytes) -> bytes | None:
        e = sse.parse(event)
        obj = e.json()
        progress = obj.get("prompt_progress") if isinstance(obj, dict) else None
        if not isinstance(progress, dict):
            return event
        if self.total is None:
            self.total = _count(progress.get("total"))
            self.cached = _count(progress.get("cache"))
        if obj.get("type") == "response.in_progress" and not self._kept:
            self._kept = True
            del obj["prompt_progress"]
            obj.pop("timings", None)
            data = json.dumps(obj, separators=(",", ":")).encode()
            return sse.event(data, e.name).rstrip(b"\n")
        return None
