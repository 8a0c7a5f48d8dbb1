"""The HTTP/2 codec under a hostile peer: random well-framed and malformed frames, split at random
byte boundaries, fed to both sides; and valid request sequences from `h2` checked against what
`h2` itself makes of them."""

from __future__ import annotations

import struct
from itertools import pairwise
from typing import Any

import h2.exceptions
from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.events import (
    DataReceived,
    RequestReceived,
    StreamEnded,
    StreamReset,
    TrailersReceived,
)
from h2.settings import SettingCodes
from hpack import Encoder as PeerEncoder
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshlet.proxy.http.h2codec import (
    MAX_CONTINUATIONS,
    MAX_WINDOW,
    MIN_FRAME_SIZE,
    PREFACE,
    RESET_MEMORY,
    Codec,
    ErrorCode,
    ProtocolError,
)
from meshlet_testing.h2handler import RecordingHandler

WINDOW = 65536
FUZZ_STREAM_WINDOW = 16384  # small: a peer overruns it within a few frames
FUZZ_CONN_WINDOW = 65536
MAX_HEADER_BYTES = 16384
BUF_BOUND = MIN_FRAME_SIZE + 9 + 24
BLOCK_BOUND = (MAX_CONTINUATIONS + 1) * MIN_FRAME_SIZE
FUZZ = settings(
    max_examples=200,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
REQUEST = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", b"/"),
           (b":authority", b"web:80")]  # fmt: skip


class Acting(RecordingHandler):
    """The codec's handler: records every call and acts on some as the engine does (credits
    body bytes back, except on streams 5 and 13, whose bytes it holds until they are reset;
    answers or refuses streams by their id), so that the same calls mean the same output
    whatever the split."""

    def __init__(self) -> None:
        super().__init__()
        self.codec: Codec | None = None
        self.held: dict[int, int] = {}  # bytes passed on and not acknowledged, by stream

    def on_head(self, sid: int, headers: Any, end: bool) -> None:
        super().on_head(sid, headers, end)
        codec = self.codec
        assert codec is not None
        if codec.client_side:
            return
        if sid % 4 == 3:
            codec.reset_stream(sid, ErrorCode.REFUSED_STREAM)
        else:
            codec.send_headers(sid, [(b":status", b"200")], False)

    def on_data(self, sid: int, data: bytes, flow_len: int, end: bool) -> None:
        assert flow_len >= len(data), (flow_len, len(data))
        super().on_data(sid, data, flow_len, end)
        assert self.codec is not None
        if sid % 8 == 5:
            self.held[sid] = self.held.get(sid, 0) + flow_len
        else:
            self.codec.acknowledge(sid, flow_len)

    def on_reset(self, sid: int, code: int) -> None:
        super().on_reset(sid, code)
        assert self.codec is not None
        self.codec.acknowledge(sid, self.held.pop(sid, 0))


def codec_for(client_side: bool) -> tuple[Codec, Acting]:
    handler = Acting()
    codec = Codec(handler, client_side, FUZZ_STREAM_WINDOW, FUZZ_CONN_WINDOW, MAX_HEADER_BYTES,
                  max_streams=100)  # fmt: skip
    handler.codec = codec
    codec.start()
    if client_side:  # streams the peer (a server) can answer
        for _ in range(7):
            codec.send_headers(codec.next_stream_id(), REQUEST, False)
    codec.take()
    return codec, handler


def check_bounds(codec: Codec) -> None:
    """What stays bounded whatever the peer sends, even once the connection failed."""
    assert len(codec._buf) <= BUF_BOUND
    assert sum(map(len, codec._block)) <= BLOCK_BOUND
    assert codec._continuations <= MAX_CONTINUATIONS + 1
    assert len(codec.reset_ids) <= RESET_MEMORY
    assert codec.send_window <= MAX_WINDOW
    assert codec.recv_window <= MAX_WINDOW
    assert codec.peer_initial <= MAX_WINDOW
    for stream in codec.streams.values():
        assert stream.send_window <= MAX_WINDOW
        assert stream.recv_window <= MAX_WINDOW


def check_credit(codec: Codec, held: dict[int, int]) -> None:
    """Every byte received is either held by the handler or credited back, dropped ones
    included: nothing leaks from the windows."""
    assert codec.recv_window + codec.conn_unacked + sum(held.values()) == codec.conn_window
    for sid, stream in codec.streams.items():
        if stream.recv_open:
            assert stream.recv_window + stream.unacked + held.get(sid, 0) == codec.local_initial


