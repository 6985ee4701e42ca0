"""GET /v1/models/{id}: one model's object, for a model the caller's key may use."""

from llmgw_router.errors import api_error
from llmgw_router.exchange import Answer, Stream, json_answer
from llmgw_router.proxy import Proxy, request_id


def model_object(name: str) -> dict:
    """A model as OpenAI's API describes one (the list and the retrieval say the same)."""
    return {"id": name, "object": "model", "created": 0, "owned_by": "llmgw"}


def exists(proxy: Proxy, name: str) -> bool:
    """Served now, known to the schedulers, or in the catalog (a name or an alias): a
    model that a request could be answered by, at once or after activation."""
    table = proxy.table
    if table.serves(name) or table.knows(name):
        return True
    return proxy.policies.model(name) is not None


async def retrieve(request) -> Answer | Stream:
    proxy: Proxy = request.app["proxy"]
    rid = request_id(request)
    key = await proxy.caller(request)  # ApiError: answered by the transport
    name = request.match_info["model"]
    # A model the key may not use is not there, for this key: the same 404 as an unknown
    # one, so a key cannot learn what else the fleet serves.
    if not key.allows(name) or not exists(proxy, name):
        return api_error(
            404,
            f"The model '{name}' does not exist.",
            "invalid_request_error",
            "model_not_found",
            rid,
            param="model",
        )
    # An alias is answered as its model, the name every answer from it carries.
    return json_answer(model_object(proxy.served_name(name)), headers={"x-request-id": rid})
