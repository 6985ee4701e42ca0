"""Errors llmgw-certmon raises on purpose; the CLI shows each as one line."""

from llmgw.errors import Error


class CertmonError(Error):
    """Something certmon was asked to do cannot be done."""


class NoCAError(CertmonError):
    """There is no CA to sign with: run `llmgw-certmon init-ca` first."""


class ExistsError(CertmonError):
    """A key or certificate is already there and is not to be overwritten."""


class ReadError(CertmonError):
    """A key or certificate file cannot be read or parsed."""
