"""The HTTP/2 codec, sans I/O: peers' bytes made by an independent encoder (`hyperframe`,
`hpack`), what the codec tells its handler recorded, what it writes parsed back."""

from __future__ import annotations

import struct
import time
from typing import Any

import pytest
from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.events import DataReceived, ResponseReceived, StreamEnded, TrailersReceived
from hpack import Encoder as PeerEncoder
from hyperframe.frame import (
    ContinuationFrame,
    DataFrame,
    Frame,
    GoAwayFrame,
    HeadersFrame,
    PingFrame,
    PriorityFrame,
    PushPromiseFrame,
    RstStreamFrame,
    SettingsFrame,
    WindowUpdateFrame,
)

from meshlet.proxy.http.h2codec import (
    MAX_CONTINUATIONS,
    PREFACE,
    SETTINGS,
    Codec,
    ErrorCode,
    NoStreamIds,
    ProtocolError,
    StreamClosed,
    frame,
)
from meshlet_testing.h2handler import RecordingHandler

WINDOW = 65536
REQUEST = [(b":method", b"GET"), (b":scheme", b"http"), (b":path", b"/"),
           (b":authority", b"web:80")]  # fmt: skip
RESPONSE = [(b":status", b"200"), (b"content-type", b"text/plain")]


Recorder = RecordingHandler


def wire(*frames: Frame) -> bytes:
    return b"".join(f.serialize() for f in frames)


def frames_of(data: bytes) -> list[tuple[int, int, int, bytes]]:
    """(type, flags, stream id, payload) of each frame in `data`."""
    out, pos = [], 0
    while pos < len(data):
        length = int.from_bytes(data[pos : pos + 3], "big")
        kind, flags = data[pos + 3], data[pos + 4]
        sid = int.from_bytes(data[pos + 5 : pos + 9], "big") & 0x7FFFFFFF
        out.append((kind, flags, sid, data[pos + 9 : pos + 9 + length]))
        pos += 9 + length
    return out


def rst_codes(data: bytes) -> dict[int, int]:
    return {sid: int.from_bytes(p, "big") for kind, _, sid, p in frames_of(data) if kind == 3}


def goaway_code(data: bytes) -> int | None:
    codes = [int.from_bytes(p[4:8], "big") for kind, _, _, p in frames_of(data) if kind == 7]
    return codes[-1] if codes else None


def window_updates(data: bytes) -> list[tuple[int, int]]:
    return [(sid, int.from_bytes(p, "big")) for kind, _, sid, p in frames_of(data) if kind == 8]


class Server:
    """A server-side codec with its client's preface already read."""

    def __init__(self, **kwargs: Any) -> None:
        self.handler = Recorder()
        self.codec = Codec(self.handler, False, WINDOW, 4 * WINDOW, 16384, **kwargs)
        self.codec.start()
        self.enc = PeerEncoder()
        self.codec.receive(PREFACE + wire(SettingsFrame(0)))
        self.start = self.codec.take()
        self.handler.calls.clear()

    def headers(self, sid: int, fields: list[tuple[bytes, bytes]] = REQUEST, **kw: Any) -> bytes:
        kw.setdefault("flags", ["END_HEADERS"])
        return HeadersFrame(sid, self.enc.encode(fields), **kw).serialize()

    def feed(self, data: bytes) -> bytes:
        self.codec.receive(data)
        return self.codec.take()

    def fails(self, data: bytes, code: ErrorCode) -> bytes:
        with pytest.raises(ProtocolError) as caught:
            self.codec.receive(data)
        assert caught.value.code == code
        out = self.codec.take()
        assert goaway_code(out) == code
        return out


# -- the connection's start --


