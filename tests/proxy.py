"""A TCP proxy that tests cut and restore, to take a server (PostgreSQL, Redis) away from the
system for a while: cut() resets every open connection and refuses new ones until restore()."""

import socket
import threading


class Proxy:
    def __init__(self, host, port):
        self.upstream = (host, port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.up = True
        self.lock = threading.Lock()
        self.sockets = set()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if not self.up:
                _reset(client)
                continue
            try:
                server = socket.create_connection(self.upstream, timeout=5)
                server.settimeout(None)
            except OSError:
                _reset(client)
                continue
            with self.lock:
                self.sockets |= {client, server}
            threading.Thread(target=self._pipe, args=(client, server), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client), daemon=True).start()

    def _pipe(self, source, target):
        try:
            while data := source.recv(65536):
                target.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, target):
                self._drop(sock)

    def _drop(self, sock):
        with self.lock:
            self.sockets.discard(sock)
        _reset(sock)

    def cut(self):
        self.up = False
        with self.lock:
            open_ = list(self.sockets)
        for sock in open_:
            self._drop(sock)

    def restore(self):
        self.up = True

    def close(self):
        self.cut()
        self.listener.close()


def _reset(sock):
    """Reset the connection now. close() alone would not: while a pipe thread is blocked in
    recv() on the socket, the kernel keeps it (and the connection) until data comes, so a server
    connection cut mid-transaction stayed open, its locks held, and the system hung on them
    after the outage. shutdown() wakes the reader and ends the connection at once."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass
