"""Where a request's authority says it goes (pure apart from name resolution); targets that
would loop back into the proxy are refused (core/loops.py)."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
import threading
from typing import Any, Final

from meshlet.api.hostport import parse_hostport
from meshlet.proxy.core.loops import SelfTargets
from meshlet.proxy.http.contract import Addr, Endpoint, RouteError


def split_authority(authority: str, default_port: int = 80) -> Addr | None:
    """`host:port`, `[v6]:port` or `host` → (host, port); None when malformed."""
    try:
        return parse_hostport(authority, default_port=default_port)
    except ValueError:
        return None


async def resolve(host: str, port: int) -> Addr | None:
    """An IP literal as is; a name through the resolver (first address). TimeoutError when
    the lookup takes over LOOKUP_TIMEOUT seconds.

    Lookups run on threads of their own, at most MAX_LOOKUPS at once, not on the event loop's
    thread pool: uvloop's pool also serves its own work, and four slow names (a resolver that
    answers in 5 s) held it so long that connections to mesh peers timed out meanwhile. A
    lookup holds its slot until its thread ends, also after its caller gave up."""
    try:
        ipaddress.ip_address(host)
        return Addr(host, port)
    except ValueError:
        pass
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(LOOKUP_TIMEOUT):
            infos = await _lookup(loop, host, port)
    except TimeoutError:
        raise  # (an OSError too)
    except OSError:
        return None
    for family, _, _, _, sockaddr in infos:
        if family in (socket.AF_INET, socket.AF_INET6):
            return Addr.from_sockaddr(sockaddr)
    return None


LOOKUP_TIMEOUT: Final = 5.0  # seconds a name lookup may take
MAX_LOOKUPS: Final = 8  # name lookups running at once (a thread each)
_slots: dict[asyncio.AbstractEventLoop, asyncio.Semaphore] = {}


async def _lookup(loop: asyncio.AbstractEventLoop, host: str, port: int) -> list[Any]:
    slots = _slots.get(loop)
    if slots is None:
        _slots.clear()  # one event loop runs a proxy; others were tests'
        slots = _slots[loop] = asyncio.Semaphore(MAX_LOOKUPS)
    await slots.acquire()
    answer: asyncio.Future[list[Any]] = loop.create_future()

    def settle(infos: list[Any] | None, error: OSError | None) -> None:
        slots.release()
        if answer.done():
            return  # the caller gave up
        if error is not None:
            answer.set_exception(error)
        else:
            answer.set_result(infos or [])

    def run() -> None:
        infos, error = None, None
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as exc:
            error = exc
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile (shutdown)
            loop.call_soon_threadsafe(settle, infos, error)

    threading.Thread(target=run, name="meshlet-lookup", daemon=True).start()
    return await answer


async def by_authority(
    authority: str | None, self_targets: SelfTargets, local_ip: str
) -> Endpoint | RouteError:
    """The endpoint named by a request's authority (un-redirected outbound connections)."""
    parts = _authority_parts(authority)
    if isinstance(parts, RouteError):
        return parts
    try:
        addr = await resolve(*parts)
    except TimeoutError:
        return RouteError(504, "the lookup of the request's authority timed out")
    if addr is None:
        return RouteError(502, "the request's authority does not resolve")
    return _endpoint(parts, addr, self_targets, local_ip)


def by_literal(
    authority: str | None, self_targets: SelfTargets, local_ip: str
) -> Endpoint | RouteError | None:
    """`by_authority` when it needs no name lookup (an IP literal, or an authority that is
    refused), else None. The same authority always gets the same answer: callers may keep it."""
    parts = _authority_parts(authority)
    if isinstance(parts, RouteError):
        return parts
    try:
        ipaddress.ip_address(parts[0])
    except ValueError:
        return None
    return _endpoint(parts, parts, self_targets, local_ip)


def _authority_parts(authority: str | None) -> Addr | RouteError:
    if not authority:
        return RouteError(400, "the request names no authority (Host or absolute URI)")
    parts = split_authority(authority)
    if parts is None:
        return RouteError(400, "the request's authority is malformed")
    return parts


def _endpoint(
    parts: Addr, addr: Addr, self_targets: SelfTargets, local_ip: str
) -> Endpoint | RouteError:
    if self_targets.loops(addr, local_ip):
        return RouteError(403, "the request targets the proxy itself (a routing loop)")
    return Endpoint(addr, str(parts))
