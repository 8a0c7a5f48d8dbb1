"""What the HTTP engines (h1, h2) need from the rest of the proxy, and what they report.

An engine serves one accepted connection: a raw socket it attaches to (with TLS when `ssl` is
set), or a connection that already exists (`handoff`: e.g. mTLS the mesh inbound terminated and
whose transport header it read). For each request it asks `route(authority)` where the
request goes, takes a connection to that endpoint from its pool (whose `connect` the caller
supplies: plain TCP today, mTLS with a transport header between meshed proxies), relays the
request and the response as streams, and records metrics (`RequestMetrics`: the app's registry
behind a port the engines define). It never decides where traffic goes.
"""

from __future__ import annotations

import asyncio
import enum
import ssl
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, NamedTuple, Protocol, TypeVar

from meshlet.api import wellknown
from meshlet.api.hostport import HostPort
from meshlet.api.target import EscapedSlashes
from meshlet.proxy.core.header_modifier import HeaderModifier
from meshlet.proxy.core.pressure import Peer
from meshlet.proxy.core.retry_budget import RetryBudget
from meshlet.proxy.core.routes import RoutePolicy
from meshlet.proxy.io.counters import ConnLabels, CounterFamily, HistogramFamily, TcpConn, Values

if TYPE_CHECKING:
    from meshlet.proxy.http.observe import ConnObserver
    from meshlet.proxy.http.route_series import BackendSeries

Addr = HostPort  # printed as host:port, [v6]:port
T = TypeVar("T")


class Lease(Protocol):
    """A balancer's claim on the endpoint of one request (outbound/balance.py)."""

    @property
    def endpoint(self) -> object:
        """The endpoint as the balancer knows it (what a retry's pick avoids)."""

    def responded(self) -> None:
        """The first response byte arrived."""

    def release(self) -> None:
        """The request is over, whatever its outcome (idempotent)."""

    def failed(self) -> None:
        """The endpoint could not be reached and nothing was sent: the balancer skips it for a
        while (the request may be routed again)."""

    def outcome(self, success: bool) -> None:
        """The attempt's outcome, for failure accrual (the first report counts; a no-op when
        the balancer has none)."""


class Endpoint(NamedTuple):
    """Where one request goes. The values made for every request are NamedTuples: as
    immutable as frozen dataclasses, and made in a third of the time."""

    addr: Addr
    authority_label: str  # bounded; used as the `authority` metric label
    # How to reach it when not over plain TCP: set only for a meshed endpoint, reached through
    # its proxy over mTLS (whose `meshlet-proxy-error` responses are then relayed as they are);
    # pools key on it.
    connect: Connect | None = None
    lease: Lease | None = None  # told of the first response byte and of the request's end
    # The request's metric labels when they are not the client connection's: an outbound
    # endpoint's own `target_addr`, `tls` and `server_id` (ConnLabels.values()).
    labels: Values | None = None
    # How to reach it with an HTTP/2 session, set for a meshed endpoint whose proxy takes
    # HTTP/2 (the destination's protocol hint): HTTP/1.1 requests then go as streams on one
    # multiplexed connection (`meshlet-orig-proto`, http/orig_proto.py).
    h2: Connect | None = None


class RouteError(NamedTuple):
    """A request that cannot be routed: answered locally with `status` and the
    `meshlet-proxy-error` header carrying `reason`."""

    status: int  # 400 (no authority), 403 (loop), 502, 503 (no endpoints)
    reason: str


class Redirection(str):
    """A RouteError's reason that is where a route redirects the request: the engines answer
    with it as the `Location` of the local (3xx) response, without an error header. A str, so
    that it reaches the engines as any reason does."""

    __slots__ = ()


class GrpcFailure(str):
    """A RouteError's reason for a gRPC request that carries the gRPC status to answer with
    (`code`, e.g. "2"), where the HTTP status alone would say UNAVAILABLE: a route's failure
    injector names its code. A str, as `Redirection` is."""

    code: str

    def __new__(cls, reason: str, code: int) -> GrpcFailure:
        made = super().__new__(cls, reason)
        made.code = str(code)
        return made


