"""Protocol detection from a connection's first bytes."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshlet.proxy.core.detect import (
    H2_PREFACE,
    KNOWN_METHODS,
    NEED_MORE,
    PEEK_BYTES,
    Protocol,
    detect,
    may_be_http,
)

CLIENT_HELLO = bytes.fromhex("160301020001000200") + b"\x03\x03" + b"\x00" * 40
TCHAR = b"!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (b"", NEED_MORE),
        (H2_PREFACE, Protocol.HTTP2),
        (H2_PREFACE + b"\x00\x00\x12\x04", Protocol.HTTP2),
        (H2_PREFACE[:10], NEED_MORE),
        (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", Protocol.HTTP1),
        # a known method and a space decide: the engine judges the rest
        (b"GET ", Protocol.HTTP1),
        (b"POST /" + b"a" * 4000, Protocol.HTTP1),
        (b"GET / HTTP/2.0\r\n", Protocol.HTTP1),  # the engine answers 505
        (b"GET / HTTP/1.1 extra\r\n", Protocol.HTTP1),  # the engine answers 400
        (b"M-SEARCH * HTTP/1.1\r\n", Protocol.HTTP1),
        (b"G", NEED_MORE),
        (b"GET", NEED_MORE),
        # another token: HTTP when a request target starts after the space
        (b"FOO /x HTTP/1.1\r\n", Protocol.HTTP1),
        (b"FOO * HTTP/1.1\r\n", Protocol.HTTP1),
        (b"FOO http://a/ HTTP/1.1\r\n", Protocol.HTTP1),
        (b"FOO HTTPS://a/ HTTP/1.1\r\n", Protocol.HTTP1),
        (b"get /", Protocol.HTTP1),  # lower case: llhttp refuses it with 400
        (b"FOO ", NEED_MORE),
        (b"FOO htt", NEED_MORE),
        (b"get foo\r\n", Protocol.OPAQUE),  # memcached
        (b"FOO hello", NEED_MORE),  # `FOO hello HTTP/1.1` is a request line to http.server
        (b"FOO hello\r\n", Protocol.OPAQUE),
        (b"FOO hello HTTP/1.1\r\n", Protocol.HTTP1),
        (b"FOO\thello\x0bHTTP/1.0\n", Protocol.HTTP1),
        # any whitespace http.server splits on separates words, and may lead the line
        (b"GET\t/admin\tHTTP/1.1\r\n", Protocol.HTTP1),
        (b"GET\x0c", Protocol.HTTP1),
        (b" GET / HTTP/1.1\r\n", Protocol.HTTP1),
        (b"\t\x0b\x0c\x1c", NEED_MORE),
        (b" PING\r\n", Protocol.OPAQUE),
        (b"EHLO mail.example.com\r\n", Protocol.OPAQUE),  # SMTP's client, after the banner
        (b"PING\r\n", Protocol.OPAQUE),
        (b"*1\r\n$4\r\nPING\r\n", Protocol.OPAQUE),  # redis
        (b"SSH-2.0-OpenSSH_9.2\r\n", Protocol.OPAQUE),
        (b"\x00\x00\x00\x08\x04\xd2\x16\x2f", Protocol.OPAQUE),  # postgres SSLRequest
        (b"\x00\x01\x02", Protocol.OPAQUE),
        (CLIENT_HELLO, Protocol.TLS),
        (CLIENT_HELLO[:3], NEED_MORE),
        (b"\x16\x03\x01\x00\x05\x02", Protocol.OPAQUE),  # a ServerHello is not a client
        (b"G" * PEEK_BYTES, Protocol.HTTP1),  # a method as long as the peek: still HTTP-shaped
        # empty lines before the request line: HTTP/1 servers skip them (RFC 9112 2.2)
        (b"\r\nGET / HTTP/1.1\r\n", Protocol.HTTP1),
        (b"\n\n\r\nFOO /x HTTP/1.1\r\n", Protocol.HTTP1),
        (b"\r\n", NEED_MORE),
        (b"\r\nG", NEED_MORE),
        (b"\r\n" * (PEEK_BYTES // 2), Protocol.HTTP1),
        (b"\r\nPING\r\n", Protocol.OPAQUE),
    ],
)
def test_detect(data: bytes, expected: Protocol) -> None:
    assert detect(data) == expected


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (b"", Protocol.OPAQUE),  # the client sent nothing: a server-speaks-first protocol
        (b"G", Protocol.HTTP1),  # the engine answers 408
        (b"GET", Protocol.HTTP1),
        (b"FOO ", Protocol.HTTP1),
        (b"FOO htt", Protocol.HTTP1),
        (H2_PREFACE[:10], Protocol.HTTP1),
        (CLIENT_HELLO[:3], Protocol.OPAQUE),
        (b"PING\r\n", Protocol.OPAQUE),
        (b"\n", Protocol.HTTP1),  # an empty line may still be followed by a request
        (b"\r\nGE", Protocol.HTTP1),
    ],
)
def test_when_no_more_bytes_will_come_a_prefix_of_http_is_http(
    data: bytes, expected: Protocol
) -> None:
    assert detect(data, final=True) == expected


@given(st.binary(max_size=600))
def test_never_fails_and_need_more_only_when_short(data: bytes) -> None:
    verdict = detect(data)
    if verdict is NEED_MORE:
        assert len(data) < PEEK_BYTES
    assert detect(data, final=True) is not NEED_MORE


_methods = st.one_of(
    st.sampled_from(sorted(KNOWN_METHODS)), st.binary(min_size=1, max_size=40).map(
        lambda raw: bytes(TCHAR[b % len(TCHAR)] for b in raw)
    ),
)  # fmt: skip
_targets = st.one_of(
    st.text("abc/?=&%.-", max_size=700).map(lambda path: b"/" + path.encode()),
    st.just(b"*"),
    st.text("abc.:", max_size=30).map(lambda host: b"http://" + host.encode() + b"/"),
)


@given(
    st.sampled_from([b"", b"\r\n", b"\n", b"\r\n\r\n\n"]),
    _methods,
    _targets,
    st.sampled_from([b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2.0", b"HTTP/9"]),
)
def test_no_prefix_of_an_http_request_is_ever_opaque(
    empty_lines: bytes, method: bytes, target: bytes, version: bytes
) -> None:
    """Whatever method, target length or version, after empty lines or not: a client cannot
    get HTTP relayed as opaque TCP by sending it slowly, in pieces, or with a long line."""
    request = (
        empty_lines + method + b" " + target + b" " + version
        + b"\r\nmeshlet-client-id: forged\r\n\r\n"
    )  # fmt: skip
    if request.startswith(H2_PREFACE[:4]):  # `PRI ` can still become the HTTP/2 preface
        return
    for cut in range(1, len(request) + 1):
        prefix = request[:cut]
        assert detect(prefix) in (NEED_MORE, Protocol.HTTP1), prefix
        assert detect(prefix, final=True) is Protocol.HTTP1, prefix
        assert may_be_http(prefix, final=True) is True


def test_the_h2_preface_in_pieces_is_never_opaque() -> None:
    for cut in range(1, len(H2_PREFACE)):
        assert detect(H2_PREFACE[:cut]) is NEED_MORE
        assert may_be_http(H2_PREFACE[:cut], final=True) is True
    assert detect(H2_PREFACE) is Protocol.HTTP2


def test_a_known_method_decides_within_its_first_bytes() -> None:
    for method in KNOWN_METHODS:
        assert detect(method + b" ") is Protocol.HTTP1, method


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (b"", None),
        (b"GE", None),
        (b"GET / HTTP/1.1\r\n", True),
        (H2_PREFACE, True),
        (b"EHLO client\r\n", False),
        (CLIENT_HELLO, False),
        (b"\x00binary", False),
    ],
)
def test_may_be_http(data: bytes, expected: bool | None) -> None:
    assert may_be_http(data) is expected
