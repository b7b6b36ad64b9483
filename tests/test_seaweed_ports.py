"""The test S3 server's ports (tests/seaweed.py): SeaweedFS listens on each port and on port +
10000 (gRPC), so no port chosen may be another's gRPC port."""

from tests import seaweed


def test_no_port_is_another_ports_grpc_port(monkeypatch):
    # What the system hands out, in order: the second is the first's gRPC port less 10000, and
    # the fifth is the fourth's gRPC port; both are passed over.
    handed = iter([42847, 32847, 33001, 23001, 33002, 24000])

    class Socket:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def bind(self, address):
            if address[1] == 0:
                self.port = next(handed)

        def getsockname(self):
            return ("127.0.0.1", self.port)

    monkeypatch.setattr(seaweed.socket, "socket", Socket)
    assert seaweed._free_ports(4) == [42847, 33001, 33002, 24000]