class RequestTarget(Protocol):
    """What a request names, as its router needs it: the engines' request heads are ones
    (h1head.RequestHead, h2headers.Request), so routing one costs no copy."""

    @property
    def authority(self) -> str | None:
        """The absolute-form host, Host, or :authority."""

    @property
    def method(self) -> str: ...

    @property
    def path(self) -> str:
        """With the query."""


class Target(NamedTuple):
    """A RequestTarget of its own (the opaque relay's; tests')."""

    authority: str | None
    method: str
    path: str


class Wait(NamedTuple):
    """An answer that needs waiting (for discovery, a name lookup, a connection): await
    `call(arg)` for it. Every routing question is one synchronous call that answers at once
    (the common case: the engines then need no task for the request) or returns a Wait."""

    call: Callable[[Any], Awaitable[Any]]
    arg: Any


class Later(enum.Enum):
    """`Upstream.send`'s answer for a request waiting in line without a task (h2pool.Queued):
    the engine learns later that it was sent, or why not."""

    QUEUED = "queued"


QUEUED: Final = Later.QUEUED


async def settle(answer: T | Wait) -> T:
    """The answer, waited for when it is a Wait."""
    while isinstance(answer, Wait):
        answer = await answer.call(answer.arg)
    return answer


class EndpointPicker(Protocol):
    """Where each attempt of a request goes (a balanced pick, or a fixed endpoint). `after`
    is where the request's previous attempt went: a balanced pick avoids it while another
    endpoint is left, so a retry goes elsewhere."""

    def pick(self, after: Endpoint | None = None) -> Endpoint | RouteError | Wait: ...


class RouteTarget(NamedTuple):
    """A request's route: the service it is for (`dst`, a bounded label), the route's policy
    (timeout, retries, classification, `rt_route`), the service's retry budget (None: no
    retries but a connection's), what picks an endpoint for each attempt, and the change the
    route's filters make to the request's headers (None: none; each engine applies it to the
    head it forwards, once, when the request is routed) and to the headers of the response
    the upstream sends back (not to the proxy's own answers); an outbound policy's route
    backend also carries its Linkerd route metrics (`series`; None: not such a route)."""

    dst: str
    policy: RoutePolicy
    budget: RetryBudget | None
    endpoints: EndpointPicker
    request_headers: HeaderModifier | None = None
    response_headers: HeaderModifier | None = None
    series: BackendSeries | None = None


class Router(Protocol):
    """What an engine asks where requests go; each stack provides one per connection."""

    def route(self, request: RequestTarget) -> RouteTarget | RouteError | Wait:
        """The route; a Wait while discovery or a name lookup has not answered."""


class Tapped(Protocol):
    """A request some taps took (tap/taps.py): told its response head, then its end, once
    each."""

    def responded(self, status: int, latency_ms: float | None) -> None:
        """The response head the client got (`status` 0: none went; `latency_ms`: from the
        request's arrival to the head)."""

    def ended(self, grpc_status: str | None, failed: bool, response_bytes: int) -> None:
        """The exchange is over: `response_bytes` of response body went to the client;
        `failed`: cut short, or never answered."""


class Tapping(Protocol):
    """The proxy's taps (tap/taps.py), as the request driver sees them."""

    @property
    def open(self) -> bool:
        """A tap is open (else nothing else is asked)."""

    def request(
        self,
        target: RequestTarget,
        direction: str,
        labels: ConnLabels,
        endpoint: Endpoint | None,
        route: RouteTarget | None,
    ) -> Tapped | None:
        """The taps that take a routed request (its RequestInit queued on each), or None."""


