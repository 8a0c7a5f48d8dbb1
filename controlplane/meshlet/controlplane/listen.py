"""Owns binding the controllers' listeners: an address that cannot be bound becomes a
`ListenError`, the one line a user needs (`meshlet-controller` prints it and exits 1)."""

from __future__ import annotations

import os
import socket

import grpc

from meshlet.api.admin import AdminServer
from meshlet.api.hostport import format_hostport


class ListenError(OSError):
    """A listener could not be bound: which address, for what, and why."""

    def __init__(self, addr: tuple[str, int], name: str, why: str) -> None:
        super().__init__(f"cannot listen on {_show(addr)} ({name}): {why}")


def _show(addr: tuple[str, int]) -> str:
    return format_hostport(*addr)


def _why(exc: OSError) -> str:
    return os.strerror(exc.errno) if exc.errno else str(exc)


def bind(addr: tuple[str, int], name: str) -> socket.socket:
    """A listening, non-blocking TCP socket on `addr` (SO_REUSEADDR); ListenError if not."""
    family = socket.AF_INET6 if ":" in addr[0] else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise ListenError(addr, name, _why(exc)) from None
    sock.setblocking(False)
    return sock


def check_free(addr: tuple[str, int], name: str) -> None:
    """ListenError now if `addr` cannot be bound (a port 0 always can)."""
    if addr[1] != 0:
        bind(addr, name).close()


def add_grpc_port(
    server: grpc.aio.Server,
    addr: tuple[str, int],
    credentials: grpc.ServerCredentials | None = None,
) -> int:
    """Adds `addr` to `server`; the bound port. The address is tried with a plain socket first:
    gRPC's own failure names no reason and logs a line of its own."""
    check_free(addr, "gRPC")
    address = f"{_show(addr)}"
    try:
        if credentials is None:
            return server.add_insecure_port(address)
        return server.add_secure_port(address, credentials)
    except RuntimeError as exc:  # taken between the check and gRPC's own bind
        raise ListenError(addr, "gRPC", str(exc)) from None


async def start_admin(admin: AdminServer, addr: tuple[str, int]) -> int:
    """Starts the admin server on `addr`; the bound port."""
    try:
        _, port = await admin.start(*addr)
    except OSError as exc:
        raise ListenError(addr, "admin", _why(exc)) from None
    return port
