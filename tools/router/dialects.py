"""The other APIs the router speaks besides OpenAI's chat, completions and embeddings:
their routes, and how each is translated to chat completions for an engine that does not
serve it. The translations themselves are pure modules (anthropic.py, responses.py);
this module binds them to routes and answers errors in each API's own shape.

An API is passed through where the engine serves its path (llama-server serves
/v1/messages and /v1/responses natively); the first 404, 405 or 501 an endpoint gives on
that path is remembered (`Upstreams.lacking`), and from then on its requests go to that
endpoint as chat completions, translated both ways.
"""

import json
from collections.abc import Callable

from llmgw import engines
from llmgw_router import anthropic, responses, responses_api
from llmgw_router.api import Api
from llmgw_router.exchange import Answer, Stream
from llmgw_router.routes import Route


class Translation:
    """One request as chat (`chat`), and chat's answer back: whole, or stream events."""

    def __init__(self, chat: dict, answer: Callable[[dict], dict], stream=None):
        self.chat = chat
        self._answer = answer
        self._stream = stream

    def whole(self, data: bytes) -> bytes:
        try:
            chat = json.loads(data)
        except ValueError:
            return data
        return json.dumps(self._answer(chat)).encode()

    def feed(self, events: list[bytes]) -> bytes:
        return self._stream.feed(events)


def _messages(body: dict, model: str) -> Translation:
    stream = anthropic.Stream(model) if body.get("stream") else None
    return Translation(anthropic.to_chat(body), lambda c: anthropic.from_chat(c, model), stream)


def _count(body: dict, model: str) -> Translation:
    return Translation(anthropic.count_request(body), anthropic.count_from_chat)


def _responses(body: dict, model: str) -> Translation:
    stream = responses.Stream(body, model) if body.get("stream") else None
    return Translation(
        responses.to_chat(body), lambda c: responses.from_chat(c, body, model), stream
    )


# Which engines serve an API natively is theirs to say (llmgw.engines: `apis`). An
# engine wrongly said not to still answers, translated; one wrongly said to costs one
# refused request per endpoint.
_ANTHROPIC = {
    "ends": anthropic.ENDS,
    "content": anthropic.content,
    "error": anthropic.error,
    "error_event": anthropic.error_event,
    "native": engines.MESSAGES,
}
ANTHROPIC = Api("anthropic", translate=_messages, **_ANTHROPIC)
ANTHROPIC_COUNT = Api("anthropic", translate=_count, **_ANTHROPIC)


def _input_tokens(body: dict, model: str) -> Translation:
    return Translation(responses.count_request(body), responses.count_from_chat)


_RESPONSES = {
    "ends": responses.ENDS,
    "content": responses.content,
    "error_event": responses.error_event,
    "native": engines.RESPONSES,
}
RESPONSES = Api("responses", translate=_responses, **_RESPONSES)
RESPONSES_COUNT = Api("responses", translate=_input_tokens, **_RESPONSES)

MESSAGES = Route(
    "/v1/messages",
    "messages",
    (list,),
    True,
    api=ANTHROPIC,
)
# Counting generates nothing, and Anthropic does not bill it: its usage row has no tokens.
COUNT_TOKENS = Route(
    "/v1/messages/count_tokens",
    "messages",
    (list,),
    False,
    max_tokens_field="",
    api=ANTHROPIC_COUNT,
    bills=False,
)


RESPONSES_ROUTE = Route(
    "/v1/responses",
    "input",
    (str, list),
    True,
    max_tokens_field="max_output_tokens",
    api=RESPONSES,
    prepare=responses_api.prepare,
)


def handler(route: Route):
    """The route's handler: the request path, with errors in the API's own shape."""

    async def handle(request) -> Answer | Stream:
        return route.api.shaped(await request.app["proxy"].forward(request, route))

    return handle


# Passed through where the engine counts; else a one-token chat completion counts.
INPUT_TOKENS = Route(
    "/v1/responses/input_tokens",
    "input",
    (str, list),
    False,
    max_tokens_field="",
    api=RESPONSES_COUNT,
    bills=False,
    prepare=responses_api.prepare_count,
)


ROUTES = (MESSAGES, COUNT_TOKENS, RESPONSES_ROUTE, INPUT_TOKENS)
