"""Which HTTP/2 codec should the proxy's engine be built on? A micro-benchmark of the codec work of
relaying one request and its response through a proxy's server side and client side, in µs.

    python -m bench.h2spike [--requests N] [--repeat R] [--mypyc]

Per relayed exchange, each candidate does what the engine does with its codec:

    server side  receives the client's request (HEADERS, for gRPC also DATA)
    client side  sends it upstream on a new stream
    client side  receives the response (HEADERS, DATA, for gRPC trailers) and gives the
                 flow-control credit back (WINDOW_UPDATE)
    server side  sends the response to the client

The peers' bytes are made in advance by an independent encoder (`hyperframe` and `hpack`), so
only the proxy's two sides are timed; HPACK tables stay warm across exchanges, as on a real
connection. Candidates:

    h2lib     the `h2` library, as the engine uses it today (with the project's own HPACK)
    own       a lean sans-IO codec written for a proxy (the prototype below)
    engine    the codec the engine was then built on (meshlet.proxy.http.h2codec), every check in
    own-mypyc the same module compiled with mypyc (`--mypyc`: needs a C compiler and the
              Python headers; the HPACK codec it calls stays pure Python)
    nghttp2   libnghttp2 (the C library under curl and nginx) through cffi, ABI mode

Every candidate's output is decoded back by the independent decoder and checked, so a fast
candidate cannot be a wrong one.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Protocol

import hpack
from hyperframe.frame import (
    DataFrame,
    Frame,
    HeadersFrame,
    SettingsFrame,
    WindowUpdateFrame,
)

PREFACE: Final = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
BODY: Final = b"x" * 100
GRPC_MESSAGE: Final = b"\x00\x00\x00\x00\x0a" + b"m" * 10
REQUEST: Final = [
    (b":method", b"GET"), (b":scheme", b"http"),
    (b":authority", b"web.emojivoto.svc.cluster.local:80"), (b":path", b"/api/list"),
    (b"user-agent", b"bench/1.0"), (b"accept", b"*/*"),
]  # fmt: skip
GRPC_REQUEST: Final = [
    (b":method", b"POST"), (b":scheme", b"http"),
    (b":authority", b"emoji.emojivoto.svc.cluster.local:8080"),
    (b":path", b"/emojivoto.v1.EmojiService/ListAll"), (b"content-type", b"application/grpc"),
    (b"te", b"trailers"), (b"grpc-timeout", b"1S"), (b"user-agent", b"grpc-python/1.7"),
]  # fmt: skip
RESPONSE: Final = [
    (b":status", b"200"), (b"content-type", b"application/json"),
    (b"content-length", b"100"), (b"server", b"bench"),
]  # fmt: skip
GRPC_RESPONSE: Final = [(b":status", b"200"), (b"content-type", b"application/grpc")]
GRPC_TRAILERS: Final = [(b"grpc-status", b"0"), (b"grpc-message", b"")]


@dataclass(frozen=True)
class Shape:
    name: str
    request: list[tuple[bytes, bytes]]
    request_body: bytes  # b"": the request ends with its headers
    response: list[tuple[bytes, bytes]]
    response_body: bytes
    trailers: list[tuple[bytes, bytes]]  # []: the response ends with its body


SHAPES: Final = (
    Shape("http", REQUEST, b"", RESPONSE, BODY, []),
    Shape("grpc", GRPC_REQUEST, GRPC_MESSAGE, GRPC_RESPONSE, GRPC_MESSAGE, GRPC_TRAILERS),
)


# -- the peers: bytes made in advance --------------------------------------------------------


def _frames(*frames: Frame) -> bytes:
    return b"".join(f.serialize() for f in frames)


def client_bytes(shape: Shape, n: int) -> tuple[bytes, list[bytes]]:
    """The client's preface, then one chunk per exchange (stream 1, 3, 5, ...)."""
    enc = hpack.Encoder()
    window = WindowUpdateFrame(0, window_increment=2**31 - 1 - 65535)
    start = PREFACE + _frames(SettingsFrame(0), SettingsFrame(0, flags=["ACK"]), window)
    chunks = []
    for i in range(n):
        sid = 2 * i + 1
        end = [] if shape.request_body else ["END_STREAM"]
        frames: list[Frame] = [
            HeadersFrame(sid, enc.encode(shape.request), flags=["END_HEADERS", *end])
        ]
        if shape.request_body:
            frames.append(DataFrame(sid, shape.request_body, flags=["END_STREAM"]))
        chunks.append(_frames(*frames))
    return start, chunks