def test_the_server_starts_with_settings_and_raises_the_connection_window() -> None:
    server = Server(max_streams=100)
    kinds = [kind for kind, *_ in frames_of(server.start)]
    assert kinds == [4, 8, 4]  # our SETTINGS, our connection window, the ACK of theirs
    settings = frames_of(server.start)[0][3]
    pairs = [settings[i : i + 6] for i in range(0, len(settings), 6)]
    values = {int.from_bytes(p[:2], "big"): int.from_bytes(p[2:], "big") for p in pairs}
    assert values == {2: 0, 3: 100, 4: WINDOW, 6: 16384}
    assert window_updates(server.start) == [(0, 4 * WINDOW - 65535)]
    assert server.handler.calls == []  # cleared after the preface; it reported ("settings",)


def test_a_client_starts_with_the_preface() -> None:
    codec = Codec(Recorder(), True, WINDOW, 2**31 - 1, 16384)
    codec.start()
    assert codec.take().startswith(PREFACE + b"\x00\x00")


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(b"GET / HTTP/1.1\r\nHost: a\r\n\r\n", id="HTTP/1"),
        pytest.param(b"PRI * HTTP/2.0\r\n\r\nXX\r\n\r\n", id="a preface that is not quite"),
        pytest.param(PREFACE + wire(PingFrame(0, opaque_data=b"12345678")), id="no SETTINGS"),
    ],
)
def test_a_client_that_does_not_speak_http2_is_a_protocol_error(data: bytes) -> None:
    handler = Recorder()
    codec = Codec(handler, False, WINDOW, WINDOW, 16384)
    with pytest.raises(ProtocolError) as caught:
        codec.receive(data)
    assert caught.value.code == ErrorCode.PROTOCOL_ERROR
    assert goaway_code(codec.take()) == ErrorCode.PROTOCOL_ERROR
    codec.receive(PREFACE + wire(SettingsFrame(0)))  # nothing more is read
    assert handler.calls == [] and codec.take() == b""


def test_input_split_at_every_byte_gives_the_same_calls() -> None:
    whole, split = Server(), Server()
    data = whole.headers(1) + wire(DataFrame(1, b"hello", flags=["END_STREAM"]))
    split.enc = PeerEncoder()  # the same HPACK state as `whole`'s
    data_split = split.headers(1) + wire(DataFrame(1, b"hello", flags=["END_STREAM"]))
    whole.feed(data)
    for i in range(len(data_split)):
        split.codec.receive(data_split[i : i + 1])
    assert split.handler.calls == whole.handler.calls
    assert whole.handler.calls == [("head", 1, REQUEST, False), ("data", 1, b"hello", 5, True)]


# -- frames and header blocks --


def test_a_frame_larger_than_advertised_is_a_frame_size_error() -> None:
    server = Server()
    server.feed(server.headers(1))
    server.fails(wire(DataFrame(1, b"x" * 16385)), ErrorCode.FRAME_SIZE_ERROR)


def test_a_header_block_over_continuation_frames_is_decoded() -> None:
    server = Server()
    block = server.enc.encode([*REQUEST, (b"x-long", b"v" * 300)])
    server.feed(
        wire(
            HeadersFrame(1, block[:10]),
            ContinuationFrame(1, block[10:100]),
            ContinuationFrame(1, block[100:], flags=["END_HEADERS"]),
        )
    )
    assert server.handler.calls == [("head", 1, [*REQUEST, (b"x-long", b"v" * 300)], False)]


def test_a_header_block_interrupted_by_another_frame_is_a_protocol_error() -> None:
    server = Server()
    block = server.enc.encode(REQUEST)
    interrupted = wire(HeadersFrame(1, block[:5]), PingFrame(0, opaque_data=b"12345678"))
    server.fails(interrupted, ErrorCode.PROTOCOL_ERROR)


def test_a_continuation_flood_is_a_protocol_error() -> None:
    server = Server()
    block = server.enc.encode(REQUEST)
    flood = wire(HeadersFrame(1, block), *[ContinuationFrame(1, b"")] * (MAX_CONTINUATIONS + 1))
    server.fails(flood, ErrorCode.PROTOCOL_ERROR)
    assert server.handler.calls == []


