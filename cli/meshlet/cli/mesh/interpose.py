"""A pod's app made slow, or failing, for a drill (`Mesh.slow`, `Mesh.fail`) without touching
the app: the pod's proxy's connections to the app's port are sent here by an iptables rule in the
pod (for the proxy's GID only), and this process either relays them to the app with every byte
the app sends back `--delay` seconds late, or answers every request itself with `--status`:
HTTP/1.1 and HTTP/2 (prior knowledge, as the proxy speaks to apps) with that status, gRPC with
the gRPC status an HTTP status maps to (as gRPC's own mapping does: 503 → UNAVAILABLE, …).

    python -m meshlet.cli.mesh.interpose --listen 127.0.0.1:4179 --to 127.0.0.1:8080 --delay 0.05
    python -m meshlet.cli.mesh.interpose --listen 127.0.0.1:4179 --status 503
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from http import HTTPStatus
from typing import Final

import h2.config
import h2.connection
import h2.events
import httptools

# Where it listens in the pod: on loopback only, where the pod's REDIRECT rule sends the
# proxy's connections (a locally made connection is redirected to 127.0.0.1), so that nothing
# outside the pod reaches it through the pod's inbound port.
PORT: Final = 4179
H2_PREFACE: Final = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
# HTTP status → gRPC status, as gRPC maps an HTTP error (doc/http-grpc-status-mapping.md)
GRPC_OF_HTTP: Final = {400: 13, 401: 16, 403: 7, 404: 12, 429: 14, 502: 14, 503: 14, 504: 14}
GRPC_UNKNOWN: Final = 2


def grpc_status(http: int) -> int:
    return GRPC_OF_HTTP.get(http, GRPC_UNKNOWN)


def reason(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Drill"


# -- delay: a relay whose replies are late ----------------------------------------------------


async def relay(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, to: tuple[str, int], delay: float
) -> None:
    try:
        up_reader, up_writer = await asyncio.open_connection(*to)
    except OSError:
        writer.close()
        return
    loop = asyncio.get_running_loop()
    late: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def requests() -> None:
        while data := await reader.read(65536):
            up_writer.write(data)
            await up_writer.drain()
        with contextlib.suppress(OSError):
            up_writer.write_eof()

    async def replies_in() -> None:
        while data := await up_reader.read(65536):
            await late.put((loop.time() + delay, data))
        await late.put((loop.time() + delay, b""))

    async def replies_out() -> None:
        while True:
            due, data = await late.get()
            await asyncio.sleep(max(0.0, due - loop.time()))
            if not data:
                with contextlib.suppress(OSError):
                    writer.write_eof()
                return
            writer.write(data)
            await writer.drain()

    tasks = [asyncio.ensure_future(t()) for t in (requests, replies_in, replies_out)]
    try:
        await asyncio.gather(*tasks)
    except (OSError, asyncio.IncompleteReadError):
        pass
    finally:
        for task in tasks:
            task.cancel()
        writer.close()
        up_writer.close()


# -- status: every request answered here -------------------------------------------------------


class _Http1:
    """httptools' callbacks: a request is answered once its message is complete."""

    def __init__(self, writer: asyncio.StreamWriter, status: int) -> None:
        self.writer = writer
        self.status = status

    def on_message_complete(self) -> None:
        body = f"{self.status} {reason(self.status)} (a drill)\n".encode()
        self.writer.write(
            f"HTTP/1.1 {self.status} {reason(self.status)}\r\ncontent-type: text/plain\r\n"
            f"content-length: {len(body)}\r\n\r\n".encode()
            + body
        )


async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, status: int) -> None:
    try:
        first = await reader.read(65536)
        while first and len(first) < len(H2_PREFACE) and H2_PREFACE.startswith(first):
            more = await reader.read(65536)  # the preface may come in pieces
            if not more:
                return
            first += more
        if first.startswith(H2_PREFACE):
            await _answer_h2(first, reader, writer, status)
            return
        parser = httptools.HttpRequestParser(_Http1(writer, status))
        data = first
        while data:
            parser.feed_data(data)
            await writer.drain()
            data = await reader.read(65536)
    except (OSError, httptools.HttpParserError):
        pass
    finally:
        writer.close()


async def _answer_h2(
    first: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, status: int
) -> None:
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
    conn.initiate_connection()
    grpc: dict[int, bool] = {}
    data = first
    while data:
        for event in conn.receive_data(data):
            if isinstance(event, h2.events.RequestReceived):
                headers = dict(event.headers or [])
                content_type = headers.get(b"content-type", b"")
                grpc[event.stream_id] = content_type.startswith(b"application/grpc")
            elif isinstance(event, h2.events.DataReceived):
                conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            if isinstance(event, h2.events.StreamEnded):
                _respond_h2(conn, event.stream_id, status, grpc.pop(event.stream_id, False))
        writer.write(conn.data_to_send())
        await writer.drain()
        data = await reader.read(65536)


def _respond_h2(conn: h2.connection.H2Connection, stream: int, status: int, grpc: bool) -> None:
    if grpc:  # a trailers-only response: the call's status in the one HEADERS frame
        conn.send_headers(stream, [
            (":status", "200"), ("content-type", "application/grpc"),
            ("grpc-status", str(grpc_status(status))),
            ("grpc-message", f"{status} {reason(status)} (a drill)"),
        ], end_stream=True)  # fmt: skip
        return
    body = f"{status} {reason(status)} (a drill)\n".encode()
    conn.send_headers(stream, [(":status", str(status)), ("content-type", "text/plain"),
                               ("content-length", str(len(body)))])  # fmt: skip
    conn.send_data(stream, body, end_stream=True)


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host.strip("[]"), int(port)


async def serve(args: argparse.Namespace) -> None:
    host, port = _address(args.listen)
    if args.status is not None:
        status = args.status

        async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            await answer(r, w, status)
    else:
        to, delay = _address(args.to), args.delay

        async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            await relay(r, w, to, delay)

    server = await asyncio.start_server(handle, host, port, reuse_address=True)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--listen", default=f"127.0.0.1:{PORT}")
    parser.add_argument("--to", help="the app's address (with --delay)")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--delay", type=float, help="seconds every reply from the app is late")
    mode.add_argument("--status", type=int, help="the HTTP status every request gets")
    args = parser.parse_args(argv)
    if args.delay is not None and args.to is None:
        parser.error("--delay needs --to")
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(args))


if __name__ == "__main__":
    main()