def upstream_bytes(shape: Shape, n: int) -> tuple[bytes, list[bytes]]:
    """The upstream's SETTINGS and its ACK of ours, then one response per exchange."""
    enc = hpack.Encoder()
    window = WindowUpdateFrame(0, window_increment=2**31 - 1 - 65535)
    start = _frames(SettingsFrame(0), SettingsFrame(0, flags=["ACK"]), window)
    chunks = []
    for i in range(n):
        sid = 2 * i + 1
        frames: list[Frame] = [HeadersFrame(sid, enc.encode(shape.response), flags=["END_HEADERS"])]
        if shape.trailers:
            frames.append(DataFrame(sid, shape.response_body))
            frames.append(
                HeadersFrame(sid, enc.encode(shape.trailers), flags=["END_HEADERS", "END_STREAM"])
            )
        else:
            frames.append(DataFrame(sid, shape.response_body, flags=["END_STREAM"]))
        chunks.append(_frames(*frames))
    return start, chunks


class Checker:
    """Decodes what a candidate wrote to one peer and checks it: the header blocks in order."""

    def __init__(self, expected_blocks: list[list[tuple[bytes, bytes]]], bodies: bytes) -> None:
        self.dec = hpack.Decoder()
        self.expected = expected_blocks
        self.bodies = bodies

    def check(self, wire: bytes, preface: bool = False) -> None:
        if preface:
            assert wire.startswith(PREFACE), "no client preface"
            wire = wire[len(PREFACE) :]
        blocks, body, pos = [], b"", 0
        while pos < len(wire):
            length = int.from_bytes(wire[pos : pos + 3], "big")
            kind = wire[pos + 3]
            payload = wire[pos + 9 : pos + 9 + length]
            if kind == 0x1:  # HEADERS (END_HEADERS always set by the candidates)
                blocks.append([(bytes(k), bytes(v)) for k, v in self.dec.decode(payload, raw=True)])
            elif kind == 0x0:
                body += payload
            pos += 9 + length
        for block, want in zip(blocks, self.expected, strict=True):
            # A proxy may add or reorder nothing here: the same fields, the same order.
            assert block == want, f"{block} != {want}"
        assert body == self.bodies, "body bytes differ"


# -- the candidates -----------------------------------------------------------------------------


class Candidate(Protocol):
    name: str

    def setup(self, client_start: bytes, upstream_start: bytes) -> tuple[bytes, bytes]:
        """Connects both sides; returns what each wrote so far (to the client, upstream)."""

    def relay(self, client_chunk: bytes, upstream_chunk: bytes) -> tuple[bytes, bytes]:
        """One exchange; returns what was written to the client and to the upstream."""


class H2Lib:
    """The `h2` library as the engine used it: validation off (the engine checks headers once),
    the project's HPACK codec swapped in."""

    name = "h2lib"

    def __init__(self, shape: Shape) -> None:
        from h2 import events

        self.ev = events
        self.server = self._connection(False, 100)
        self.client = self._connection(True, None)
        self.shape = shape
        self.next_up = 1

    @staticmethod
    def _connection(client_side: bool, max_streams: int | None) -> Any:
        from h2.config import H2Configuration
        from h2.connection import H2Connection
        from h2.settings import SettingCodes, Settings

        from meshlet.proxy.http.h2hpack import Decoder, Encoder

        h2 = H2Connection(
            H2Configuration(
                client_side=client_side, header_encoding=None, validate_inbound_headers=False,
                normalize_inbound_headers=False, validate_outbound_headers=False,
                normalize_outbound_headers=False,
            )
        )  # fmt: skip
        settings = {SettingCodes.ENABLE_PUSH: 0, SettingCodes.INITIAL_WINDOW_SIZE: 256 * 1024,
                    SettingCodes.MAX_HEADER_LIST_SIZE: 65536}  # fmt: skip
        if max_streams is not None:
            settings[SettingCodes.MAX_CONCURRENT_STREAMS] = max_streams
        h2.local_settings = Settings(client=client_side, initial_values=settings)
        h2.encoder = Encoder()
        h2.decoder = Decoder(max_header_list_size=65536)
        return h2

    def setup(self, client_start: bytes, upstream_start: bytes) -> tuple[bytes, bytes]:
        self.server.initiate_connection()
        self.client.initiate_connection()
        self.server.receive_data(client_start)
        self.client.receive_data(upstream_start)
        return self.server.data_to_send(), self.client.data_to_send()

    def relay(self, client_chunk: bytes, upstream_chunk: bytes) -> tuple[bytes, bytes]:
        ev, server, client = self.ev, self.server, self.client
        request: Any = None
        body = b""
        down = 0
        for event in server.receive_data(client_chunk):
            if isinstance(event, ev.RequestReceived):
                request, down = event.headers, event.stream_id
            elif isinstance(event, ev.DataReceived):
                body += event.data
                server.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
        up = self.next_up
        self.next_up += 2
        client.send_headers(up, request, end_stream=not self.shape.request_body)
        if body:
            client.send_data(up, body, end_stream=True)
        response: Any = None
        data = b""
        trailers: Any = None
        for event in client.receive_data(upstream_chunk):
            if isinstance(event, ev.ResponseReceived):
                response = event.headers
            elif isinstance(event, ev.DataReceived):
                data += event.data
                client.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            elif isinstance(event, ev.TrailersReceived):
                trailers = event.headers
        server.send_headers(down, response)
        if trailers:
            server.send_data(down, data)
            server.send_headers(down, trailers, end_stream=True)
        else:
            server.send_data(down, data, end_stream=True)
        return server.data_to_send(), client.data_to_send()