def test_a_header_list_past_the_advertised_size_is_enhance_your_calm() -> None:
    server = Server()
    block = server.enc.encode([*REQUEST, (b"x-bomb", b"b" * 4000)])
    block += bytes([0x80 | 62]) * 10  # the 4 KB entry referenced again and again
    server.fails(wire(HeadersFrame(1, block, flags=["END_HEADERS"])), ErrorCode.ENHANCE_YOUR_CALM)


def test_an_undecodable_header_block_is_a_compression_error() -> None:
    server = Server()
    garbage = bytes([0x80 | 0x7F, 0xFF, 0xFF, 0xFF, 0x7F])  # an index far past any table
    server.fails(wire(HeadersFrame(1, garbage, flags=["END_HEADERS"])), ErrorCode.COMPRESSION_ERROR)


def test_padding_is_stripped_and_still_counted_by_flow_control() -> None:
    server = Server()
    server.feed(server.headers(1, flags=["END_HEADERS"]))
    server.feed(wire(DataFrame(1, b"abc", flags=["PADDED"], pad_length=10)))
    assert server.handler.calls[-1] == ("data", 1, b"abc", 14, False)  # 1 + 3 + 10


def test_padding_longer_than_its_frame_is_a_protocol_error() -> None:
    server = Server()
    server.feed(server.headers(1, flags=["END_HEADERS"]))
    frame = bytearray(wire(DataFrame(1, b"ab", flags=["PADDED"], pad_length=1)))
    frame[9] = 4  # the pad length byte: 4, of a 4-byte payload
    server.fails(bytes(frame), ErrorCode.PROTOCOL_ERROR)


def test_unknown_frame_types_are_ignored_and_counted() -> None:
    server = Server()
    unknown = b"\x00\x00\x03\xfa\x00\x00\x00\x00\x00abc"
    assert server.feed(unknown) == b""
    assert server.handler.calls == [("control",)]


def test_push_promise_is_a_protocol_error() -> None:
    server = Server()
    server.feed(server.headers(1, flags=["END_HEADERS"]))
    promise = PushPromiseFrame(1, promised_stream_id=2, data=b"", flags=["END_HEADERS"])
    server.fails(wire(promise), ErrorCode.PROTOCOL_ERROR)


# -- stream states --


def test_a_request_with_a_body_and_trailers() -> None:
    server = Server()
    server.feed(
        server.headers(1, flags=["END_HEADERS"])
        + wire(DataFrame(1, b"body"))
        + server.headers(1, [(b"grpc-status", b"0")], flags=["END_HEADERS", "END_STREAM"])
    )
    assert server.handler.calls == [
        ("head", 1, REQUEST, False),
        ("data", 1, b"body", 4, False),
        ("trailers", 1, [(b"grpc-status", b"0")]),
    ]
    assert 1 in server.codec.streams  # half-closed (remote): the response is still to be sent
    server.codec.send_headers(1, RESPONSE, True)
    assert 1 not in server.codec.streams


def test_trailers_that_do_not_end_the_stream_reset_it() -> None:
    server = Server()
    server.feed(server.headers(1, flags=["END_HEADERS"]))
    out = server.feed(server.headers(1, [(b"x-t", b"1")], flags=["END_HEADERS"]))
    assert rst_codes(out) == {1: ErrorCode.PROTOCOL_ERROR}
    assert server.handler.calls[-1] == ("reset", 1, ErrorCode.PROTOCOL_ERROR)


def test_data_after_the_end_of_stream_resets_the_stream() -> None:
    server = Server()
    server.feed(server.headers(1, flags=["END_HEADERS", "END_STREAM"]))
    out = server.feed(wire(DataFrame(1, b"late")))
    assert rst_codes(out) == {1: ErrorCode.STREAM_CLOSED}
    assert server.handler.calls[-1] == ("reset", 1, ErrorCode.STREAM_CLOSED)


