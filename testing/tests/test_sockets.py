import socket

import pytest

from meshlet_testing.sockets import _ephemeral_range, free_port


def test_free_ports_lie_below_the_ephemeral_range_and_are_never_handed_out_twice() -> None:
    low, _ = _ephemeral_range()
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    assert all(10000 <= port < low for port in ports)
    with socket.socket() as s:  # free now: a server can listen on it
        s.bind(("127.0.0.1", ports[-1]))
        s.listen()


def test_a_port_someone_listens_on_is_never_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    from meshlet_testing import sockets

    held = []
    try:  # ten ports: nine held by listeners this test opens itself, one free
        first = free_port()
        monkeypatch.setattr(sockets, "_LOWEST", first)
        monkeypatch.setattr(sockets, "_ephemeral_range", lambda: (first + 10, first + 20))
        monkeypatch.setattr(sockets, "_HANDED_OUT", set())
        monkeypatch.setattr(sockets, "_LOWEST_SPAN", 10)
        free = None
        for port in range(first, first + 10):
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                s.close()
                continue
            if free is None:
                free = port
                s.close()
                continue
            s.listen()
            held.append(s)
        assert free is not None
        assert sockets.free_port() == free
        with pytest.raises(RuntimeError, match="no free port"):
            sockets.free_port()
    finally:
        for s in held:
            s.close()
