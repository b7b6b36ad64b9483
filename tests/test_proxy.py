"""The outage tests' proxy does what they rely on: a cut ends every connection through it at
once, on both sides, as a server that went away does. (It once closed its sockets while its pipe
threads were blocked reading them, which left the connections open: a database session cut
mid-transaction kept its locks, and the system hung on them after the outage.)"""

import socket
import threading

import pytest

from tests.proxy import Proxy

pytestmark = pytest.mark.nodb


def test_a_cut_ends_both_sides_of_an_open_connection_at_once():
    server = socket.create_server(("127.0.0.1", 0))
    accepted = []
    threading.Thread(target=lambda: accepted.append(server.accept()[0]), daemon=True).start()
    proxy = Proxy("127.0.0.1", server.getsockname()[1])
    try:
        client = socket.create_connection(("127.0.0.1", proxy.port), timeout=5)
        client.sendall(b"BEGIN")
        for _ in range(50):
            if accepted:
                break
            threading.Event().wait(0.1)
        upstream = accepted[0]
        upstream.settimeout(5)
        assert upstream.recv(5) == b"BEGIN"  # through, and both pipe threads now wait in recv()
        proxy.cut()
        # The server's side ends (its session, and any locks it held, go with it) ...
        try:
            assert upstream.recv(1) == b""
        except ConnectionResetError:
            pass
        # ... and the client's: the system sees the outage instead of waiting forever.
        try:
            assert client.recv(1) == b""
        except ConnectionResetError:
            pass
    finally:
        proxy.close()
        server.close()