def test_data_on_an_idle_stream_is_a_protocol_error() -> None:
    server = Server()
    server.fails(wire(DataFrame(1, b"x")), ErrorCode.PROTOCOL_ERROR)


def test_a_stream_id_going_backwards_is_a_protocol_error() -> None:
    """RFC 9113 §5.1.1: stream 3 was never opened (5 came first): PROTOCOL_ERROR."""
    server = Server()
    server.feed(server.headers(5, flags=["END_HEADERS", "END_STREAM"]))
    server.codec.send_headers(5, RESPONSE, True)  # stream 5 closed both ways
    server.fails(server.headers(3, flags=["END_HEADERS", "END_STREAM"]), ErrorCode.PROTOCOL_ERROR)


def test_headers_on_a_stream_that_closed_is_stream_closed() -> None:
    server = Server()
    server.feed(server.headers(1, flags=["END_HEADERS", "END_STREAM"]))
    server.codec.send_headers(1, RESPONSE, True)  # stream 1 closed both ways
    server.feed(server.headers(3, flags=["END_HEADERS", "END_STREAM"]))
    server.fails(server.headers(1, flags=["END_HEADERS", "END_STREAM"]), ErrorCode.STREAM_CLOSED)


def test_a_stream_that_depends_on_itself_is_reset() -> None:
    """RFC 9113 §5.3.1: a stream error, in HEADERS or PRIORITY; the connection lives."""
    server = Server()
    out = server.feed(
        server.headers(1, flags=["END_HEADERS", "END_STREAM", "PRIORITY"], depends_on=1)
    )
    assert rst_codes(out) == {1: ErrorCode.PROTOCOL_ERROR}
    assert server.handler.calls == [("reset", 1, ErrorCode.PROTOCOL_ERROR)]  # never a head
    out = server.feed(wire(PriorityFrame(3, depends_on=3, stream_weight=16)))
    assert rst_codes(out) == {3: ErrorCode.PROTOCOL_ERROR}
    server.feed(server.headers(5, flags=["END_HEADERS", "END_STREAM", "PRIORITY"], depends_on=1))
    assert server.handler.calls[-1][:2] == ("head", 5)  # the HPACK state followed


def test_an_even_stream_id_from_a_client_is_a_protocol_error() -> None:
    server = Server()
    server.fails(server.headers(2, flags=["END_HEADERS"]), ErrorCode.PROTOCOL_ERROR)


def test_frames_on_a_stream_this_side_reset_are_dropped_and_their_credit_returned() -> None:
    server = Server()
    server.feed(server.headers(1, flags=["END_HEADERS"]))
    assert server.codec.reset_stream(1, ErrorCode.REFUSED_STREAM)
    assert rst_codes(server.codec.take()) == {1: ErrorCode.REFUSED_STREAM}
    assert not server.codec.reset_stream(1, ErrorCode.CANCEL)  # already closed: nothing sent
    server.handler.calls.clear()
    out = b""
    for _ in range(9):  # 9 x 16 KiB: past half the connection window of 256 KiB
        out += server.feed(wire(DataFrame(1, b"x" * 16384)))
    out += server.feed(server.headers(1, [(b"x-t", b"1")], flags=["END_HEADERS", "END_STREAM"]))
    assert set(server.handler.kinds()) == {"control"}
    assert rst_codes(out) == {}  # dropped quietly
    # The connection's credit comes back, once half its window is due.
    assert window_updates(out) == [(0, 8 * 16384)]


def test_rst_stream_from_the_peer_closes_the_stream() -> None:
    server = Server()
    server.feed(server.headers(1, flags=["END_HEADERS"]))
    server.feed(wire(RstStreamFrame(1, error_code=ErrorCode.CANCEL)))
    assert server.handler.calls[-1] == ("reset", 1, ErrorCode.CANCEL)
    with pytest.raises(StreamClosed):
        server.codec.send_headers(1, RESPONSE, False)
    server.fails(wire(RstStreamFrame(7, error_code=0)), ErrorCode.PROTOCOL_ERROR)  # idle


