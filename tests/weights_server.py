"""A weights source for tests: an HTTP(S) file server on loopback that counts what it
is asked for, honours Range, and can stall partway through a file so a test can kill
the client mid-download, or close the connection partway through one (once)."""

import ssl
import threading
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from ipaddress import ip_address
from pathlib import Path

from cryptography import x509

from llmgw_certmon import certs


class WeightsServer:
    def __init__(self, files: dict[str, bytes], tls_dir: Path | None = None):
        self.files = dict(files)
        self.requests: list[tuple[str, str]] = []  # (path, Range header or "")
        self.stall_after: int | None = None  # bytes of a body sent before stalling
        self.stalled = threading.Event()  # set once a body has stalled
        self.release = threading.Event()  # set to let a stalled body go on
        self.cut_after: int | None = None  # bytes of the next body sent before closing
        self.ca_file: Path | None = None
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, fmt, *args):
                pass

            def do_GET(self):
                outer.requests.append((self.path, self.headers.get("Range", "")))
                data = outer.files.get(self.path.lstrip("/"))
                if data is None:
                    self.send_error(404)
                    return
                start = 0
                rng = self.headers.get("Range", "")
                if rng.startswith("bytes=") and rng[6:].rstrip("-").isdigit():
                    start = int(rng[6:].rstrip("-"))
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                else:
                    self.send_response(200)
                self.send_header("Content-Length", str(len(data) - start))
                self.end_headers()
                body = data[start:]
                cut = outer.stall_after
                if outer.cut_after is not None and outer.cut_after < len(body):
                    self.wfile.write(body[: outer.cut_after])
                    outer.cut_after = None
                    self.close_connection = True
                    return
                try:
                    if cut is not None and cut < len(body):
                        self.wfile.write(body[:cut])
                        self.wfile.flush()
                        outer.stalled.set()
                        outer.release.wait(60)
                        body = body[cut:]
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):
                    pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.scheme = "http"
        if tls_dir is not None:
            self._tls(tls_dir)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def _tls(self, d: Path) -> None:
        """A CA of its own and a certificate for 127.0.0.1: clients trust `ca_file`."""
        now = datetime.now(UTC)
        ca = certs.make_ca("test source CA", 2, now)
        leaf = certs.issue("127.0.0.1", [x509.IPAddress(ip_address("127.0.0.1"))], 1, now,
                           certs.load_key(ca.key_pem, "ca"), ca.cert)  # fmt: skip
        d.mkdir(parents=True, exist_ok=True)
        self.ca_file = d / "source-ca.crt"
        self.ca_file.write_bytes(ca.cert_pem)
        (d / "source.crt").write_bytes(leaf.cert_pem)
        (d / "source.key").write_bytes(leaf.key_pem)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(d / "source.crt", d / "source.key")
        self.httpd.socket = ctx.wrap_socket(self.httpd.socket, server_side=True)
        self.scheme = "https"

    def url(self, name: str) -> str:
        return f"{self.scheme}://127.0.0.1:{self.httpd.server_port}/{name}"

    def count(self, name: str) -> int:
        return sum(1 for path, _ in self.requests if path == f"/{name}")

    def stop(self) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()
