"""An API the router speaks, as data: `Api`. OpenAI's own (chat, completions,
embeddings, reranking) is `OPENAI`; Anthropic's Messages and the Responses API are in
dialects.py. A route (routes.py) names its API, and the request path asks the API, not
the route's name, for what differs between them:

- its stream's reader (meter.py): the events that end a complete stream, which are
  content, where usage is;
- how it is translated to chat completions for an engine that does not serve it, and
  chat's answers back (None: OpenAI's own, sent to every engine as it came);
- its errors: a whole error answer in its shape (`shaped`), and an error event in its
  stream (`error_event`); the path makes every error in OpenAI's shape (ApiError), and
  these are the one place each API's become its bytes.

Adding an API is one such value and its routes; the request path has no branch on
which API it is."""

import json
from collections.abc import Callable
from dataclasses import dataclass

from llmgw_router import sse
from llmgw_router.exchange import Answer
from llmgw_router.meter import Meter, NativeStream, OpenAIStream


def openai_error_event(message: str, status: int) -> bytes:
    """OpenAI's in-band error: a data event holding an error object (what its SDKs raise)."""
    error = {"message": message, "type": "server_error", "param": None}
    body = {"error": {**error, "code": f"upstream_{status}"}}
    return sse.event(json.dumps(body).encode())


@dataclass(frozen=True)
class Api:
    name: str
    # Its own stream's end events and content events (meter.NativeStream); none: an
    # OpenAI stream, which ends on `data: [DONE]` (meter.OpenAIStream).
    ends: frozenset = frozenset()
    content: Callable[[str], bool] | None = None
    # (request, served model) -> dialects.Translation, or Untranslatable; None: never
    # translated.
    translate: Callable | None = None
    # An OpenAI-shaped error (status, body) as this API says it; None: as it is.
    error: Callable[[int, dict], tuple[int, dict]] | None = None
    error_event: Callable[[str, int], bytes] = openai_error_event  # in-band, framed
    # Its name among the APIs engines serve natively (llmgw.engines.MESSAGES, ...): a
    # model whose engine is registered without it has its requests translated from the
    # first, without a refused request to learn it from.
    native: str = ""

    def reader(self, meter: Meter, client_usage: bool):
        """The reader of one attempt's stream in this API (`client_usage`: the client
        asked for OpenAI's usage chunk, or a translation needs it)."""
        if self.ends:
            return NativeStream(meter, self.ends, self.content)
        return OpenAIStream(meter, client_usage)

    def shaped(self, resp):
        """An error answer the request path made in OpenAI's shape (every error is made
        so, and an engine's is put so: relay.engine_error_body), as this API says it:
        the one place its whole errors become its bytes."""
        if self.error is None or resp.status < 400 or not isinstance(resp, Answer):
            return resp
        try:
            body = json.loads(resp.body)
        except (ValueError, TypeError):
            return resp
        if isinstance(body, dict):
            resp.status, shaped = self.error(resp.status, body)
            resp.body = json.dumps(shaped).encode()
        return resp


OPENAI = Api("openai")