# -- flow control --


def test_data_past_the_stream_window_resets_the_stream() -> None:
    server = Server()
    server.feed(server.headers(1, flags=["END_HEADERS"]))
    out = b""
    for _ in range(4):  # 64 KiB: the stream window is 65,536
        out += server.feed(wire(DataFrame(1, b"x" * 16384)))
    assert rst_codes(out) == {}
    out = server.feed(wire(DataFrame(1, b"x")))
    assert rst_codes(out) == {1: ErrorCode.FLOW_CONTROL_ERROR}


def test_data_past_the_connection_window_is_a_connection_error() -> None:
    server = Server()
    data = b""
    for sid in (1, 3, 5, 7, 9):  # 5 streams x 64 KiB > the 256 KiB connection window
        data += server.headers(sid, flags=["END_HEADERS"])
        data += wire(*[DataFrame(sid, b"x" * 16384)] * 4)
    server.fails(data, ErrorCode.FLOW_CONTROL_ERROR)


def test_credit_goes_back_once_half_a_window_was_passed_on() -> None:
    server = Server()
    server.feed(server.headers(1, flags=["END_HEADERS"]))
    server.feed(wire(*[DataFrame(1, b"x" * 16384)] * 3))
    server.codec.acknowledge(1, 16384)
    assert server.codec.take() == b""  # not yet half the stream window
    server.codec.acknowledge(1, 16384)
    assert window_updates(server.codec.take()) == [(1, 32768)]
    server.feed(wire(*[DataFrame(1, b"x" * 16384)] * 3))  # the window allows it now
    assert rst_codes(server.codec.take()) == {}


def test_sending_follows_the_peers_windows() -> None:
    server = Server()
    server.feed(server.headers(1, flags=["END_HEADERS", "END_STREAM"]))
    server.codec.send_headers(1, RESPONSE, False)
    assert server.codec.window(1) == 65535
    with pytest.raises(ValueError, match="window"):
        server.codec.send_data(1, b"x" * 16385, False)  # past the frame size
    for _ in range(3):
        server.codec.send_data(1, b"x" * 16384, False)
    assert server.codec.window(1) == 65535 - 3 * 16384
    server.feed(wire(WindowUpdateFrame(1, window_increment=1000)))
    assert server.codec.window(1) == 65535 - 3 * 16384  # the connection's is the smaller
    server.feed(wire(WindowUpdateFrame(0, window_increment=100000)))
    assert server.codec.window(1) == 65535 - 3 * 16384 + 1000
    assert ("window", 1) in server.handler.calls and ("window", 0) in server.handler.calls


def test_a_new_initial_window_changes_open_streams() -> None:
    server = Server()
    server.feed(server.headers(1, flags=["END_HEADERS", "END_STREAM"]))
    server.feed(wire(WindowUpdateFrame(0, window_increment=10**6)))
    server.feed(wire(SettingsFrame(0, settings={4: 100})))
    assert server.codec.window(1) == 100
    server.fails(wire(SettingsFrame(0, settings={4: 2**31})), ErrorCode.FLOW_CONTROL_ERROR)


@pytest.mark.parametrize(
    ("frame", "code"),
    [
        pytest.param(WindowUpdateFrame(0, window_increment=0), ErrorCode.PROTOCOL_ERROR, id="0"),
        pytest.param(
            WindowUpdateFrame(0, window_increment=2**31 - 1),
            ErrorCode.FLOW_CONTROL_ERROR,
            id="past 2^31-1",
        ),
        pytest.param(
            WindowUpdateFrame(9, window_increment=1), ErrorCode.PROTOCOL_ERROR, id="idle stream"
        ),
    ],
)
def test_bad_window_updates_are_connection_errors(frame: Frame, code: ErrorCode) -> None:
    Server().fails(wire(frame), code)


