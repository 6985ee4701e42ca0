"""The Responses API's own endpoints and its state on the request path: a request with
previous_response_id is expanded into the whole conversation before it goes to any
engine (so it is stateless there, native or translated), and the answer is kept when
`store` is true, with its own turn only. Every answer, native or translated, whole or as
a stream's `response.completed`, is made to carry what the OpenResponses response
object requires (`responses.spec_shaped`). GET, DELETE and input_items of
/v1/responses/{id} answer only the key that made the response: any other gets 404,
never the content."""

import json
import time

from llmgw_router import responses, sse
from llmgw_router.conversations import Conversations, Saved
from llmgw_router.errors import ApiError, ChainBroken, ChainTooLong
from llmgw_router.exchange import Answer, json_answer
from llmgw_router.proxy import request_id


def not_found(response_id: str, param: str | None = None) -> ApiError:
    return ApiError(
        404,
        f"No response with id '{response_id}' was found.",
        "invalid_request_error",
        "response_not_found",
        param=param,
    )


def conversation(chain: list[Saved]) -> list[dict]:
    """The items a chain of responses (newest first) was given and answered, oldest
    first, as the next turn's input. Instructions are not carried over (as OpenAI's API
    does it): each request's own."""
    items: list = []
    for saved in reversed(chain):
        items += saved.context + saved.input + responses.history(saved.body.get("output") or [])
    return items


async def _chain(request, key, response_id: str, most: int, param: str | None) -> list[Saved]:
    """The caller's response `response_id` and those it continues, newest first;
    ApiError (404, 400) if there is none or the conversation cannot be rebuilt."""
    convs: Conversations = request.app["conversations"]
    try:
        chain = await convs.chain(response_id, key.id, most)
    except ChainBroken as e:
        raise ApiError(
            404,
            f"Response '{e.response_id}' continues response '{e.missing}', which was "
            "deleted: the conversation before it cannot be rebuilt.",
            "invalid_request_error",
            "response_not_found",
            param=param,
        ) from None
    except ChainTooLong as e:
        raise ApiError(
            400,
            f"The conversation up to response '{e.response_id}' has more than {e.most} "
            "stored responses, the most this server continues: start a new one, with what "
            "it needs as its input.",
            "invalid_request_error",
            "conversation_too_long",
            param=param,
        ) from None
    if chain is None:
        raise not_found(response_id, param)
    return chain


async def _expand(request, key, payload: dict):
    """Put the conversation before previous_response_id into `payload["input"]`:
    (previous id, this request's own input); ApiError if it cannot be."""
    prev_id = payload.pop("previous_response_id", None)
    mine = responses.items(payload["input"])
    context: list = []
    if prev_id is not None:
        if not isinstance(prev_id, str):
            raise ApiError(
                400,
                "'previous_response_id' must be a string.",
                "invalid_request_error",
                "invalid_type",
                param="previous_response_id",
            )
        most = request.app["conversations"].chain_max
        context = conversation(await _chain(request, key, prev_id, most, "previous_response_id"))
    payload["input"] = context + mine
    return prev_id, mine


async def prepare_count(request, key, payload: dict) -> None:
    """input_tokens counts the whole conversation, as the engine would see it; nothing
    is kept."""
    await _expand(request, key, payload)


