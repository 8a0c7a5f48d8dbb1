"""Protocol detection from a connection's first bytes."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshlet.proxy.core.detect import H2_PREFACE, NEED_MORE, PEEK_BYTES, Protocol, detect

CLIENT_HELLO = bytes.fromhex("160301020001000200") + b"\x03\x03" + b"\x00" * 40


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (b"", NEED_MORE),
        (H2_PREFACE, Protocol.HTTP2),
        (H2_PREFACE + b"\x00\x00\x12\x04", Protocol.HTTP2),
        (H2_PREFACE[:10], NEED_MORE),
        (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", Protocol.HTTP1),
        (b"POST /api?q=1 HTTP/1.0\r\n", Protocol.HTTP1),
        (b"GET / HTTP/1.1\n", Protocol.HTTP1),
        (b"GET", NEED_MORE),
        (b"GET /", NEED_MORE),
        (b"GET / HTTP/1.", NEED_MORE),
        (b"GET / HTTP/1.1\r", NEED_MORE),
        (b"GET / HTTP/2.0\r\n", Protocol.OPAQUE),
        (b"GET / HTTP/1.1 extra\r\n", Protocol.OPAQUE),
        (b"get / ftp\r\n", Protocol.OPAQUE),
        (CLIENT_HELLO, Protocol.TLS),
        (CLIENT_HELLO[:3], NEED_MORE),
        (b"\x16\x03\x01\x00\x05\x02", Protocol.OPAQUE),  # a ServerHello is not a client
        (b"SSH-2.0-OpenSSH_9.2\r\n", Protocol.OPAQUE),
        (b"\x00\x01\x02", Protocol.OPAQUE),
        (b"*1\r\n$4\r\nPING\r\n", Protocol.OPAQUE),  # redis
        (b"G" * PEEK_BYTES, Protocol.OPAQUE),
    ],
)
def test_detect(data: bytes, expected: Protocol) -> None:
    assert detect(data) == expected


@given(st.binary(max_size=600))
def test_never_fails_and_need_more_only_when_short(data: bytes) -> None:
    verdict = detect(data)
    if verdict is NEED_MORE:
        assert len(data) < PEEK_BYTES


@given(st.sampled_from([b"GET", b"POST", b"PUT", b"OPTIONS"]), st.text("abc/?=&", max_size=50))
def test_every_prefix_of_a_request_line_needs_more(method: bytes, path: str) -> None:
    line = method + b" /" + path.encode() + b" HTTP/1.1\r\n"
    for cut in range(1, len(line)):
        assert detect(line[:cut]) is NEED_MORE, line[:cut]
    assert detect(line) is Protocol.HTTP1
