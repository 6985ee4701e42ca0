"""An engine connection is given up once its host stops answering (a partition sends
no reset): the socket options that make the kernel find out. The behaviour itself, a
whole request retried elsewhere when its engine is cut off, is proven by the partition
suite (tests/partition/test_split.py)."""

import socket

from llmgw_router.upstream import dead_after


def test_an_engine_connection_is_probed_and_given_up_after_its_host_is_silent():
    server = socket.create_server(("127.0.0.1", 0))
    sock = socket.create_connection(server.getsockname())
    try:
        dead_after(sock, 12.0)
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        opt = lambda name: sock.getsockopt(socket.IPPROTO_TCP, getattr(socket, name))  # noqa: E731
        # first probe after 6 s of silence, then every 2 s, three unanswered: 12 s
        assert (opt("TCP_KEEPIDLE"), opt("TCP_KEEPINTVL"), opt("TCP_KEEPCNT")) == (6, 2, 3)
        assert opt("TCP_USER_TIMEOUT") == 12000
    finally:
        sock.close()
        server.close()


def test_zero_leaves_an_engine_connection_as_the_system_has_it():
    a, b = socket.socketpair()
    try:
        dead_after(a, 0)
        assert a.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 0
    finally:
        a.close()
        b.close()
