"""OpenAI-shaped error answers, and the router's own exceptions."""

import json

from llmgw.errors import Error
from llmgw_router.exchange import Answer

# Statuses where the same request will fail the same way: tell SDKs not to retry.
_NO_RETRY = frozenset((400, 401, 403, 404, 413))


class RouterError(Error):
    """The router cannot start."""


def api_error(
    status: int,
    message: str,
    type_: str,
    code: str,
    request_id: str,
    param: str | None = None,
    retry_after: int | None = None,
    retry: bool | None = None,
) -> Answer:
    """An error answer; `retry=False` tells SDKs not to retry whatever the status."""
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    headers = {"Content-Type": "application/json", "x-request-id": request_id}
    if retry is False or (retry is None and status in _NO_RETRY):
        headers["x-should-retry"] = "false"
    if retry_after is not None:
        headers["Retry-After"] = str(retry_after)
    return Answer(status, json.dumps(body).encode(), headers)


class Untranslatable(Error):
    """A request field the API it must be translated into cannot carry; names the field."""

    def __init__(self, field: str):
        super().__init__(field)
        self.field = field
