"""Errors shared by every llmgw tool; each tool's own errors derive from Error."""


class Error(Exception):
    """Base of every error llmgw raises on purpose."""


class ConfigError(Error):
    """The configuration file is missing, unreadable or invalid."""


class StoreError(Error):
    """The store cannot be opened, migrated or written."""
