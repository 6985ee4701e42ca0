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


class OperatorError(Error):
    """An operator that cannot be made or removed as asked."""
