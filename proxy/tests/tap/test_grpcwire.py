"""gRPC over HTTP/2 for the tap server, as transcripts: which heads are calls, how the one
request message is read (and refused past its limit before a byte of it is kept), and what
the answers look like on the wire."""

from __future__ import annotations

import pytest

from meshlet.proxy.http.h2headers import Malformed
from meshlet.proxy.tap.grpcwire import (
    MessageReader,
    Refusal,
    Status,
    message_frame,
    read_call,
    refusal_head,
    trailers,
)

PATH = b"/io.linkerd.proxy.tap.Tap/Observe"
# what grpcio sends
HEAD = [
    (b":method", b"POST"), (b":scheme", b"https"), (b":path", PATH), (b":authority", b"tap"),
    (b"te", b"trailers"), (b"content-type", b"application/grpc"),
    (b"user-agent", b"grpc-python/1.60"), (b"grpc-accept-encoding", b"identity,deflate,gzip"),
]  # fmt: skip


def _with(name: bytes, value: bytes) -> list[tuple[bytes, bytes]]:
    return [(n, value if n == name else v) for n, v in HEAD]


def test_a_grpc_call_of_the_path_is_one() -> None:
    assert read_call(HEAD, PATH, 64) is None
    assert read_call([*HEAD, (b"grpc-encoding", b"identity")], PATH, 64) is None
    assert read_call(_with(b"content-type", b"application/grpc+proto"), PATH, 64) is None


@pytest.mark.parametrize(
    ("head", "expected"),
    [
        (_with(b":method", b"GET"), Refusal(Status.UNIMPLEMENTED, "gRPC calls are POST requests",
                                            405)),
        (_with(b"content-type", b"application/json"),
         Refusal(Status.UNIMPLEMENTED, "not a gRPC call (content-type)", 415)),
        (_with(b":path", b"/io.linkerd.proxy.tap.Tap/Other"),
         Refusal(Status.UNIMPLEMENTED, "no method /io.linkerd.proxy.tap.Tap/Other here")),
        ([*HEAD, (b"grpc-encoding", b"gzip")],
         Refusal(Status.UNIMPLEMENTED, "compressed messages are not accepted")),
    ],
)  # fmt: skip
def test_other_calls_are_refused(head: list[tuple[bytes, bytes]], expected: Refusal) -> None:
    assert read_call(head, PATH, 64) == expected


def test_a_malformed_head_is_malformed() -> None:
    assert isinstance(read_call([*HEAD, (b"Upper", b"x")], PATH, 64), Malformed)
    pseudo_late = [(b"content-type", b"application/grpc"), *HEAD]  # a pseudo-header after it
    assert isinstance(read_call(pseudo_late, PATH, 64), Malformed)
    assert isinstance(read_call(HEAD, PATH, 4), Malformed)  # more fields than allowed


def test_a_message_in_pieces() -> None:
    reader = MessageReader(100)
    wire = message_frame(b"hello")
    for byte in wire:
        assert reader.feed(bytes([byte])) is None
    assert reader.message == b"hello"
    assert reader.end() == b"hello"


def test_an_empty_message_is_a_message() -> None:
    reader = MessageReader(100)
    assert reader.feed(message_frame(b"")) is None
    assert reader.end() == b""


def test_a_message_over_the_limit_is_refused_on_its_prefix_alone() -> None:
    reader = MessageReader(100)
    assert reader.feed(b"\x00\x00\x00") is None
    refused = reader.feed(b"\x00\x65" + b"x" * 50)  # 101 bytes declared
    assert refused == Refusal(
        Status.RESOURCE_EXHAUSTED, "a request message of 101 bytes is over the 100-byte limit"
    )
    assert reader.buffered == 5 and reader.message is None  # the prefix: none of the message
    big = MessageReader(100)
    assert big.feed(b"\x00\xff\xff\xff\xff") == Refusal(
        Status.RESOURCE_EXHAUSTED,
        "a request message of 4294967295 bytes is over the 100-byte limit",
    )
    assert MessageReader(100).feed(message_frame(b"x" * 100)) is None  # at the limit: taken


def test_what_a_unary_call_may_not_send() -> None:
    compressed = MessageReader(100)
    assert compressed.feed(b"\x01\x00\x00\x00\x01x") == Refusal(
        Status.UNIMPLEMENTED, "compressed messages are not accepted"
    )
    two = MessageReader(100)
    assert two.feed(message_frame(b"a") + message_frame(b"b")) == Refusal(
        Status.INVALID_ARGUMENT, "more than one message on a unary call"
    )
    later = MessageReader(100)
    assert later.feed(message_frame(b"a")) is None
    assert later.feed(b"\x00") == Refusal(
        Status.INVALID_ARGUMENT, "more than one message on a unary call"
    )
    assert MessageReader(100).end() == Refusal(Status.INVALID_ARGUMENT, "no request message")
    short = MessageReader(100)
    assert short.feed(b"\x00\x00\x00\x00\x05ab") is None
    assert short.end() == Refusal(Status.INVALID_ARGUMENT, "the request message is cut short")


def test_the_answers_on_the_wire() -> None:
    assert message_frame(b"abc") == b"\x00\x00\x00\x00\x03abc"
    assert trailers(Status.OK) == [(b"grpc-status", b"0")]
    assert refusal_head(Refusal(Status.PERMISSION_DENIED, "x may not tap: 100% sure")) == [
        (b":status", b"200"), (b"content-type", b"application/grpc"),
        (b"grpc-status", b"7"), (b"grpc-message", b"x may not tap: 100%25 sure"),
    ]  # fmt: skip
    assert refusal_head(Refusal(Status.UNIMPLEMENTED, "no", http=415)) == [
        (b":status", b"415"), (b"content-length", b"0"),
    ]  # fmt: skip
