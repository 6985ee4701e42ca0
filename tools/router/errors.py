"""OpenAI-shaped error answers, and the router's own exceptions."""

from llmgw.errors import Error
from llmgw_router.exchange import Answer, json_answer

# Statuses where the same request will fail the same way: tell SDKs not to retry.
_NO_RETRY = frozenset((400, 401, 403, 404, 413))


class RouterError(Error):
    """The router cannot start."""


class ApiError(Exception):
    """An error answer, raised wherever the request path finds it and answered in
    OpenAI's shape (or another API's, dialects.py) by whoever serves the request.
    `retry=False` tells SDKs not to retry whatever the status."""

    def __init__(self, status: int, message: str, type_: str, code: str,
                 param: str | None = None, retry_after: int | None = None,
                 retry: bool | None = None, headers: dict | None = None):  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.type, self.code = status, message, type_, code
        self.param, self.retry_after, self.retry = param, retry_after, retry
        self.headers = headers or {}

    def answer(self, request_id: str) -> Answer:
        body = {
            "error": {"message": self.message, "type": self.type, "param": self.param,
                      "code": self.code}
        }  # fmt: skip
        headers = {"x-request-id": request_id}
        if self.retry is False or (self.retry is None and self.status in _NO_RETRY):
            headers["x-should-retry"] = "false"
        if self.retry_after is not None:
            headers["Retry-After"] = str(self.retry_after)
        headers.update(self.headers)
        return json_answer(body, self.status, headers)


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
    """The answer ApiError(...) would give: for errors answered where they are found."""
    return ApiError(status, message, type_, code, param, retry_after, retry).answer(request_id)


class Untranslatable(Error):
    """A request field the API it must be translated into cannot carry; names the field."""

    def __init__(self, field: str):
        super().__init__(field)
        self.field = field


class ChainTooLong(Error):
    """A conversation chains more stored responses than the router walks back
    (router.responses_chain_max)."""

    def __init__(self, response_id: str, most: int):
        super().__init__(f"{response_id}: more than {most}")
        self.response_id, self.most = response_id, most


class ChainBroken(Error):
    """A stored response continues one that is gone (deleted): the conversation before
    it cannot be rebuilt."""

    def __init__(self, response_id: str, missing: str):
        super().__init__(f"{response_id} continues {missing}")
        self.response_id, self.missing = response_id, missing