class Own:
    """The prototype codec (bench.h2spike_codec), compiled or not."""

    def __init__(self, shape: Shape, module: str, name: str) -> None:
        self.codec = importlib.import_module(module)
        self.name = name
        self.shape = shape
        self.got: list[Any] = []
        self.server = self.codec.Codec(False, self)
        self.client = self.codec.Codec(True, self)
        self.next_up = 1

    # the handler: the codec calls these
    def on_headers(self, sid: int, fields: list[tuple[bytes, bytes]], end: bool) -> None:
        self.got.append(fields)

    def on_data(self, sid: int, data: bytes, end: bool) -> None:
        self.got.append(data)

    def setup(self, client_start: bytes, upstream_start: bytes) -> tuple[bytes, bytes]:
        self.server.receive(client_start)
        self.client.receive(upstream_start)
        return self.server.take(), self.client.take()

    def _streams(self) -> tuple[int, int]:
        """The exchange's (downstream, upstream) stream ids."""
        up = self.next_up
        self.next_up += 2
        return up, up  # both sides number their streams 1, 3, 5, ... in this benchmark

    def _credit(self, codec: Any, sid: int, size: int) -> None:
        codec.consumed(sid, size)

    def relay(self, client_chunk: bytes, upstream_chunk: bytes) -> tuple[bytes, bytes]:
        server, client, got = self.server, self.client, self.got
        server.receive(client_chunk)
        request = got[0]
        down, up = self._streams()
        if len(got) > 1:
            client.send_headers(up, request, False)
            client.send_data(up, got[1], True)
            self._credit(server, down, len(got[1]))
        else:
            client.send_headers(up, request, True)
        got.clear()
        client.receive(upstream_chunk)
        server.send_headers(down, got[0], False)
        self._credit(client, up, len(got[1]))
        if len(got) > 2:
            server.send_data(down, got[1], False)
            server.send_headers(down, got[2], True)
        else:
            server.send_data(down, got[1], True)
        got.clear()
        return server.take(), client.take()


class Engine(Own):
    """The engine's codec (meshlet.proxy.http.h2codec), with its checks."""

    def __init__(self, shape: Shape) -> None:
        from meshlet.proxy.http.h2codec import Codec

        self.name = "engine"
        self.shape = shape
        self.got = []
        self.closed = False
        self.server = Codec(self, False, 256 * 1024, 1024 * 1024, 65536, 100)
        self.client = Codec(self, True, 256 * 1024, 2**31 - 1, 65536)

    # the handler: the codec calls these
    def on_head(self, sid: int, headers: Any, end: bool) -> None:
        self.got.append(headers)

    def on_trailers(self, sid: int, headers: Any) -> None:
        self.got.append(headers)

    def on_informational(self, sid: int, headers: Any) -> None:
        self.got.append(headers)

    def on_data(self, sid: int, data: bytes, *rest: Any) -> None:  # (flow_len, end) here
        self.got.append(data)

    def on_reset(self, sid: int, code: int) -> None:
        raise AssertionError(f"stream {sid} reset: {code}")

    def on_window(self, sid: int) -> None: ...
    def on_settings(self) -> None: ...
    def on_control(self) -> None: ...
    def on_goaway(self, code: int, last_sid: int, debug: bytes) -> None: ...

    def setup(self, client_start: bytes, upstream_start: bytes) -> tuple[bytes, bytes]:
        self.server.start()
        self.client.start()
        return super().setup(client_start, upstream_start)

    def _streams(self) -> tuple[int, int]:
        return self.server.last_peer_sid, self.client.next_stream_id()

    def _credit(self, codec: Any, sid: int, size: int) -> None:
        codec.acknowledge(sid, size)


