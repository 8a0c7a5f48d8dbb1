"""The proxy benchmark's gRPC upstream: a grpcio server answering one unary method.

Run as `python -m bench.proxy_upstream --port N [--hosts A,B]` (listening on each address,
127.0.0.1 by default); it prints `ready` once serving and stops on SIGTERM. The handler is
generic (no generated code): it checks the request bytes and answers a fixed small message, so
the bench measures the proxy, not protobuf.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from typing import Final

import grpc

SERVICE: Final = "meshlet.bench.Echo"
METHOD: Final = "Call"
PATH: Final = f"/{SERVICE}/{METHOD}"
# field 1 (string) = "ping" / "ok", encoded by hand: tag 0x0a, length, bytes
REQUEST: Final = b"\x0a\x04ping"
RESPONSE: Final = b"\x0a\x02ok"


def grpc_frame(message: bytes) -> bytes:
    """A gRPC length-prefixed message: no compression flag, 4-byte big-endian length."""
    return b"\x00" + len(message).to_bytes(4, "big") + message


async def _call(request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
    if request != REQUEST:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "unexpected request bytes")
    return RESPONSE


async def _serve(hosts: list[str], port: int) -> None:
    server = grpc.aio.server()
    # no (de)serializers: the handler sees and returns raw bytes
    handler: grpc.RpcMethodHandler[bytes, bytes] = grpc.unary_unary_rpc_method_handler(_call)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE, {METHOD: handler}),)
    )
    for host in hosts:
        server.add_insecure_port(f"{host}:{port}")
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    print("ready", flush=True)
    await stop.wait()
    await server.stop(grace=None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--hosts", default="127.0.0.1", help="comma-separated addresses")
    args = parser.parse_args()
    asyncio.run(_serve(args.hosts.split(","), args.port))
    sys.exit(0)


if __name__ == "__main__":
    main()
