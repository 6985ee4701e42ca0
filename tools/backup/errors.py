"""What can go wrong in llmgw-backup; every error is one line for the operator."""

from llmgw.errors import Error


class BackupError(Error):
    """An archive could not be written, read or restored."""


class DumpError(BackupError):
    """The store could not be dumped, inspected or loaded (SQLite, pg_dump, pg_restore)."""


class ArchiveError(BackupError):
    """An archive is unreadable, incomplete, or does not match its manifest."""


class RestoreRefused(BackupError):
    """A restore would overwrite a store or files that are there; --force replaces them."""
