"""The admin API's refusals beyond `llmgw.errors`; `admin.STATUS` gives each its status."""

from llmgw.errors import Conflict, Invalid, Refused


class Unauthorized(Refused):
    """No credential, or a wrong one, for what the route's access asks."""

    code = "unauthorized"


class Forbidden(Refused):
    """An operator whose role may not call the route."""

    code = "forbidden"


class MethodNotAllowed(Refused):
    """A path the API knows, asked with a method it does not take there."""

    code = "method_not_allowed"

    def __init__(self, message: str, allow: list[str]):
        super().__init__(message)
        self.allow = allow


class NotLeader(Conflict):
    """A change sent to a standby scheduler."""

    code = "not_leader"


class BadBody(Invalid):
    """A request body that is not a JSON object."""

    code = "invalid_json"


class AgentSilent(Refused):
    """A node's agent that did not answer in time."""

    code = "agent_silent"


class NotWritten(Refused):
    """A file the scheduler could not write."""

    code = "not_written"


class Unavailable(Refused):
    """Something this scheduler should serve and does not hold yet (a blob or release it
    is still copying from a peer): try again after `retry_after` seconds."""

    code = "unavailable"

    def __init__(self, message: str, retry_after: float, code: str | None = None):
        super().__init__(message, code)
        self.retry_after = retry_after