def test_windows_refused_past_2_31_minus_1_are_left_as_they_were() -> None:
    """A window the peer tries to push too far is never applied, even on the way to the
    connection error: nothing reads a window past 2^31-1 afterwards."""
    server = Server()
    server.feed(server.headers(1, flags=["END_HEADERS", "END_STREAM"]))
    server.feed(wire(WindowUpdateFrame(1, window_increment=2**31 - 1 - 65535)))
    server.fails(wire(SettingsFrame(0, settings={4: 65536})), ErrorCode.FLOW_CONTROL_ERROR)
    assert server.codec.streams[1].send_window == 2**31 - 1
    assert server.codec.peer_initial == 65535
    server = Server()
    server.fails(wire(WindowUpdateFrame(0, window_increment=2**31 - 1)),
                 ErrorCode.FLOW_CONTROL_ERROR)  # fmt: skip
    assert server.codec.send_window == 65535


def test_a_window_update_of_zero_on_a_stream_resets_it() -> None:
    server = Server()
    server.feed(server.headers(1, flags=["END_HEADERS"]))
    out = server.feed(wire(WindowUpdateFrame(1, window_increment=0)))
    assert rst_codes(out) == {1: ErrorCode.PROTOCOL_ERROR}


# -- SETTINGS, PING, GOAWAY --


@pytest.mark.parametrize(
    ("data", "code"),
    [
        pytest.param(
            wire(SettingsFrame(0, settings={5: 100})),
            ErrorCode.PROTOCOL_ERROR,
            id="a frame size below 16384",
        ),
        pytest.param(
            wire(SettingsFrame(0, settings={2: 2})), ErrorCode.PROTOCOL_ERROR, id="ENABLE_PUSH 2"
        ),
        pytest.param(
            b"\x00\x00\x06\x04\x01\x00\x00\x00\x00" + b"\x00" * 6,
            ErrorCode.FRAME_SIZE_ERROR,
            id="an ACK with a payload",
        ),
        pytest.param(
            b"\x00\x00\x05\x04\x00\x00\x00\x00\x00" + b"\x00" * 5,
            ErrorCode.FRAME_SIZE_ERROR,
            id="not a multiple of 6",
        ),
        pytest.param(
            b"\x00\x00\x00\x04\x00\x00\x00\x00\x01", ErrorCode.PROTOCOL_ERROR, id="on a stream"
        ),
    ],
)
def test_bad_settings_are_connection_errors(data: bytes, code: ErrorCode) -> None:
    Server().fails(data, code)


def test_settings_are_acknowledged_and_the_peers_frame_size_used() -> None:
    server = Server()
    out = server.feed(wire(SettingsFrame(0, settings={5: 20000, 3: 7})))
    assert frames_of(out) == [(4, 1, 0, b"")]
    assert (server.codec.peer_max_frame, server.codec.peer_max_streams) == (20000, 7)
    assert server.handler.calls == [("settings",)]


def test_a_ping_is_answered_with_its_payload() -> None:
    server = Server()
    out = server.feed(wire(PingFrame(0, opaque_data=b"abcdefgh")))
    assert frames_of(out) == [(6, 1, 0, b"abcdefgh")]
    assert server.handler.calls == [("control",)]
    assert server.feed(wire(PingFrame(0, opaque_data=b"abcdefgh", flags=["ACK"]))) == b""
    server.fails(b"\x00\x00\x04\x06\x00\x00\x00\x00\x00abcd", ErrorCode.FRAME_SIZE_ERROR)


def test_a_goaway_reaches_the_handler() -> None:
    server = Server()
    server.feed(wire(GoAwayFrame(0, last_stream_id=7, error_code=0, additional_data=b"bye")))
    assert server.handler.calls == [("goaway", 0, 7, b"bye")]


