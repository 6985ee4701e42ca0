"""HTTP/1.1 on a raw socket, for testing the router's own server: send any bytes, read
back whole answers (parsed by httptools, so a malformed answer fails the test)."""

import json
import socket
import time
from urllib.parse import urlsplit

import httptools


class Reply:
    def __init__(self):
        self.status = 0
        self.headers: dict[str, str] = {}
        self.body = b""
        self.parts: list[bytes] = []
        self.version = ""
        self.keep_alive = True

    def json(self):
        return json.loads(self.body)


class Conn:
    """One client connection to `url`."""

    def __init__(self, url: str, timeout: float = 10.0):
        parts = urlsplit(url)
        self.sock = socket.create_connection((parts.hostname, parts.port), timeout=timeout)
        self.timeout = timeout
        self.replies: list[Reply] = []
        self._current: Reply | None = None
        self._name = ""
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    # httptools callbacks
    def on_message_begin(self):
        self._current = Reply()

    def on_status(self, status: bytes):
        pass

    def on_header(self, name: bytes, value: bytes):
        self._current.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self):
        self._current.status = self.parser.get_status_code()
        self._current.version = self.parser.get_http_version()
        self._current.keep_alive = self.parser.should_keep_alive()

    def on_body(self, body: bytes):
        self._current.parts.append(body)  # joined once: a long stream comes in thousands

    def on_message_complete(self):
        self._current.body = b"".join(self._current.parts)
        if self._current.status != 100:
            self.replies.append(self._current)
        self._current = None

    def read(self, n: int = 1, timeout: float | None = None) -> list[Reply]:
        """The next `n` whole answers (AssertionError if the connection closes or the
        time runs out first)."""
        deadline = time.monotonic() + (timeout or self.timeout)
        while len(self.replies) < n:
            self._recv(deadline)
            assert not self.closed or len(self.replies) >= n, (
                f"the router closed the connection after {len(self.replies)} of {n} answers"
            )
        got, self.replies = self.replies[:n], self.replies[n:]
        return got

    def read_raw(self, timeout: float | None = None) -> bytes:
        """Bytes as they come (b"" once closed)."""
        self.sock.settimeout(timeout or self.timeout)
        return self.sock.recv(65536)

    def _recv(self, deadline: float) -> None:
        left = deadline - time.monotonic()
        assert left > 0, "no answer in time"
        self.sock.settimeout(left)
        data = self.sock.recv(65536)
        if not data:
            self.closed = True
            if self._current is not None and self._current.status:
                # An answer with neither a length nor chunks: it ends with the connection.
                self._current.body = b"".join(self._current.parts)
                self.replies.append(self._current)
                self._current = None
            return
        self.parser.feed_data(data)

    def wait_closed(self, timeout: float | None = None) -> bool:
        """True once the router has closed the connection (anything sent before is
        parsed first)."""
        deadline = time.monotonic() + (timeout or self.timeout)
        while not self.closed:
            try:
                self._recv(deadline)
            except (ConnectionResetError, BrokenPipeError):
                self.closed = True
            except (TimeoutError, AssertionError):
                return False
        return True

    def close(self):
        self.sock.close()


def request(method: str, path: str, body: bytes = b"", headers: dict | None = None,
            version: str = "1.1") -> bytes:  # fmt: skip
    lines = [f"{method} {path} HTTP/{version}", "Host: test"]
    headers = dict(headers or {})
    if body and "Transfer-Encoding" not in headers:
        headers.setdefault("Content-Length", str(len(body)))
    lines += [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def chunked(*pieces: bytes) -> bytes:
    """A chunked body of `pieces` (an empty piece would end it early: left out)."""
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces if p) + b"0\r\n\r\n"
