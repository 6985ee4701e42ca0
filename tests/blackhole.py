"""A TCP proxy between a tool and a real server that can turn into a black hole: what a
network partition that drops packets looks like to the tool, without root or namespaces.

`blackhole()` stops forwarding on every open connection (they stay open: no FIN, no
RST, as when packets are dropped) and stops accepting new ones (the listen queue is cut
to its minimum, so the kernel soon answers no SYN at all). `heal()` undoes both: what
either side sent meanwhile is delivered then, as TCP's retransmissions would deliver
it, and connections queued meanwhile are taken. `heal(forget=True)` opens the way for
new connections only: the old ones stay silent for good, as behind a stateful firewall
whose connection-tracking entries expired during the partition (it drops what it no
longer knows), so only a tool that gives up on them and connects again gets through.

Its limit: this machine's kernel still acknowledges every packet, and answers TCP
keepalives, on the proxy's behalf, so libpq's tcp_user_timeout and keepalives never
fire here. What this proves is the tool's own bound on a store that does not answer
(a frozen server looks the same); real packet drops are for tests/partition.
"""

import socket
import threading

_CHUNK = 65536


class Blackhole:
    def __init__(self, target: tuple[str, int], host: str = "127.0.0.1"):
        self.target = target
        self._open = threading.Event()
        self._open.set()
        self._stop = threading.Event()
        self._listener = socket.create_server((host, 0), backlog=128)
        self._listener.settimeout(0.1)
        self.port = self._listener.getsockname()[1]
        self._socks: list[socket.socket] = []
        self._gates: list[threading.Event] = []  # one per connection: set while it flows
        self._lock = threading.Lock()
        self.accepted = 0
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    @classmethod
    def for_url(cls, url: str) -> tuple["Blackhole", str]:
        """A proxy in front of the server of a postgresql:// URL, and the URL through it."""
        from urllib.parse import urlparse

        parsed = urlparse(url)
        hole = cls((parsed.hostname or "127.0.0.1", parsed.port or 5432))
        netloc = parsed.netloc.rsplit("@", 1)
        host = f"127.0.0.1:{hole.port}"
        proxied = parsed._replace(netloc=f"{netloc[0]}@{host}" if len(netloc) == 2 else host)
        return hole, proxied.geturl()

    @property
    def holding(self) -> bool:
        return not self._open.is_set()

    def blackhole(self) -> None:
        with self._lock:
            self._open.clear()
            for gate in self._gates:
                gate.clear()
        self._listener.listen(0)

    def heal(self, forget: bool = False) -> None:
        self._listener.listen(128)
        with self._lock:
            self._open.set()
            for gate in () if forget else self._gates:
                gate.set()

    def close(self) -> None:
        self._stop.set()
        self._open.set()
        self._listener.close()
        with self._lock:
            for gate in self._gates:
                gate.set()
            for s in self._socks:
                try:
                    s.close()
                except OSError:
                    pass
        self._thread.join(timeout=2)

    # -- the threads -------------------------------------------------------------------

    def _accept(self) -> None:
        while not self._stop.is_set():
            if not self._open.wait(0.1):
                continue
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            client.settimeout(None)
            gate = threading.Event()
            with self._lock:
                self._socks += [client, upstream]
                self.accepted += 1
                if self._open.is_set():
                    gate.set()
                self._gates.append(gate)
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst, gate), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, gate: threading.Event) -> None:
        """Copy one direction; while black-holed, whatever arrives is held, not sent."""
        try:
            while not self._stop.is_set():
                gate.wait()
                data = src.recv(_CHUNK)
                gate.wait()  # read just as the hole opened: held until it heals
                if not data or self._stop.is_set():
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
