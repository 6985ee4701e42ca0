"""The admin API's HTTP server: what it does with a client that went away."""

from http.server import BaseHTTPRequestHandler

from llmgw_scheduler.admin import AdminServer


def _error_output(capsys, exc: Exception) -> str:
    server = AdminServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    try:
        try:
            raise exc
        except Exception:
            server.handle_error(None, ("198.18.0.1", 4242))
    finally:
        server.server_close()
    return capsys.readouterr().err


def test_a_client_that_gave_up_before_its_answer_leaves_no_traceback(capsys):
    assert _error_output(capsys, BrokenPipeError(32, "Broken pipe")) == ""
    assert _error_output(capsys, ConnectionResetError(104, "reset")) == ""


def test_a_handler_that_fails_otherwise_still_leaves_its_traceback(capsys):
    assert "ValueError: a bug" in _error_output(capsys, ValueError("a bug"))