class Nghttp2:
    """libnghttp2 through cffi (ABI mode: the shared library, no headers needed)."""

    name = "nghttp2"

    def __init__(self, shape: Shape) -> None:
        from bench import h2spike_nghttp2

        self.mod = h2spike_nghttp2
        self.shape = shape
        self.pair = h2spike_nghttp2.Pair(shape.request_body != b"", bool(shape.trailers))

    def setup(self, client_start: bytes, upstream_start: bytes) -> tuple[bytes, bytes]:
        return self.pair.setup(client_start, upstream_start)

    def relay(self, client_chunk: bytes, upstream_chunk: bytes) -> tuple[bytes, bytes]:
        return self.pair.relay(client_chunk, upstream_chunk)


def candidates(shape: Shape) -> list[tuple[str, Callable[[], Candidate]]]:
    found: list[tuple[str, Callable[[], Candidate]]] = [("h2lib", lambda: H2Lib(shape))]
    found.append(("own", lambda: Own(shape, "bench.h2spike_codec", "own")))
    found.append(("engine", lambda: Engine(shape)))
    try:
        compiled = importlib.import_module("h2spike_codec_mypyc")
        if not str(compiled.__file__).endswith(".py"):
            found.append(("own-mypyc", lambda: Own(shape, "h2spike_codec_mypyc", "own-mypyc")))
    except ImportError:
        pass
    found.append(("nghttp2", lambda: Nghttp2(shape)))
    return found


def compile_mypyc(into: Path) -> None:
    """Compiles a copy of the prototype codec, as module `h2spike_codec_mypyc`, into `into`."""
    source = Path(__file__).with_name("h2spike_codec.py").read_text()
    source = source.replace(
        "from meshlet.proxy.http.h2hpack import Decoder, Encoder",
        "from meshlet.proxy.http.h2hpack import Decoder, Encoder  # type: ignore[import-untyped]",
    )
    (into / "h2spike_codec_mypyc.py").write_text(source)
    mypyc = shutil.which("mypyc") or str(Path(sys.executable).with_name("mypyc"))
    subprocess.run([mypyc, "h2spike_codec_mypyc.py"], cwd=into, check=True, capture_output=True)
    (into / "h2spike_codec_mypyc.py").unlink()  # so that the import finds the compiled one
    sys.path.insert(0, str(into))


# -- the run ----------------------------------------------------------------------------------


def run(shape: Shape, make: Callable[[], Candidate], n: int) -> float:
    """µs per relayed exchange; checks what was written."""
    client_start, client_chunks = client_bytes(shape, n)
    upstream_start, upstream_chunks = upstream_bytes(shape, n)
    cand = make()
    to_client, to_upstream = [], []
    first_down, first_up = cand.setup(client_start, upstream_start)
    gc.collect()
    gc.disable()
    started = time.perf_counter()
    for i in range(n):
        down, up = cand.relay(client_chunks[i], upstream_chunks[i])
        to_client.append(down)
        to_upstream.append(up)
    elapsed = time.perf_counter() - started
    gc.enable()
    blocks = [shape.response, shape.trailers] if shape.trailers else [shape.response]
    Checker([b for _ in range(n) for b in blocks], shape.response_body * n).check(
        first_down + b"".join(to_client)
    )
    Checker([shape.request] * n, shape.request_body * n).check(
        first_up + b"".join(to_upstream), preface=True
    )
    return elapsed / n * 1e6


def report(requests: int, repeat: int) -> None:
    print(f"µs per relayed exchange (server side + client side), best and median of "
          f"{repeat} runs of {requests}")  # fmt: skip
    print(f"{'shape':6} {'candidate':10} {'best':>8} {'median':>8}")
    for shape in SHAPES:
        for name, make in candidates(shape):
            try:
                times = [run(shape, make, requests) for _ in range(repeat)]
            except Exception as exc:  # a candidate that cannot run says why
                print(f"{shape.name:6} {name:10} {'-':>8} {'-':>8}  {type(exc).__name__}: {exc}")
                continue
            print(f"{shape.name:6} {name:10} {min(times):8.2f} {statistics.median(times):8.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--mypyc", action="store_true", help="also the codec compiled by mypyc")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="h2spike-") as build:
        if args.mypyc:
            try:
                compile_mypyc(Path(build))
            except (OSError, subprocess.CalledProcessError) as exc:
                print(f"mypyc: cannot compile the codec ({exc}); its rows are left out")
        report(args.requests, args.repeat)
    return 0


if __name__ == "__main__":
    sys.exit(main())
