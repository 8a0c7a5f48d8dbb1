"""The SNI parser: real ClientHellos from Python's ssl (captured through a MemoryBIO), hellos
built by hand for the edge cases, and hostile bytes that must never raise."""

from __future__ import annotations

import ssl
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshlet.api import wellknown
from meshlet.proxy.core.detect import Protocol, detect
from meshlet.proxy.core.sni import (
    MAX_HELLO_BYTES,
    MAX_PEEK_BYTES,
    NOT_TLS,
    Incomplete,
    NotTls,
    Sni,
    parse_sni,
)

WEB = wellknown.identity_name("web", "emojivoto")  # 59 characters
LONG = wellknown.identity_name("a-service-account-with-a-long-name", "a-namespace-too")


def captured_hello(
    server_name: str | None, alpn: tuple[str, ...] = ("transport.l5d.io/v1",)
) -> bytes:
    """The first flight of Python's TLS client, as it would arrive on the wire."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    if server_name is None:
        context.check_hostname = False
    if alpn:
        context.set_alpn_protocols(list(alpn))
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = context.wrap_bio(incoming, outgoing, server_hostname=server_name)
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


HELLO = captured_hello(WEB)


def record(body: bytes, kind: int = 0x16) -> bytes:
    return struct.pack("!BHH", kind, 0x0301, len(body)) + body


def vector(length_size: int, body: bytes) -> bytes:
    return len(body).to_bytes(length_size, "big") + body


def extension(kind: int, body: bytes) -> bytes:
    return struct.pack("!H", kind) + vector(2, body)


def sni_extension(*names: tuple[int, bytes]) -> bytes:
    return extension(0, vector(2, b"".join(bytes([k]) + vector(2, n) for k, n in names)))


def hello(*extensions: bytes, with_extensions: bool = True, session_id: bytes = b"") -> bytes:
    """A ClientHello record built by hand."""
    body = b"\x03\x03" + b"\x11" * 32 + vector(1, session_id) + vector(2, b"\x13\x01")
    body += vector(1, b"\x00")
    if with_extensions:
        body += vector(2, b"".join(extensions))
    return record(b"\x01" + vector(3, body))


def split_records(data: bytes, size: int) -> bytes:
    """Re-frames the handshake bytes of a one-record hello into records of `size` bytes."""
    payload = data[5:]
    return b"".join(record(payload[i : i + size]) for i in range(0, len(payload), size))


def test_the_name_of_a_real_client_hello() -> None:
    data = captured_hello(WEB)
    assert detect(data) is Protocol.TLS
    assert parse_sni(data) == Sni(WEB)


def test_a_name_longer_than_a_certificate_common_name() -> None:
    assert len(LONG) > 64
    assert parse_sni(captured_hello(LONG)) == Sni(LONG)


def test_a_hello_without_a_name() -> None:
    assert parse_sni(captured_hello(None)) == Sni(None)
    assert parse_sni(hello(extension(0x10, vector(2, vector(1, b"h2"))))) == Sni(None)
    assert parse_sni(hello(with_extensions=False)) == Sni(None)


def test_every_prefix_asks_for_more_and_the_asked_for_bytes_suffice() -> None:
    data = captured_hello(WEB)
    for n in range(len(data)):
        result = parse_sni(data[:n])
        assert isinstance(result, Incomplete), n
        assert n < result.needed <= len(data)
    # The peek loop: peek what is asked for, until the answer comes.
    peeks, result = 0, parse_sni(b"")
    while isinstance(result, Incomplete):
        peeks += 1
        result = parse_sni(data[: result.needed])
    assert result == Sni(WEB)
    assert peeks == 2  # the record header, then the record


def test_trailing_bytes_after_the_hello_are_not_looked_at() -> None:
    assert parse_sni(captured_hello(WEB) + b"\xff" * 100) == Sni(WEB)


@pytest.mark.parametrize("size", [1, 7, 100, 300])
def test_a_hello_split_over_several_records(size: int) -> None:
    data = split_records(captured_hello(WEB), size)
    assert parse_sni(data) == Sni(WEB)
    for n in range(0, len(data), max(1, len(data) // 50)):
        assert isinstance(parse_sni(data[:n]), Incomplete)


def test_names_are_lower_case_and_other_name_types_are_skipped() -> None:
    assert parse_sni(hello(sni_extension((0, b"Web.Example")))) == Sni("web.example")
    assert parse_sni(hello(sni_extension((7, b"\x00junk"), (0, b"a.b")))) == Sni("a.b")


@pytest.mark.parametrize(
    "data",
    [
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
        b"\x16\x02\x00\x00\x05hello",  # SSL 2-ish version
        b"\x17\x03\x03\x00\x05hello",  # application data, not a handshake
        record(b"\x02" + vector(3, b"\x03\x03" + b"\x00" * 40)),  # a ServerHello
        b"\x16\x03\x01\x00\x00",  # an empty record
        b"\x16\x03\x01\x40\x01",  # a record longer than 2^14
        record(b"\x01" + (MAX_HELLO_BYTES + 1).to_bytes(3, "big")),  # a hello too large
        hello(sni_extension((0, b"bad name"))),
        hello(sni_extension((0, b"trailing.dot."))),
        hello(sni_extension((0, b"a..b"))),
        hello(sni_extension((0, b""))),
        hello(sni_extension((0, b"x" * 254))),
        hello(sni_extension((0, b"caf\xc3\xa9.example"))),
        hello(sni_extension((0, b"a.b"), (0, b"c.d"))),  # two host names
        hello(sni_extension((0, b"a.b")), sni_extension((0, b"a.b"))),  # the extension twice
        hello(sni_extension((0, b"a.b")) + b"\x00"),  # a truncated extension
        hello(session_id=b"\x00" * 33),
        record(b"\x01" + vector(3, b"\x03\x03" + b"\x00" * 10)),  # the hello stops short
    ],
)
def test_not_a_client_hello(data: bytes) -> None:
    assert parse_sni(data) is NOT_TLS


def test_a_hostile_prefix_is_refused_without_waiting_for_its_length() -> None:
    assert parse_sni(b"\x16\x03\x01\xff\xff\x02") is NOT_TLS  # a ServerHello ahead
    assert parse_sni(b"\x16\x03\x01\x40\x00\x01" + (2**24 - 1).to_bytes(3, "big")) is NOT_TLS
    assert parse_sni(b"\x16\x05") is NOT_TLS
    assert parse_sni(b"\x16\x03") == Incomplete(5)


def test_many_tiny_records_stop_at_the_peek_bound() -> None:
    # One-byte records: the hello's 4-byte header, then ever more records, never ending.
    data = record(b"\x01") + record(b"\x00") + record(b"\x40") + record(b"\x00")
    data += record(b"\x03") * (MAX_PEEK_BYTES // 6)
    assert parse_sni(data) is NOT_TLS
    assert parse_sni(data[: MAX_PEEK_BYTES // 2]) != NOT_TLS  # still waiting, within bounds


@settings(max_examples=500)
@given(st.binary(max_size=600))
def test_arbitrary_bytes_never_raise_and_ask_for_bounded_more(data: bytes) -> None:
    result = parse_sni(data)
    assert isinstance(result, Incomplete | Sni | NotTls)
    if isinstance(result, Incomplete):
        assert len(data) < result.needed <= MAX_PEEK_BYTES


@settings(max_examples=300)
@given(st.binary(min_size=1, max_size=120), st.integers(min_value=0))
def test_tls_framed_garbage_never_raises(body: bytes, cut: int) -> None:
    data = record(b"\x01" + vector(3, body))
    assert isinstance(parse_sni(data[: cut % (len(data) + 1)]), Incomplete | Sni | NotTls)


@settings(max_examples=300)
@given(st.data())
def test_a_mutated_real_hello_never_raises(data: st.DataObject) -> None:
    raw = bytearray(HELLO)
    for _ in range(data.draw(st.integers(1, 4))):
        raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(raw)))
    assert isinstance(parse_sni(bytes(raw[:cut])), Incomplete | Sni | NotTls)


@settings(max_examples=300)
@given(st.binary(max_size=300), st.binary(min_size=1, max_size=50))
def test_an_answer_never_changes_when_more_bytes_arrive(data: bytes, more: bytes) -> None:
    for prefix in (data, HELLO[: len(data)]):
        first = parse_sni(prefix)
        if not isinstance(first, Incomplete):
            assert parse_sni(prefix + more) == first
