"""What both stacks do with a connection once they know where it goes: count it, refuse it, serve
it with an HTTP engine (pooled upstream connections shared by the process), or relay it as opaque
TCP, trying endpoints as the failover policy says."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import socket
import struct
import time
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Final

from meshlet.api.target import EscapedSlashes
from meshlet.proxy.core.detect import may_be_http
from meshlet.proxy.core.failover import Failure
from meshlet.proxy.core.routes import DEFAULT_ROUTE
from meshlet.proxy.http.attempts import Attempts, Failed, advance
from meshlet.proxy.http.contract import (
    Connect,
    Endpoint,
    EndpointPicker,
    Handoff,
    HttpConn,
    HttpLimits,
    Router,
    RouteTarget,
    Shedder,
    Target,
    Wait,
)
from meshlet.proxy.io import relay
from meshlet.proxy.io.counters import ConnLabels, TcpConn
from meshlet.proxy.io.listener import Accepted
from meshlet.proxy.metrics import ProxyMetrics

if TYPE_CHECKING:
    from meshlet.proxy.http.h1pool import H1Pool
    from meshlet.proxy.http.h2pool import H2Pool
    from meshlet.proxy.http.observe import Observe

log = logging.getLogger(__name__)

_OPAQUE: Final = Target(None, "", "")  # a connection: no authority, method or path


class Connections:
    """Shared by the inbound and outbound stacks of one proxy."""

    def __init__(
        self,
        metrics: ProxyMetrics,
        limits: HttpLimits,
        connect: Connect,
        closing: asyncio.Event,
        shedder: Shedder | None = None,
        observe: Observe | None = None,
        inbound_slashes: EscapedSlashes = EscapedSlashes.REJECT,
    ) -> None:
        self.metrics = metrics
        self.observe = observe  # access logs and spans (None: neither)
        self.limits = limits
        # Requests to the pod: its app's reading of `%2F` decides (meshlet.api.target); outbound
        # requests keep theirs, for the server's proxy to judge.
        self.inbound_limits = dataclasses.replace(limits, escaped_slashes=inbound_slashes)
        self.connect = connect  # plain TCP with the connect timeout
        self.closing = closing
        self.shedder = shedder  # every served client connection registers with it
        # Made when HTTP is first seen, so that an idle proxy never imports the engines. Both
        # serve either engine: an HTTP/1 request may go as a peer proxy's HTTP/2 stream, and
        # a peer's HTTP/2 stream to the app as HTTP/1.1 (http/orig_proto.py).
        self._h1_pool: H1Pool | None = None
        self._h2_pool: H2Pool | None = None

    async def aclose(self) -> None:
        if self._h1_pool is not None:
            self._h1_pool.close()
        if self._h2_pool is not None:
            await self._h2_pool.aclose()

    # -- counting and refusing ------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def counted(self, labels: ConnLabels) -> AsyncIterator[TcpConn]:
        """An accepted connection (`peer="src"`), open while the block runs; whoever serves it
        counts its bytes on the TcpConn (and may close it first, with the error it ended in)."""
        tcp = self.metrics.tcp.conn("src", labels.values())
        tcp.open()
        try:
            yield tcp
        finally:
            tcp.close()

    def refuse(self, accepted: Accepted, direction: str, reason: str, why: str) -> None:
        self.metrics.fail_fast_total.labels(direction, reason).inc()
        log.warning("%s connection from %s refused: %s", direction, accepted.client, why)
        accepted.sock.close()

    def detect_timed_out(self, direction: str, timeout: float, port: int | None) -> None:
        label = str(port) if port is not None else "unknown"
        self.metrics.detect_timeout_total.labels(direction, label).inc()
        log.warning(
            "protocol detection timed out after %gs on port %s (%s); handling it as opaque TCP."
            " If the server speaks first, mark the port opaque with "
            "config.meshlet.io/opaque-ports", timeout, label, direction,
        )  # fmt: skip

    def late_http_check(self, client: str, port: int, timeout: float) -> relay.FirstBytesCheck:
        """For an inbound connection relayed as opaque because its client sent nothing within
        the detection timeout: an HTTP request arriving afterwards would reach the app with no
        HTTP defence and a client-chosen `meshlet-client-id`, so it is refused."""

        def refused() -> None:
            self.metrics.fail_fast_total.labels("inbound", "late_http").inc()
            log.warning(
                "inbound connection from %s to port %d closed: it sent nothing for %gs, so it "
                "was relayed as a server-speaks-first protocol, then sent HTTP; HTTP clients "
                "must send their request within the detection timeout", client, port, timeout,
            )  # fmt: skip

        return lambda first, final: may_be_http(first, final=final), refused

    # -- HTTP ---------------------------------------------------------------------------

    async def http(
        self,
        h2: bool,
        router: Router,
        labels: ConnLabels,
        tcp: TcpConn,
        *,
        accepted: Accepted | None = None,
        handoff: Handoff | None = None,
        add_headers: Sequence[tuple[bytes, bytes]] = (),
        from_proxy: bool = False,
    ) -> None:
        """Serves the connection (a raw accepted socket, or an established `handoff`) with the
        HTTP/1 or HTTP/2 engine; requests are routed by `router`. Access logs show the client
        as `labels.peer` (the stacks' accepted address). `from_proxy`: the client is a meshed
        peer's proxy (HttpConn.from_proxy)."""
        observer = None
        if self.observe is not None:
            observer = self.observe.connection(labels.direction, labels.peer or "-",
                                               labels.client_id)  # fmt: skip
        conn = HttpConn(
            sock=accepted.sock if accepted is not None else None,
            router=router,
            connect=self.connect,
            metrics=self.metrics,
            labels=labels,
            limits=self.inbound_limits if labels.direction == "inbound" else self.limits,
            closing=self.closing,
            add_headers=add_headers,
            handoff=handoff,
            accepted_at=accepted.at if accepted is not None else None,
            tcp=tcp,
            shedder=self.shedder,
            observer=observer,
            from_proxy=from_proxy,
        )
        from meshlet.proxy.http.h1 import serve_h1
        from meshlet.proxy.http.h1pool import H1Pool
        from meshlet.proxy.http.h2pool import H2Pool
        from meshlet.proxy.http.h2server import serve_h2

        if self._h2_pool is None or self._h1_pool is None:
            self._h2_pool = H2Pool(self.connect, self.limits)
            self._h1_pool = H1Pool(self.limits.pool_idle_timeout)
        if h2:
            await serve_h2(conn, self._h2_pool, h1_pool=self._h1_pool)
        else:
            await serve_h1(conn, self._h1_pool, self._h2_pool)

    # -- opaque TCP ---------------------------------------------------------------------

    async def relay(
        self,
        accepted: Accepted,
        endpoints: EndpointPicker,
        labels: ConnLabels,
        tcp: TcpConn,
        guard: relay.FirstBytesCheck | None = None,
    ) -> None:
        """Relays the connection to the endpoint `endpoints` picks; an endpoint that cannot be
        reached is skipped and another picked, as the failover policy says (then the client's
        connection is reset, as a failed connection looks to it). `guard` checks the client's
        first bytes (`relay.CheckedSide`)."""
        loop = asyncio.get_running_loop()
        client, upstream, done = relay.pair(loop, tcp, guard)
        opener = _Opener(self, accepted, labels.direction, upstream)
        att = Attempts(None, None, _OPAQUE, loop.time(),
                       RouteTarget("", DEFAULT_ROUTE, None, endpoints))  # fmt: skip
        await advance(att, opener, att.start(), loop.time)
        if not opener.connected:
            return
        lease = att.endpoint.lease if att.endpoint is not None else None
        if lease is not None:
            lease.responded()  # per connection: the connect time is the sample
        started = time.perf_counter()
        load = relay.RelayLoad(client, upstream)
        try:
            await loop.connect_accepted_socket(lambda: client, sock=accepted.sock)
            upstream.flush()
            client.flush()
            if self.shedder is not None:
                self.shedder.add(load, labels.direction)
            await done
        finally:
            if self.shedder is not None:
                self.shedder.remove(load)
            if lease is not None:
                lease.release()
            log.debug("relay closed after %.3fs", time.perf_counter() - started)


class _Opener:
    """The `attempts.Upstream` of an opaque connection: a connection to each endpoint tried,
    the client's connection reset when none can be reached (as a failed connection looks to
    it)."""

    def __init__(
        self,
        connections: Connections,
        accepted: Accepted,
        direction: str,
        upstream: relay.RelaySide,
    ) -> None:
        self._connections = connections
        self._accepted = accepted
        self._direction = direction
        self._upstream = upstream
        self.connected = False

    def gone(self) -> bool:
        return False  # the client is not read before a connection is made

    def routed(self, route: RouteTarget) -> None:
        pass

    def send(self, endpoint: Endpoint, fresh: bool) -> Wait:
        return Wait(self._connect, endpoint)

    async def _connect(self, endpoint: Endpoint) -> Failed | None:
        connections, upstream = self._connections, self._upstream
        upstream.tcp = connections.metrics.dst_conn(self._direction, endpoint.addr,
                                                    endpoint.labels)  # fmt: skip
        try:
            await (endpoint.connect or connections.connect)(endpoint.addr, lambda: upstream)
        except (OSError, TimeoutError) as exc:
            log.info("%s: connect to %s failed: %s", self._direction, endpoint.addr, exc)
            kind = Failure.CONNECT_TIMEOUT if isinstance(exc, TimeoutError) else Failure.CONNECT
            return Failed(kind, str(exc))
        upstream.tcp.open()
        self.connected = True
        return None

    def answer(self, status: int, reason: str) -> None:
        log.info("%s connection from %s refused: %s", self._direction, self._accepted.client,
                 reason)  # fmt: skip
        reset(self._accepted.sock)


def reset(sock: socket.socket) -> None:
    """Closes `sock` with a TCP reset, as a failed connection looks to the client."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()