def feed(client_side: bool, data: bytes, cuts: list[int]) -> tuple[list[Any], int | None, bytes]:
    """Feeds `data` in pieces cut at `cuts`: the handler's calls, the connection error's code
    (None: none), everything written."""
    codec, handler = codec_for(client_side)
    out = bytearray()
    error: int | None = None
    bounds = sorted({0, *cuts, len(data)})
    for start, end in pairwise(bounds):
        try:
            codec.receive(data[start:end])
        except ProtocolError as exc:
            error = exc.code
            out += codec.take()
            assert frame_kinds(bytes(out))[-1] == 0x7  # the output ends with the GOAWAY
            assert codec.dead
            check_bounds(codec)
            calls = len(handler.calls)
            codec.receive(data[end:] + b"\x00" * 9)  # ignored from now on
            assert len(handler.calls) == calls and codec.take() == b""
            break
        check_bounds(codec)
        check_credit(codec, handler.held)
        out += codec.take()
    return handler.calls, error, bytes(out)


# -- frames --

_ODD_SIDS = st.sampled_from([1, 3, 5, 7, 9, 13])
_ANY_SIDS = st.sampled_from([0, 1, 2, 3, 4, 5, 7, 9, 11, 2**31 - 1, 0x80000001])
_VALUES = st.sampled_from(
    [0, 1, 2, 100, 16383, 16384, 65535, 65536, 2**24 - 1, 2**24, 2**31 - 1, 2**31, 2**32 - 1]
)
_REQUESTS = [
    REQUEST,
    [(b":method", b"GET"), (b":path", b"/x"), (b":scheme", b"https"), (b":authority", b"a")],
    [*REQUEST, (b"x-big", b"v" * 3000)],
]
_RESPONSES = [
    [(b":status", b"200"), (b"content-type", b"text/plain")],
    [(b":status", b"100")],
    [(b":status", b"103"), (b"link", b"</a>")],
    [(b":status", b"101")],
    [(b"x-no-status", b"1")],
]
_TRAILERS = [[(b"grpc-status", b"0")], [(b"x-sum", b"v" * 3000)], []]


def frame_kinds(data: bytes) -> list[int]:
    """The type of each frame in `data`."""
    kinds, pos = [], 0
    while pos < len(data):
        kinds.append(data[pos + 3])
        pos += 9 + int.from_bytes(data[pos : pos + 3], "big")
    return kinds


def _head(n: int, kind: int, flags: int, sid: int) -> bytes:
    return struct.pack(">HBBBL", n >> 8, n & 0xFF, kind, flags, sid)


def _frame(kind: int, flags: int, sid: int, payload: bytes) -> bytes:
    return _head(len(payload), kind, flags, sid) + payload


def _pad(draw: st.DrawFn, flags: int, payload: bytes) -> tuple[int, bytes]:
    if draw(st.integers(0, 3)) != 0:
        return flags, payload
    pad = draw(st.sampled_from([0, 1, 30, 255]))
    return flags | 0x8, bytes([pad]) + payload + b"\x00" * pad


class Peer:
    """What the generated peer has done so far: its HPACK encoder, the streams it opened."""

    def __init__(self, client_side: bool) -> None:
        self.encoder = PeerEncoder()
        self.client_side = client_side
        self.opened = [1, 3, 5, 7, 9, 11, 13] if client_side else []
        self.next_sid = 1

    def sid(self, draw: st.DrawFn) -> int:
        if self.opened and draw(st.integers(0, 7)):
            return draw(st.sampled_from(self.opened))
        return draw(_ODD_SIDS)


