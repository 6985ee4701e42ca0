"""The operations the router serves as data: a `Route` per engine path (the field that
must hold its input, whether it streams, what ends another API's stream, what bounds
its answer), OpenAI's own routes, and the body rules every route shares (`read`).
Other APIs' routes are in dialects.py."""

from dataclasses import dataclass

from llmgw_router.api import OPENAI, Api
from llmgw_router.errors import ApiError
from llmgw_router.exchange import BodyTooLarge, loads


@dataclass
class Route:
    """One operation: the engine path, its API, and the field that must hold the input."""

    path: str
    input_field: str
    input_types: tuple
    streams: bool
    head: bytes = b""  # the request line sent to the engine
    max_tokens_field: str = "max_tokens"  # what bounds the answer ("": nothing does)
    api: Api = OPENAI  # the API it belongs to: its stream, translation and errors
    bills: bool = True  # whether its tokens are counted (counting tokens is not billed)
    # Called with (request, key, payload) once the key may use the model; may change the
    # payload (the Responses API's state), or raise ApiError. It returns None, or what
    # the whole answer (or a stream's last block) passes before it is written: bytes in,
    # bytes (or None: as they are) out.
    prepare: object = None

    def __post_init__(self):
        self.head = f"POST {self.path} HTTP/1.1\r\n".encode()


CHAT = Route("/v1/chat/completions", "messages", (list,), True)
COMPLETIONS = Route("/v1/completions", "prompt", (str, list), True)
EMBEDDINGS = Route("/v1/embeddings", "input", (str, list), False, max_tokens_field="")
# Reranking (llama-server with --reranking, vLLM, TEI-style servers): passed through
# under both names engines use for it.
RERANK = Route("/v1/rerank", "documents", (list,), False, max_tokens_field="")
RERANKING = Route("/v1/reranking", "documents", (list,), False, max_tokens_field="")


async def read(request, route: Route, max_body: int):
    """(payload, raw body); ApiError (400, 413) for a body that is not one."""
    if request.content_length is not None and request.content_length > max_body:
        raise too_large(max_body)
    try:
        body = await request.read()
    except BodyTooLarge:
        raise too_large(max_body) from None
    if len(body) > max_body:
        raise too_large(max_body)
    try:
        payload = loads(body)
    except (ValueError, UnicodeDecodeError):
        raise ApiError(
            400,
            "The request body is not valid JSON.",
            "invalid_request_error",
            "invalid_json",
        ) from None
    if not isinstance(payload, dict):
        raise ApiError(
            400,
            "The request body must be a JSON object.",
            "invalid_request_error",
            "invalid_json",
        )
    model = payload.get("model")
    if not isinstance(model, str) or not model:
        what = "missing" if model is None else "must be a non-empty string"
        raise ApiError(
            400,
            f"'model' is {what}.",
            "invalid_request_error",
            "invalid_value",
            param="model",
        )
    field = route.input_field
    value = payload.get(field)
    if value is None:
        raise ApiError(
            400,
            f"'{field}' is missing.",
            "invalid_request_error",
            "missing_required_parameter",
            param=field,
        )
    if not isinstance(value, route.input_types) or (isinstance(value, list) and not value):
        kinds = " or ".join(
            "a non-empty array" if t is list else "a string" for t in route.input_types
        )
        raise ApiError(
            400,
            f"'{field}' must be {kinds}.",
            "invalid_request_error",
            "invalid_type",
            param=field,
        )
    if "stream" in payload:
        if not isinstance(payload["stream"], bool):
            raise ApiError(
                400,
                "'stream' must be true or false.",
                "invalid_request_error",
                "invalid_type",
                param="stream",
            )
        if payload["stream"] and not route.streams:
            raise ApiError(
                400,
                f"{route.path} does not stream.",
                "invalid_request_error",
                "invalid_value",
                param="stream",
            )
    opts = payload.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise ApiError(
            400,
            "'stream_options' must be an object.",
            "invalid_request_error",
            "invalid_type",
            param="stream_options",
        )
    return payload, body


def too_large(limit: int) -> ApiError:
    return ApiError(
        413,
        f"The request body is larger than {limit} bytes.",
        "invalid_request_error",
        "request_too_large",
    )
