"""`meshlet-network-validator`: the init container of a meshed pod when meshlet-cni, not an
init container of its own, programs the pod's tables (Linkerd's network-validator). It holds no
privilege: it listens on the proxy's outbound port, connects to an address that is never
routed (TEST-NET-1, RFC 5737) and succeeds only when that connection arrives at its own
listener, redirected, carrying the random token it sent. Otherwise the pod's traffic would
bypass its proxy, so it exits 1 naming the likely cause, and the pod does not start.

It must not run as the proxy's user, whose connections the rules let past.
"""

from __future__ import annotations

import argparse
import ipaddress
import secrets
import socket
import struct
import sys
import time
from typing import Final

from meshlet.api import wellknown

EX_OK: Final = 0
EX_NOT_REDIRECTED: Final = 1
EX_CONFIG: Final = 64
SO_ORIGINAL_DST: Final = 80  # linux/netfilter_ipv4.h
DEFAULT_CONNECT: Final = "192.0.2.1:20001"  # TEST-NET-1: nothing answers there unredirected


def _addr(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
        number = int(port)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not an address such as 192.0.2.1:20001"
        ) from None
    if not sep or not 0 < number < 65536:
        raise argparse.ArgumentTypeError(f"{text!r} is not an address such as 192.0.2.1:20001")
    return str(ip), number


def _original_dst(conn: socket.socket) -> tuple[str, int] | None:
    try:
        raw = conn.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
    except OSError:
        return None
    port, packed = struct.unpack_from("!2xH4s", raw)
    return socket.inet_ntoa(packed), port


def validate(listen: tuple[str, int], connect: tuple[str, int], timeout: float) -> str | None:
    """None when a connection to `connect` reaches `listen`, redirected; else what went wrong."""
    family = socket.AF_INET6 if ":" in connect[0] else socket.AF_INET
    token = secrets.token_hex(16).encode()
    try:
        server = socket.create_server(listen, family=socket.AF_INET6 if ":" in listen[0]
                                      else socket.AF_INET)  # fmt: skip
    except OSError as exc:
        return f"cannot listen on {listen[0]}:{listen[1]}: {exc.strerror}"
    deadline = time.monotonic() + timeout
    with server, socket.socket(family, socket.SOCK_STREAM) as client:
        client.settimeout(timeout)
        try:
            client.connect(connect)
            client.sendall(token)
        except OSError as exc:
            reason = "timed out" if isinstance(exc, TimeoutError) else exc.strerror or str(exc)
            return f"the connection to {connect[0]}:{connect[1]} was not redirected ({reason})"
        server.settimeout(max(0.1, deadline - time.monotonic()))
        try:
            conn, _ = server.accept()
        except TimeoutError:
            return (f"the connection to {connect[0]}:{connect[1]} went somewhere else than"
                    f" port {listen[1]}")  # fmt: skip
        with conn:
            conn.settimeout(max(0.1, deadline - time.monotonic()))
            got = b""
            try:
                while len(got) < len(token):
                    chunk = conn.recv(len(token) - len(got))
                    if not chunk:
                        break
                    got += chunk
            except OSError:
                pass
            if got != token:
                return f"port {listen[1]} accepted a connection that was not this one"
            if family == socket.AF_INET and _original_dst(conn) not in (None, connect):
                return f"the redirected connection was meant for {_original_dst(conn)}"
    return None


def parser() -> argparse.ArgumentParser:
    result = argparse.ArgumentParser(
        prog="meshlet-network-validator",
        description="Exit 0 when this pod's outbound TCP is redirected to its proxy's port"
        " (meshlet-cni's rules), 1 otherwise. Run as any user but the proxy's.",
    )
    result.add_argument(
        "--listen-addr",
        type=_addr,
        default=("0.0.0.0", wellknown.PROXY_OUTBOUND_PORT),
        help="where the redirected connection should arrive (the proxy's"
        f" outbound port; default 0.0.0.0:{wellknown.PROXY_OUTBOUND_PORT})",
    )
    result.add_argument(
        "--connect-addr",
        type=_addr,
        default=_addr(DEFAULT_CONNECT),
        help=f"an address that no route answers, connected to (default {DEFAULT_CONNECT})",
    )
    result.add_argument(
        "--timeout",
        type=float,
        default=10.0,
        help="seconds to wait for the connection (default 10)",
    )
    return result  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    try:
        args = parser().parse_args(argv)
    except SystemExit as exc:
        sys.exit(EX_CONFIG if exc.code else EX_OK)
    problem = validate(args.listen_addr, args.connect_addr, args.timeout)
    if problem is None:
        print(f"meshlet-network-validator: outbound TCP is redirected to port"
              f" {args.listen_addr[1]}")  # fmt: skip
        return
    sys.stderr.write(
        f"meshlet-network-validator: {problem}. This pod's traffic would bypass its proxy:"
        " meshlet-cni did not program its network namespace. Check that the meshlet-cni"
        " DaemonSet runs on this pod's node (kubectl -n meshlet-cni get pods -o wide) and was"
        " ready before the pod was made, then delete the pod so that it is made again.\n"
    )
    sys.exit(EX_NOT_REDIRECTED)


if __name__ == "__main__":
    main()
