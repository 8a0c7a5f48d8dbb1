"""Socket facts the kernel knows (the original destination of a redirected connection,
whether a client has already shut down its side), and writing pieces of a message at once."""

from __future__ import annotations

import asyncio
import select
import socket
import struct
from collections.abc import Sequence
from typing import Final

from meshlet.api.hostport import HostPort

SO_ORIGINAL_DST: Final = 80  # linux/netfilter_ipv4.h; IP6T_SO_ORIGINAL_DST has the same value

Addr = HostPort
COALESCE_LIMIT: Final = 64 * 1024  # pieces smaller than this together are written as one


def write_pieces(transport: asyncio.WriteTransport, pieces: Sequence[bytes]) -> int:
    """Writes the pieces of a message (a head and its body, say) as one buffer when they are
    small together: over TLS that is one record and one send instead of one per piece. Larger
    ones go as they are (no copy). Returns the bytes written."""
    if len(pieces) == 1:
        transport.write(pieces[0])
        return len(pieces[0])
    size = sum(map(len, pieces))
    if size <= COALESCE_LIMIT:
        transport.write(b"".join(pieces))
    else:
        transport.writelines(pieces)
    return size


def original_dst(sock: socket.socket) -> Addr | None:
    """Where the client meant to connect before an iptables REDIRECT; None when the connection
    was not redirected (or conntrack knows nothing of it)."""
    local = sock.getsockname()
    try:
        if sock.family == socket.AF_INET6:
            raw = sock.getsockopt(socket.IPPROTO_IPV6, SO_ORIGINAL_DST, 28)
            port = struct.unpack_from("!H", raw, 2)[0]
            address = socket.inet_ntop(socket.AF_INET6, raw[8:24])
        else:
            raw = sock.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
            port = struct.unpack_from("!H", raw, 2)[0]
            address = socket.inet_ntop(socket.AF_INET, raw[4:8])
    except OSError:
        return None
    if (address, port) == (local[0], local[1]):
        return None
    return HostPort(address, port)


def peer_closed(sock: socket.socket) -> bool:
    """Whether the client has shut down its side (Linux POLLRDHUP; elsewhere never known). A
    FIN behind unread bytes is invisible to MSG_PEEK, which keeps returning the same bytes."""
    rdhup = getattr(select, "POLLRDHUP", 0)
    if not rdhup:
        return False
    poller = select.poll()
    poller.register(sock.fileno(), rdhup)
    return bool(poller.poll(0))