@st.composite
def header_frames(draw: st.DrawFn, peer: Peer) -> bytes:
    """A header block (a head or trailers), maybe in CONTINUATIONs, maybe with padding and a
    priority, maybe left open."""
    encoder = peer.encoder
    if not peer.client_side and draw(st.booleans()):  # a new stream
        sid = peer.next_sid
        peer.next_sid += 2
        peer.opened.append(sid)
        fields = draw(st.sampled_from(_REQUESTS))
    else:
        sid = peer.sid(draw)
        fields = draw(st.sampled_from([*_RESPONSES, *_TRAILERS]))
    block = encoder.encode(fields)
    flags = draw(st.sampled_from([0, 0x1]))
    pieces = draw(st.integers(1, MAX_CONTINUATIONS + 2))
    size = -(-len(block) // pieces) or 1
    chunks = [block[at : at + size] for at in range(0, len(block), size)] or [b""]
    first = chunks[0]
    if draw(st.booleans()):
        flags |= 0x20
        first = struct.pack(">LB", draw(st.sampled_from([0, 1, sid])), 16) + first
    flags, first = _pad(draw, flags, first)
    if len(chunks) == 1:
        flags |= 0x4
    out = [_frame(0x1, flags, sid, first)]
    for i, chunk in enumerate(chunks[1:], start=2):
        out.append(_frame(0x9, 0x4 if i == len(chunks) else 0, sid, chunk))
    if draw(st.integers(0, 9)) == 0:
        out.pop()  # the block is never finished
    return b"".join(out)


@st.composite
def frame_bytes(draw: st.DrawFn, peer: Peer) -> bytes:
    """One frame (or a header block), well formed in itself; what it means in the connection's
    state (which stream, which window) is left to chance."""
    kind = draw(st.sampled_from([0, 0, 0, 0, 1, 1, 1, 1, 2, 3, 4, 4, 6, 7, 8, 8, 0xFF]))
    if kind == 0xFF:  # rarer: frames no peer should send, or unknown ones
        kind = draw(st.sampled_from([5, 9, 0xA, 0xFF]))
    if not peer.opened and kind in (0, 3, 8) and draw(st.integers(0, 7)):
        kind = 0x1  # a stream to act on first
    sid = peer.sid(draw)
    encoder = peer.encoder
    if kind in (2, 3, 6, 7, 8) and draw(st.integers(0, 9)) == 0:  # a fixed size not kept
        payload = draw(st.binary(max_size=12))
        return _frame(kind, 0, draw(st.sampled_from([0, sid])), payload)
    if kind == 0x1:
        return draw(header_frames(peer))
    if kind == 0x0:
        if 5 in peer.opened and draw(st.integers(0, 2)) == 0:
            sid = 5  # a stream whose bytes the handler holds: its window runs out
        size = draw(st.sampled_from([0, 1, 100, 8000, 16384, 16384]))
        flags, payload = _pad(draw, draw(st.sampled_from([0, 1])), b"d" * size)
        if len(payload) > MIN_FRAME_SIZE:
            flags, payload = flags & ~0x8, payload[1 : 1 + MIN_FRAME_SIZE]
        return _frame(0x0, flags, sid, payload)
    if kind == 0x4:
        if draw(st.integers(0, 4)) == 0:
            return _frame(0x4, 0x1, 0, b"")
        pairs = draw(st.lists(st.tuples(st.integers(0, 8), _VALUES), max_size=4))
        return _frame(0x4, 0, 0, b"".join(struct.pack(">HL", k, v) for k, v in pairs))
    if kind == 0x8:
        increment = draw(st.one_of(st.integers(1, 1 << 17), _VALUES))
        return _frame(0x8, 0, draw(st.sampled_from([0, sid])), struct.pack(">L", increment))
    if kind == 0x3:
        return _frame(0x3, 0, sid, struct.pack(">L", draw(st.integers(0, 14))))
    if kind == 0x2:
        return _frame(0x2, 0, sid, struct.pack(">LB", draw(st.sampled_from([0, 1, sid])), 16))
    if kind == 0x6:
        return _frame(0x6, draw(st.sampled_from([0, 1])), 0, b"12345678")
    if kind == 0x7:
        return _frame(0x7, 0, 0, struct.pack(">LL", sid, draw(st.integers(0, 14))) + b"bye")
    if kind == 0x5:
        return _frame(0x5, 0x4, sid, struct.pack(">L", 2) + encoder.encode(REQUEST))
    if kind == 0x9:  # a CONTINUATION out of place
        return _frame(0x9, 0x4, sid, encoder.encode(REQUEST))
    return _frame(kind, draw(st.integers(0, 255)), sid, draw(st.binary(max_size=24)))


@st.composite
def mutated(draw: st.DrawFn, frame: bytes) -> bytes:
    """`frame` with its header or payload broken: the length, the flags, the stream id, a
    payload byte."""
    how = draw(st.sampled_from(["length", "flags", "sid", "byte", "cut"]))
    out = bytearray(frame)
    if len(out) < 9:
        return frame
    if how == "length":
        length = draw(st.sampled_from([0, 1, 3, 4, 5, 7, 8, 9, 16385, 2**24 - 1]))
        out[0:3] = length.to_bytes(3, "big")
    elif how == "flags":
        out[4] = draw(st.integers(0, 255))
    elif how == "sid":
        out[5:9] = draw(_ANY_SIDS).to_bytes(4, "big")
    elif how == "byte" and len(out) > 9:
        at = draw(st.integers(9, len(out) - 1))
        out[at] = draw(st.integers(0, 255))
    elif how == "cut":
        out = out[: draw(st.integers(0, len(out)))]
    return bytes(out)


@st.composite
def peer_bytes(draw: st.DrawFn, client_side: bool) -> bytes:
    """What a hostile peer sends: usually a valid start, frames well formed in themselves, a
    few of them broken, maybe cut short."""
    peer = Peer(client_side)
    start = b"" if client_side else PREFACE
    if draw(st.integers(0, 19)) == 0:
        start = draw(st.binary(max_size=30))
    elif draw(st.integers(0, 19)) > 0:
        start += _head(0, 0x4, 0, 0)
    frames = []
    for _ in range(draw(st.integers(0, 30))):
        frame = draw(frame_bytes(peer))
        if draw(st.integers(0, 15)) == 0:
            frame = draw(mutated(frame))
        frames.append(frame)
    data = start + b"".join(frames)
    if draw(st.integers(0, 3)) == 0:
        data = data[: draw(st.integers(0, len(data)))]
    return data


def frame_cuts(client_side: bool, data: bytes) -> list[int]:
    """Where each frame of `data` ends (fed so, the checks run after every frame)."""
    pos = 0 if client_side else len(PREFACE)
    cuts = [pos]
    while pos + 9 <= len(data):
        pos += 9 + int.from_bytes(data[pos : pos + 3], "big")
        cuts.append(min(pos, len(data)))
    return cuts


def _check_splits(client_side: bool, data: bytes, cuts: list[int]) -> None:
    whole = feed(client_side, data, [])
    split = feed(client_side, data, cuts)
    assert feed(client_side, data, frame_cuts(client_side, data)) == whole
    bytewise = feed(client_side, data, list(range(len(data)))) if len(data) < 200 else split
    assert split == whole
    assert bytewise == whole


@FUZZ
@given(st.data())
def test_a_server_codec_survives_any_frames(data: st.DataObject) -> None:
    raw = data.draw(peer_bytes(client_side=False))
    cuts = data.draw(st.lists(st.integers(0, len(raw)), max_size=8))
    _check_splits(False, raw, cuts)


@FUZZ
@given(st.data())
def test_a_client_codec_survives_any_frames(data: st.DataObject) -> None:
    raw = data.draw(peer_bytes(client_side=True))
    cuts = data.draw(st.lists(st.integers(0, len(raw)), max_size=8))
    _check_splits(True, raw, cuts)


def test_reset_memory_stays_bounded_under_thousands_of_refused_streams() -> None:
    codec, handler = codec_for(False)
    encoder = PeerEncoder()
    data = bytearray(PREFACE + _head(0, 0x4, 0, 0))
    for i in range(3 * RESET_MEMORY):
        sid = 4 * i + 3  # refused by the handler
        block = encoder.encode(REQUEST)
        data += _head(len(block), 0x1, 0x4, sid) + block
    codec.receive(bytes(data))
    assert len(codec.reset_ids) == RESET_MEMORY
    assert not codec.streams
    newest = 4 * (3 * RESET_MEMORY - 1) + 3
    codec.receive(_head(5, 0x0, 0x1, newest) + b"late!")  # still remembered: dropped
    assert handler.calls[-1] == ("control",)


# -- differential: valid requests, the codec against h2 --

_OPS = st.sampled_from(
    [
        "open",
        "open",
        "open_end",
        "data",
        "data",
        "data_end",
        "trailers",
        "reset",
        "window",
        "ping",
        "settings",
        "big_head",
    ]
)


def h2_calls(data: bytes) -> list[tuple[Any, ...]]:
    """What `h2` as a server makes of `data`, in the codec's handler terms."""
    server = H2Connection(
        H2Configuration(
            client_side=False,
            header_encoding=None,
            validate_inbound_headers=False,
            normalize_inbound_headers=False,
        )
    )
    server.local_settings.initial_window_size = WINDOW
    server.local_settings.acknowledge()
    calls: list[tuple[Any, ...]] = []
    ends: set[int] = set()
    for event in server.receive_data(data):
        if isinstance(event, RequestReceived):
            calls.append(("head", event.stream_id, list(event.headers),
                          event.stream_ended is not None))  # fmt: skip
        elif isinstance(event, DataReceived):
            calls.append(("data", event.stream_id, event.data, event.flow_controlled_length,
                          event.stream_ended is not None))  # fmt: skip
        elif isinstance(event, TrailersReceived):
            calls.append(("trailers", event.stream_id, list(event.headers)))
        elif isinstance(event, StreamReset):
            calls.append(("reset", event.stream_id, event.error_code))
        elif isinstance(event, StreamEnded):
            ends.add(event.stream_id)
    return calls


class Recording(Acting):
    """A handler that only records (h2 does not answer either)."""

    def on_head(self, sid: int, headers: Any, end: bool) -> None:
        self.calls.append(("head", sid, list(headers), end))

    def on_data(self, sid: int, data: bytes, flow_len: int, end: bool) -> None:
        self.calls.append(("data", sid, data, flow_len, end))

    def on_reset(self, sid: int, code: int) -> None:
        self.calls.append(("reset", sid, code))


def codec_calls(data: bytes, cuts: list[int]) -> list[tuple[Any, ...]]:
    handler = Recording()
    codec = Codec(handler, False, WINDOW, 4 * WINDOW, 1 << 16)
    codec.start()
    bounds = sorted({0, *cuts, len(data)})
    for start, end in pairwise(bounds):
        codec.receive(data[start:end])
    kept = ("head", "data", "trailers", "reset")
    return [call for call in handler.calls if call[0] in kept]


@st.composite
def h2_client_bytes(draw: st.DrawFn) -> bytes:
    client = H2Connection(H2Configuration(client_side=True, header_encoding=None))
    client.initiate_connection()
    opened: list[int] = []
    for op in draw(st.lists(_OPS, max_size=30)):
        sid = draw(st.sampled_from(opened)) if opened else 0
        try:
            if op in ("open", "open_end", "big_head"):
                sid = client.get_next_available_stream_id()
                extra = [(b"x-big", b"b" * draw(st.sampled_from([20000, 40000])))] * (
                    op == "big_head"
                )
                client.send_headers(sid, [*REQUEST, *extra], end_stream=op == "open_end")
                opened.append(sid)
            elif op in ("data", "data_end") and sid:
                window = min(client.local_flow_control_window(sid), 16384)
                size = draw(st.integers(0, max(0, window)))
                pad = draw(st.sampled_from([None, 0, 9]))
                if pad is not None and size + pad + 1 > window:
                    pad = None
                client.send_data(sid, b"x" * size, end_stream=op == "data_end",
                                 pad_length=pad)  # fmt: skip
            elif op == "trailers" and sid:
                client.send_headers(sid, [(b"x-sum", b"1")], end_stream=True)
            elif op == "reset" and sid:
                client.reset_stream(sid, draw(st.sampled_from([0, 2, 8])))
            elif op == "window" and sid:
                client.increment_flow_control_window(draw(st.integers(1, 1 << 20)), sid)
            elif op == "ping":
                client.ping(b"12345678")
            elif op == "settings":
                client.update_settings(
                    {SettingCodes.INITIAL_WINDOW_SIZE: draw(st.integers(0, 1 << 20))}
                )
        except (h2.exceptions.ProtocolError, KeyError):
            continue  # not allowed in the stream's state: a well-behaved client does not send it
    return client.data_to_send()


@settings(max_examples=150, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])  # fmt: skip
@given(st.data())
def test_the_codec_reads_valid_requests_as_h2_does(data: st.DataObject) -> None:
    raw = data.draw(h2_client_bytes())
    cuts = data.draw(st.lists(st.integers(0, len(raw)), max_size=6))
    assert codec_calls(raw, cuts) == h2_calls(raw)


def test_data_past_a_stream_window_is_credited_back_to_the_connection() -> None:
    """The frame that overruns a stream's window resets the stream; its bytes still count
    against the connection window and must come back, or each such frame leaks credit."""
    encoder = PeerEncoder()
    block = encoder.encode(REQUEST)
    data = PREFACE + _head(0, 0x4, 0, 0)
    data += b"".join(_frame(0x1, 0x4, sid, block) for sid in (1, 3, 5))
    data += _frame(0x0, 0, 5, b"d" * FUZZ_STREAM_WINDOW) + _frame(0x0, 0, 5, b"d" * 100)
    calls, error, _ = feed(False, data, frame_cuts(False, data))
    assert error is None
    assert calls[-1] == ("reset", 5, ErrorCode.FLOW_CONTROL_ERROR)
