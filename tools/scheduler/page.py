"""The read-only status page (HTML), served by the admin API at / and /status."""


def serve(handler, url) -> None:
    """Answer GET / or /status on the admin API's handler (authentication included)."""
    handler._error(501, "not_implemented", "the status page is not built yet")