class Recording(Protocol):
    """What the engines record of each request (http/recorder.py, on the proxy's metrics)."""

    @property
    def taps(self) -> Tapping:
        """The proxy's taps: the driver reads `taps.open` once per request, and only with a
        tap open asks `tap` for the taps that take the request."""

    def tap(
        self, target: RequestTarget, endpoint: Endpoint | None, route: RouteTarget | None
    ) -> Tapped | None:
        """The taps that take a request (its RequestInit queued on each), or None."""

    # Access logs and spans for the connection's requests (http/observe.py); None: neither.
    observer: ConnObserver | None

    def authority_label(self, authority: str) -> str:
        """The bounded `authority` label of a request's authority."""

    def request(self, authority: str, endpoint: Endpoint | None, route: RouteTarget | None) -> None:
        """A request was routed (or refused by its route)."""

    def response(
        self,
        authority: str,
        endpoint: Endpoint | None,
        route: RouteTarget | None,
        status: int,
        grpc_status: str | None,
        latency_ms: float | None,
        failed: bool = False,
        classified: str = "",
        error: str = "",
        trailers: bool = False,
    ) -> str:
        """The response the client got (`failed`: cut short; `classified`: its class, when
        already known; `error`: the proxy answered, for this reason; `trailers`: the
        upstream's head had no gRPC status); its classification."""

    def attempt(self, route: RouteTarget) -> None:
        """The request was (at least partly) sent upstream."""

    def attempt_response(
        self, route: RouteTarget, status: int, grpc_status: str | None, seconds: float = 0.0
    ) -> str:
        """A response came back from upstream (given to the client or retried), `seconds`
        after its attempt began; its class."""

    def retry_skipped(self, route: RouteTarget) -> None:
        """The retry budget refused a retry."""

    def error(self, label: str) -> None:
        """A request or connection refused for its input."""


class RequestMetrics(Protocol):
    """What the engines record (`metrics.ProxyMetrics` provides it): the request, response and
    route families (http/recorder.py writes them), bounded authority labels, and the counts of
    each connection opened to an endpoint."""

    @property
    def request_total(self) -> CounterFamily: ...
    @property
    def response_total(self) -> CounterFamily: ...
    @property
    def response_latency_ms(self) -> HistogramFamily: ...
    @property
    def route_request_total(self) -> CounterFamily: ...
    @property
    def route_response_total(self) -> CounterFamily: ...
    @property
    def route_response_latency_ms(self) -> HistogramFamily: ...
    @property
    def route_actual_request_total(self) -> CounterFamily: ...
    @property
    def route_actual_response_total(self) -> CounterFamily: ...
    @property
    def retry_skipped_total(self) -> CounterFamily: ...
    @property
    def http_errors_total(self) -> CounterFamily: ...
    @property
    def taps(self) -> Tapping: ...

    def authority_label(self, authority: str) -> str:
        """`authority` as a metric label (past a bound of distinct values: `overflow`)."""

    def dst_conn(self, direction: str, addr: Addr, labels: Values | None) -> TcpConn:
        """The counts of a connection the proxy opens to `addr` (`peer="dst"`), with the
        endpoint's `labels` (None: a plain connection)."""


# Opens a transport to an endpoint with the given protocol factory (plain TCP by default).
Connect = Callable[
    [Addr, Callable[[], asyncio.Protocol]], Awaitable[tuple[asyncio.Transport, asyncio.Protocol]]
]


class Shedder(Protocol):
    """Where a served client connection registers while it lives, so that it can be shed under
    pressure (io/shedder.py)."""

    def add(self, peer: Peer, direction: str) -> None: ...

    def remove(self, peer: Peer) -> None: ...


class Handoff(Protocol):
    """An established connection waiting, its reading paused, for the protocol that serves it."""

    def adopt(self, protocol: asyncio.Protocol) -> None:
        """Makes `protocol` the connection's protocol: `connection_made`, reading resumed, then
        `data_received` with the bytes read past what the previous owner consumed (so a protocol
        that pauses on them stays paused); a close that happened meanwhile is passed on."""


# Request bytes kept, once sent, so that the request can be sent again (a retry, or a stale
# pooled connection): past this a request is not replayable (ServiceProfile retries say 64 KiB).
REPLAY_LIMIT: Final = 64 * 1024

# Informational (1xx) heads relayed before one final response: past this the upstream is
# flooding (a 100 Continue and a few 103 Early Hints are what servers send), and the response
# fails as invalid (502, or a reset on HTTP/2).
MAX_INFORMATIONAL: Final = 10