async def prepare(request, key, payload: dict):
    """Expand previous_response_id into the conversation; the hook the answer passes,
    which keeps the response (routes.Route.prepare). ApiError if the request cannot be."""
    convs: Conversations = request.app["conversations"]
    store = payload.pop("store", True)
    if not isinstance(store, bool):
        raise ApiError(
            400,
            "'store' must be true or false.",
            "invalid_request_error",
            "invalid_type",
            param="store",
        )
    prev_id, mine = await _expand(request, key, payload)
    model = payload["model"]

    def on_answer(data: bytes) -> bytes | None:
        """The whole answer, or a stream's last block: keep the response, and say in it
        what the engine could not know (it never saw previous_response_id or store) and
        what the specification requires that the engine left out."""
        whole = data.lstrip().startswith(b"{")
        final = None
        if whole:
            obj = _json(data)
        else:
            final = _final_event(data)
            obj = final[3].get("response") if final is not None else None
        if not isinstance(obj, dict) or not isinstance(obj.get("id"), str):
            return None
        obj = responses.spec_shaped(obj, payload)
        obj["previous_response_id"], obj["store"] = prev_id, store
        if store:
            convs.put(
                Saved(
                    obj["id"],
                    key.id,
                    time.time(),
                    obj.get("model") or model,
                    prev_id,
                    mine,
                    [],
                    obj,
                )
            )
        if whole:
            return json.dumps(obj).encode()
        events, i, name, event = final
        event["response"] = obj
        events[i] = sse.json_event(event, name).rstrip()
        return sse.join(events)

    return on_answer


def _json(data: bytes):
    try:
        return json.loads(data)
    except ValueError:
        return None


def _final_event(block: bytes):
    """(the block's events, the index of the response's end event, its name, its data
    decoded) in a stream's last block; None if it has none."""
    events = sse.split(block)
    for i in range(len(events) - 1, -1, -1):
        e = sse.parse(events[i])
        obj = e.json()
        if not isinstance(obj, dict):
            continue
        name = e.name or obj.get("type")
        if name in responses.ENDS and isinstance(obj.get("response"), dict):
            return events, i, name, obj
    return None


async def _mine(request) -> Saved:
    """The caller's stored response; ApiError (401, 404) if there is none."""
    key = request.app["proxy"].authorise(request)
    response_id = request.match_info["response_id"]
    saved = await request.app["conversations"].get(response_id, key.id)
    if saved is None:
        raise not_found(response_id)
    return saved


async def retrieve(request) -> Answer:
    rid = request_id(request)
    saved = await _mine(request)  # ApiError: answered by the transport
    return json_answer(saved.body, headers={"x-request-id": rid})


async def delete(request) -> Answer:
    rid = request_id(request)
    saved = await _mine(request)  # ApiError: answered by the transport
    request.app["conversations"].delete(saved.id)
    return json_answer(
        {"id": saved.id, "object": "response", "deleted": True}, headers={"x-request-id": rid}
    )


def input_item(item: dict, n: int, response_id: str) -> dict:
    """An input item as input_items lists it: with an id, and its content as parts."""
    out = dict(item)
    out.setdefault("type", "message")
    out.setdefault("id", f"in_{response_id[-24:]}_{n}")
    if out["type"] == "message":
        out.setdefault("status", "completed")
        if isinstance(out.get("content"), str):
            kind = "output_text" if out.get("role") == "assistant" else "input_text"
            out["content"] = [{"type": kind, "text": out["content"]}]
    return out


async def input_items(request) -> Answer:
    rid = request_id(request)
    key = request.app["proxy"].authorise(request)
    response_id = request.match_info["response_id"]
    most = request.app["conversations"].chain_max + 1  # the response, and those it continues
    chain = await _chain(request, key, response_id, most, None)  # ApiError: the transport's
    saved = chain[0]
    # Everything the model was given as input: the conversation before, then its own.
    given = conversation(chain[1:]) + saved.context + saved.input
    listed = [input_item(it, n, saved.id) for n, it in enumerate(given)]
    if request.query.get("order", "desc") != "asc":
        listed.reverse()
    after = request.query.get("after")
    if after:
        ids = [it["id"] for it in listed]
        listed = listed[ids.index(after) + 1 :] if after in ids else []
    try:
        limit = max(1, min(100, int(request.query.get("limit", "20"))))
    except ValueError:
        limit = 20
    page = listed[:limit]
    body = {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(listed) > limit,
    }
    return json_answer(body, headers={"x-request-id": rid})
