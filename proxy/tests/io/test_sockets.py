"""Writing the pieces of a message: one buffer when they are small together, as they are when
not."""

from __future__ import annotations

from typing import Any

from meshlet.proxy.io.sockets import COALESCE_LIMIT, write_pieces


class Recorded:
    """A transport that records its calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def write(self, data: bytes) -> None:
        self.calls.append(("write", data))

    def writelines(self, data: Any) -> None:
        self.calls.append(("writelines", list(data)))


def test_small_pieces_go_as_one_write() -> None:
    transport = Recorded()
    assert write_pieces(transport, [b"HTTP/1.1 200 OK\r\n\r\n", b"body"]) == 23  # type: ignore[arg-type]
    assert transport.calls == [("write", b"HTTP/1.1 200 OK\r\n\r\nbody")]


def test_one_piece_is_written_as_it_is() -> None:
    transport = Recorded()
    piece = b"x" * (COALESCE_LIMIT * 2)
    assert write_pieces(transport, [piece]) == len(piece)  # type: ignore[arg-type]
    assert transport.calls == [("write", piece)]
    assert transport.calls[0][1] is piece  # not copied


def test_large_pieces_are_not_copied_together() -> None:
    transport = Recorded()
    head, body = b"head", b"b" * COALESCE_LIMIT
    assert write_pieces(transport, [head, body]) == len(head) + len(body)  # type: ignore[arg-type]
    assert transport.calls == [("writelines", [head, body])]
