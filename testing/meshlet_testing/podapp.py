"""A test pod's app, one process (`python -m meshlet_testing.podapp --pod NAME`), on the pod's
address:

- HTTP/1.1 and HTTP/2 with prior knowledge (`HTTP_PORT`): every request is answered 200 with
  JSON naming the pod, the method, the path and every caller identity header that arrived
  (`meshlet-client-id`, `l5d-client-id`): what the pod's proxy let through, forged or not;
  `GET /_waiting` answers how many requests wait for the rest of their body now;
- HTTP/1 by Python's `http.server` (`STDLIB_PORT`), as wsgiref and the development servers of
  werkzeug and Django parse it (any whitespace between the words of a request line): the same
  JSON for every method;
- gRPC (`GRPC_PORT`), `/meshlet.test.Echo/Unary`: the same JSON, from the call's metadata;
- TCP (`TCP_PORT`), the server speaks first: `hello from NAME`, then echoes each line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
from collections.abc import Iterable
from typing import Any, Final

HTTP_PORT: Final = 8080
STDLIB_PORT: Final = 8081
GRPC_PORT: Final = 9090
TCP_PORT: Final = 7000
ECHO: Final = "/meshlet.test.Echo/Unary"
IDENTITY_HEADERS: Final = ("meshlet-client-id", "l5d-client-id")
MAX_HEAD: Final = 64 * 1024


def answer(pod: str, method: str, path: str, fields: Iterable[tuple[str, str]]) -> bytes:
    ids = {name: [v for k, v in fields if k.lower() == name] for name in IDENTITY_HEADERS}
    return json.dumps({"pod": pod, "method": method, "path": path, **ids}).encode()


class Waiting:
    """Requests whose body is still arriving."""

    count = 0


async def serve_http(pod: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    broken = (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError)
    with contextlib.suppress(*broken):
        head = await reader.readuntil(b"\r\n\r\n")
        if head.startswith(b"PRI * HTTP/2.0"):
            await serve_h2(pod, head + await reader.readexactly(6), reader, writer)
            return
        while head:
            lines = head.decode("latin-1").split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            fields = [tuple(x.strip() for x in line.split(":", 1)) for line in lines[1:] if line]
            pairs = [(k, v) for k, v in fields]
            length = int(dict((k.lower(), v) for k, v in pairs).get("content-length", "0"))
            Waiting.count += 1
            try:
                await reader.readexactly(length)
            finally:
                Waiting.count -= 1
            if path == "/_waiting":
                body = json.dumps({"waiting": Waiting.count}).encode()
            else:
                body = answer(pod, method, path, pairs)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
            await writer.drain()
            head = await reader.readuntil(b"\r\n\r\n")
    writer.close()


async def serve_h2(
    pod: str, preface: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    import h2.config
    import h2.connection
    import h2.events

    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
    conn.initiate_connection()
    data = preface
    while data:
        for event in conn.receive_data(data):
            if isinstance(event, h2.events.RequestReceived):
                pairs = [(bytes(k).decode(), bytes(v).decode()) for k, v in event.headers or ()]
                pseudo = dict(pairs)
                body = answer(pod, pseudo.get(":method", ""), pseudo.get(":path", ""), pairs)
                head = [(":status", "200"), ("content-type", "application/json")]
                conn.send_headers(event.stream_id, head)
                conn.send_data(event.stream_id, body, end_stream=True)
        writer.write(conn.data_to_send())
        data = await reader.read(65536)
    writer.close()


async def serve_tcp(pod: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.write(f"hello from {pod}\n".encode())
    with contextlib.suppress(ConnectionError):
        while line := await reader.readline():
            writer.write(b"echo:" + line)
            await writer.drain()
    writer.close()


def serve_stdlib(pod: str, host: str) -> Any:
    """http.server on STDLIB_PORT, in a thread of its own; returns the server (to shut down)."""
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def handle_any(self) -> None:
            body = answer(pod, self.command, self.path, list(self.headers.items()))
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = do_PUT = do_DELETE = do_FOO = handle_any

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer((host, STDLIB_PORT), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


async def main(pod: str, host: str) -> None:
    import grpc

    async def unary(request: bytes, context: Any) -> bytes:
        metadata = [(str(k), str(v)) for k, v in context.invocation_metadata() or ()]
        return answer(pod, "POST", ECHO, metadata)

    servers = [
        await asyncio.start_server(
            lambda r, w: serve_http(pod, r, w), host, HTTP_PORT, limit=MAX_HEAD
        ),
        await asyncio.start_server(lambda r, w: serve_tcp(pod, r, w), host, TCP_PORT),
    ]
    rpc = grpc.aio.server()
    service, method = ECHO[1:].split("/")
    rpc.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        service, {method: grpc.unary_unary_rpc_method_handler(unary)}),))  # fmt: skip
    rpc.add_insecure_port(f"{host or '[::]'}:{GRPC_PORT}")
    await rpc.start()
    stdlib = serve_stdlib(pod, host)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print("ready", flush=True)
    await stop.wait()
    for server in servers:
        server.close()
    stdlib.shutdown()
    await rpc.stop(grace=0)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pod", required=True)
    parser.add_argument("--host", default="0.0.0.0", help='"": IPv4 and IPv6')
    args = parser.parse_args()
    asyncio.run(main(args.pod, args.host))