# -- the client side --


class Client:
    """A client-side codec with its server's preface already read."""

    def __init__(self) -> None:
        self.handler = Recorder()
        self.codec = Codec(self.handler, True, WINDOW, 2**31 - 1, 16384)
        self.codec.start()
        self.codec.receive(wire(SettingsFrame(0)))
        self.codec.take()
        self.handler.calls.clear()
        self.enc = PeerEncoder()

    def headers(self, sid: int, fields: list[tuple[bytes, bytes]], **kw: Any) -> bytes:
        return HeadersFrame(sid, self.enc.encode(fields), **kw).serialize()


def test_a_client_opens_odd_streams_in_order() -> None:
    client = Client()
    first = client.codec.next_stream_id()
    client.codec.send_headers(first, REQUEST, True)
    second = client.codec.next_stream_id()
    assert (first, second) == (1, 3)
    with pytest.raises(StreamClosed):
        client.codec.send_headers(7, REQUEST, True)  # not the next id
    client.codec.next_sid = 2**31 + 1
    with pytest.raises(NoStreamIds):
        client.codec.next_stream_id()


def test_a_response_informational_head_final_head_body_trailers() -> None:
    client = Client()
    sid = client.codec.next_stream_id()
    client.codec.send_headers(sid, REQUEST, True)
    client.codec.receive(
        client.headers(sid, [(b":status", b"100")], flags=["END_HEADERS"])
        + client.headers(sid, RESPONSE, flags=["END_HEADERS"])
        + wire(DataFrame(sid, b"ok"))
        + client.headers(sid, [(b"grpc-status", b"0")], flags=["END_HEADERS", "END_STREAM"])
    )
    assert client.handler.calls == [
        ("informational", sid, [(b":status", b"100")]),
        ("head", sid, RESPONSE, False),
        ("data", sid, b"ok", 2, False),
        ("trailers", sid, [(b"grpc-status", b"0")]),
    ]
    assert sid not in client.codec.streams  # closed both ways


def test_data_before_the_response_head_resets_the_stream() -> None:
    client = Client()
    sid = client.codec.next_stream_id()
    client.codec.send_headers(sid, REQUEST, True)
    client.codec.receive(wire(DataFrame(sid, b"early")))
    assert rst_codes(client.codec.take()) == {sid: ErrorCode.PROTOCOL_ERROR}
    assert client.handler.calls == [("reset", sid, ErrorCode.PROTOCOL_ERROR)]


def test_a_server_may_not_turn_push_on_or_open_streams() -> None:
    with pytest.raises(ProtocolError):
        Client().codec.receive(wire(SettingsFrame(0, settings={2: 1})))
    client = Client()
    with pytest.raises(ProtocolError):
        client.codec.receive(client.headers(2, RESPONSE, flags=["END_HEADERS"]))


def test_a_header_block_larger_than_a_frame_goes_out_in_continuations() -> None:
    """...and the `h2` library, as the peer, reads it back."""
    client = Client()
    big = [*REQUEST, (b"x-big", b"v" * 40000)]
    sid = client.codec.next_stream_id()
    client.codec.send_headers(sid, big, True)
    out = client.codec.take()
    assert [kind for kind, *_ in frames_of(out)] == [1, 9, 9]
    peer = H2Connection(H2Configuration(client_side=False, header_encoding=None,
                                        validate_inbound_headers=False))  # fmt: skip
    peer.local_settings.max_header_list_size = 10**6
    peer.initiate_connection()
    client.codec.start()  # a fresh preface for the peer: ours went out before
    events = peer.receive_data(client.codec.take() + out)
    heads = [e for e in events if type(e).__name__ == "RequestReceived"]
    assert [list(h.headers) for h in heads] == [big]


# -- the two sides together, and with `h2` --


