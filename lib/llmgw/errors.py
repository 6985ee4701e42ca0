"""Errors shared by every llmgw tool; each tool's own errors derive from Error."""


class Error(Exception):
    """Base of every error llmgw raises on purpose."""


class ConfigError(Error):
    """The configuration file is missing, unreadable or invalid."""


class StoreError(Error):
    """The store cannot be opened, migrated or written."""


class TenancyError(Error):
    """A tenancy, limit or budget change that cannot be made; `kind` says why:
    invalid (a bad value), not_found (no such record) or conflict (taken, or in use)."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


class Refused(Error):
    """A change or lookup an operator asked for that cannot be made; `code` names it."""

    code = "refused"

    def __init__(self, message: str, code: str | None = None):
        super().__init__(message)
        if code is not None:
            self.code = code


class NotFound(Refused):
    """No such model, replica, node or operator."""

    code = "not_found"


class Conflict(Refused):
    """Taken already, or in a state that does not allow the change."""

    code = "conflict"


class Invalid(Refused):
    """A value that is not allowed."""

    code = "invalid_value"


class EngineError(Error):
    """An engine cannot do what it was asked: a shard role it does not take, an install
    it cannot make."""
