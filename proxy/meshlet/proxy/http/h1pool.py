"""Keep-alive pool of upstream HTTP/1.1 connections, per endpoint, with an idle timeout.

A connection is keyed by the connector that opened it and the endpoint address (plain TCP and
mTLS connections to the same address are never mixed). The most recently used idle connection is
handed out first; one idle for `idle_timeout` seconds, or closed by its peer, is dropped. Share one
pool between the connections of a listener to reuse upstream connections across clients.
"""

from __future__ import annotations

from typing import Final

from meshlet.proxy.core.failover import Failure
from meshlet.proxy.http.attempts import Failed
from meshlet.proxy.http.contract import Addr, Connect, HttpLimits
from meshlet.proxy.http.h1client import H1Upstream
from meshlet.proxy.io.counters import TcpConn

PoolKey = tuple[Connect, Addr]

MAX_IDLE_PER_ENDPOINT: Final = 64


class H1Pool:
    def __init__(self, idle_timeout: float, max_idle: int = MAX_IDLE_PER_ENDPOINT) -> None:
        self.idle_timeout = idle_timeout
        self._max_idle = max_idle
        self._idle: dict[PoolKey, list[H1Upstream]] = {}
        self._keys: dict[H1Upstream, PoolKey] = {}
        self._closed = False

    def take(self, key: PoolKey) -> H1Upstream | None:
        """An idle connection to `key`'s endpoint, or None."""
        stack = self._idle.get(key)
        while stack:
            upstream = stack.pop()
            del self._keys[upstream]
            upstream.on_idle_lost = None
            if not stack:
                del self._idle[key]
            if not upstream.closed:
                upstream.reused = True
                return upstream
        return None

    async def open(self, key: PoolKey, limits: HttpLimits, tcp: TcpConn) -> H1Upstream:
        """A new connection to `key`'s endpoint (the connector applies its connect timeout),
        counted by `tcp` once established."""
        connect, addr = key
        _, protocol = await connect(addr, lambda: H1Upstream(limits, tcp))
        assert isinstance(protocol, H1Upstream)
        tcp.open()
        return protocol

    async def dial(self, key: PoolKey, limits: HttpLimits, tcp: TcpConn) -> H1Upstream | Failed:
        """`open`, with a failure said as the request's Attempts take it."""
        addr = key[1]
        try:
            return await self.open(key, limits, tcp)
        except TimeoutError:
            why = f"connecting to {addr} timed out after {limits.connect_timeout}s"
            return Failed(Failure.CONNECT_TIMEOUT, why)
        except Exception as exc:  # refused, unreachable, TLS failure: all end here
            return Failed(Failure.CONNECT, f"connecting to {addr} failed: {exc}")

    def give(self, key: PoolKey, upstream: H1Upstream) -> None:
        """Keeps `upstream` for the next request to the same endpoint, or closes it."""
        stack = self._idle.get(key)
        if self._closed or upstream.closed or (stack and len(stack) >= self._max_idle):
            upstream.close()
            return
        if stack is None:
            stack = self._idle[key] = []
        stack.append(upstream)
        self._keys[upstream] = key
        upstream.on_idle_lost = self._discard
        upstream.idle_since = upstream.loop.time()
        if upstream.idle_timer is None:
            upstream.idle_timer = upstream.loop.call_later(
                self.idle_timeout, self._expire, upstream
            )

    def close(self) -> None:
        """Closes every idle connection; later ones given back are closed too."""
        self._closed = True
        for upstream in list(self._keys):
            self._discard(upstream)
            upstream.close()

    def _discard(self, upstream: H1Upstream) -> None:
        key = self._keys.pop(upstream, None)
        if upstream.idle_timer is not None:
            upstream.idle_timer.cancel()
            upstream.idle_timer = None
        if key is not None:
            stack = self._idle[key]
            stack.remove(upstream)
            if not stack:
                del self._idle[key]

    def _expire(self, upstream: H1Upstream) -> None:
        # One timer per connection, re-armed only when it fires: nothing to do per request.
        upstream.idle_timer = None
        if upstream not in self._keys:
            return  # in use; armed again when given back
        left = upstream.idle_since + self.idle_timeout - upstream.loop.time()
        if left > 0.001:
            upstream.idle_timer = upstream.loop.call_later(left, self._expire, upstream)
            return
        self._discard(upstream)
        upstream.close()