def test_our_client_and_our_server_relay_an_exchange() -> None:
    server_handler, client_handler = Recorder(), Recorder()
    server = Codec(server_handler, False, WINDOW, WINDOW, 16384)
    client = Codec(client_handler, True, WINDOW, WINDOW, 16384)
    server.start()
    client.start()
    sid = client.next_stream_id()
    client.send_headers(sid, REQUEST, False)
    client.send_data(sid, b"hello", True)
    server.receive(client.take())
    client.receive(server.take())
    assert server_handler.calls[-2:] == [
        ("head", 1, REQUEST, False),
        ("data", 1, b"hello", 5, True),
    ]
    server.send_headers(1, RESPONSE, False)
    server.send_data(1, b"world", False)
    server.send_headers(1, [(b"x-trailer", b"t")], True)
    client.receive(server.take())
    assert client_handler.calls[-3:] == [
        ("head", 1, RESPONSE, False),
        ("data", 1, b"world", 5, False),
        ("trailers", 1, [(b"x-trailer", b"t")]),
    ]
    assert not server.streams and not client.streams


def test_an_h2_library_client_gets_its_response() -> None:
    peer = H2Connection(H2Configuration(client_side=True, header_encoding=None))
    peer.initiate_connection()
    handler = Recorder()
    server = Codec(handler, False, WINDOW, WINDOW, 16384)
    server.start()
    peer.send_headers(1, REQUEST, end_stream=True)
    server.receive(peer.data_to_send())
    assert handler.calls[-1] == ("head", 1, REQUEST, True)
    server.send_headers(1, RESPONSE, False)
    server.send_data(1, b"done", False)
    server.send_headers(1, [(b"grpc-status", b"0")], True)
    events = peer.receive_data(server.take())
    kinds = [type(e) for e in events]
    assert ResponseReceived in kinds and DataReceived in kinds
    assert TrailersReceived in kinds and StreamEnded in kinds


def test_initial_windows_in_one_frame_are_applied_once_and_checked_each() -> None:
    server = Server()
    for sid in (1, 3):
        server.feed(server.headers(sid, flags=["END_HEADERS", "END_STREAM"]))
    server.feed(wire(WindowUpdateFrame(0, window_increment=10**6)))
    server.feed(wire(SettingsFrame(0, settings={4: 10})) + wire(SettingsFrame(0)))
    # 70,000 then 100 in one frame: the last one counts
    payload = struct.pack(">HLHL", 4, 70_000, 4, 100)
    server.feed(frame(SETTINGS, 0, 0, payload))
    streams = server.codec.streams
    assert streams[1].send_window == streams[3].send_window == 100
    server.feed(wire(WindowUpdateFrame(1, window_increment=2**31 - 1 - 100)))
    # one value in the frame would take stream 1 past 2^31-1, even if the last one would not
    payload = struct.pack(">HLHL", 4, 101, 4, 100)
    server.fails(frame(SETTINGS, 0, 0, payload), ErrorCode.FLOW_CONTROL_ERROR)
    assert streams[1].send_window == 2**31 - 1 and server.codec.peer_initial == 100


def test_a_settings_frame_full_of_initial_windows_costs_one_pass_over_the_streams() -> None:
    """2,730 entries in a 16 KiB SETTINGS frame with 100 streams open: once per entry that
    was 273,000 window updates (~20 ms) per frame, 1,000 frames per 10 s within the flood
    guard's budget: a client kept the proxy's loop busy with 1.6 MB/s."""
    server = Server()
    for i in range(100):
        server.feed(server.headers(2 * i + 1, flags=["END_HEADERS", "END_STREAM"]))
    entries = b"".join(struct.pack(">HL", 4, 65535 + i % 2) for i in range(16384 // 6))
    flood = frame(SETTINGS, 0, 0, entries) * 50
    started = time.process_time()
    server.feed(flood)
    assert time.process_time() - started < 0.3  # was over 1 s
    assert server.codec.streams[1].send_window == 65535 + (16384 // 6 - 1) % 2