PROXY_ERROR_HEADER: Final = wellknown.PROXY_ERROR_HEADER.encode()
CLIENT_ID_HEADER: Final = wellknown.CLIENT_ID_HEADER.encode()
ORIG_PROTO_HEADER: Final = wellknown.ORIG_PROTO_HEADER.encode()
# Headers only a proxy may put on a response (its own errors): removed from every response
# that did not come from a peer proxy over mTLS (an app's, an unmeshed upstream's).
PROXY_RESPONSE_HEADERS: Final = frozenset(
    {PROXY_ERROR_HEADER, wellknown.LINKERD_PROXY_ERROR_HEADER.encode()}
)
# Headers a client may never set: the proxy alone speaks them (Linkerd's names included).
INTERNAL_HEADERS: Final = frozenset(
    {
        CLIENT_ID_HEADER,
        wellknown.LINKERD_CLIENT_ID_HEADER.encode(),
        *PROXY_RESPONSE_HEADERS,
        ORIG_PROTO_HEADER,
        wellknown.LINKERD_ORIG_PROTO_HEADER.encode(),
        b"l5d-dst-canonical",
    }
)


@dataclass(frozen=True, slots=True)
class HttpLimits:
    max_header_bytes: int = 64 * 1024
    max_headers: int = 100
    header_read_timeout: float = 10.0  # a request head must arrive within this
    # A connection with no request in flight (an idle keep-alive connection, an HTTP/2
    # connection without streams) is closed after this long without a byte either way. A
    # request in flight is never cut for being quiet, unless `stream_idle_timeout` says so.
    idle_timeout: float = 60.0
    # Opt-in (None: off): a request in flight during which no byte moved either way for this
    # long is ended (408 while its body is due, 504 while its response is awaited, a cut
    # connection or stream once the response began). A route's own idle timeout wins.
    stream_idle_timeout: float | None = None
    connect_timeout: float = 1.0
    pool_idle_timeout: float = 3.0  # idle upstream HTTP/1 connections kept this long
    max_concurrent_streams: int = 100  # HTTP/2
    max_body_buffer: int = 256 * 1024  # bytes buffered per stream before reading pauses
    # What a request path's `%2F` and `%5C` become (meshlet.api.target): kept, refused or decoded.
    escaped_slashes: EscapedSlashes = EscapedSlashes.KEEP


@dataclass(frozen=True, slots=True)
class HttpConn:
    """Everything an engine needs for one accepted connection."""

    sock: object  # the accepted socket.socket (unused with `handoff`)
    router: Router
    connect: Connect
    metrics: RequestMetrics
    labels: ConnLabels
    limits: HttpLimits
    closing: asyncio.Event  # set at shutdown: finish in-flight requests, then close
    ssl: ssl.SSLContext | None = None  # terminate TLS on accept (inbound mTLS)
    # Headers added to every request forwarded (e.g. meshlet-client-id for inbound mTLS).
    add_headers: Sequence[tuple[bytes, bytes]] = field(default_factory=tuple)
    # Serve this established connection instead of attaching to `sock` (`ssl` is then unused).
    handoff: Handoff | None = None
    # The loop time the client connected: the first request head is due `header_read_timeout`
    # after it, however long detection waited (None: from when the engine starts).
    accepted_at: float | None = None
    # The client connection's counts (`Connections.counted`); None: not counted.
    tcp: TcpConn | None = None
    # Registers the connection for load shedding while it lives (None: never shed).
    shedder: Shedder | None = None
    # Access logs and spans of its requests (None: neither, the default).
    observer: ConnObserver | None = None
    # The client is a meshed peer's proxy (a verified mTLS session): its HTTP/2 requests
    # marked `meshlet-orig-proto` go to the app as the HTTP/1.1 requests they were.
    from_proxy: bool = False


def location_value(location: str) -> bytes:
    """A header-safe `Location` value (what is not printable ASCII percent-encoded)."""
    return "".join(
        c if 0x21 <= ord(c) <= 0x7E else "".join(f"%{b:02X}" for b in c.encode()) for c in location
    ).encode("ascii")[:2048]


def error_reason(text: str) -> bytes:
    """A header-safe `meshlet-proxy-error` value."""
    return text.encode("ascii", "replace")[:200].translate(None, b"\r\n\x00")
