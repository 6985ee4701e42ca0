"""The other APIs the router speaks besides OpenAI's chat, completions and embeddings:
their routes, and how each is translated to chat completions for an engine that does not
serve it. The translations themselves are pure modules (anthropic.py); this module binds
them to routes and answers errors in each API's own shape.

An API is passed through where the engine serves its path (llama-server serves
/v1/messages natively); the first 404, 405 or 501 an endpoint gives on that path is
remembered (`Proxy.lacking`), and from then on its requests go to that endpoint as
chat completions, translated both ways.
"""

import json
from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web

from llmgw_router import anthropic
from llmgw_router.proxy import Route


@dataclass(frozen=True)
class Dialect:
    """One API: to chat and back, and its errors."""

    name: str
    to_chat: Callable[[dict], dict]
    from_chat: Callable[[dict, str], dict]
    stream: Callable[[str], object] | None = None  # chat chunks → its events
    error: Callable[[int, dict], tuple[int, dict]] | None = None
    error_event: Callable[[str, int], bytes] | None = None

    def chat_body(self, body: bytes) -> bytes:
        """The request as a chat completion request; raises Untranslatable."""
        return json.dumps(self.to_chat(json.loads(body))).encode()

    def answer(self, data: bytes, model: str) -> bytes:
        """A chat completion answer as this API's."""
        try:
            chat = json.loads(data)
        except ValueError:
            return data
        return json.dumps(self.from_chat(chat, model)).encode()


ANTHROPIC = Dialect(
    "anthropic",
    anthropic.to_chat,
    anthropic.from_chat,
    anthropic.Stream,
    anthropic.error,
    anthropic.error_event,
)
ANTHROPIC_COUNT = Dialect(
    "anthropic",
    anthropic.count_request,
    lambda chat, model: anthropic.count_from_chat(chat),
    None,
    anthropic.error,
    anthropic.error_event,
)

MESSAGES = Route(
    "/v1/messages", "messages", (list,), True, done=b"event: message_stop", dialect=ANTHROPIC
)
# Counting generates nothing, and Anthropic does not bill it: its usage row has no tokens.
COUNT_TOKENS = Route(
    "/v1/messages/count_tokens",
    "messages",
    (list,),
    False,
    max_tokens_field="",
    dialect=ANTHROPIC_COUNT,
    bills=False,
)


def handler(route: Route):
    """The route's handler: the request path, with errors in the API's own shape."""
    reshape = route.dialect.error

    async def handle(request: web.Request) -> web.StreamResponse:
        resp = await request.app["proxy"].forward(request, route)
        if reshape is not None and resp.status >= 400 and isinstance(resp, web.Response):
            if not resp.prepared and resp.body is not None:
                try:
                    body = json.loads(resp.body)
                except (ValueError, TypeError):
                    return resp
                if isinstance(body, dict):
                    status, shaped = reshape(resp.status, body)
                    resp.set_status(status)
                    resp.body = json.dumps(shaped).encode()
        return resp

    return handle


ROUTES = (MESSAGES, COUNT_TOKENS)
