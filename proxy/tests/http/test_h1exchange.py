"""The HTTP/1.1 exchange machine without sockets: a scripted `Io` with its own clock plays the
client connection and the timer, the test plays the shell (carrying out each step of the
request's real `Attempts`: routing, picking, attaching), and each upstream is a real
`H1Upstream` on a transport that records what it is sent."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from meshlet.api.hostport import HostPort
from meshlet.proxy.core.failover import MAX_CONNECTS, Failure
from meshlet.proxy.core.retry_budget import RetryBudget
from meshlet.proxy.core.routes import DEFAULT_ROUTE, RoutePolicy
from meshlet.proxy.fixed_router import FixedPicker
from meshlet.proxy.http.attempts import AGAIN, Answer, Failed, Step
from meshlet.proxy.http.contract import (
    REPLAY_LIMIT,
    Addr,
    Endpoint,
    HttpLimits,
    RequestTarget,
    RouteError,
    RouteTarget,
)
from meshlet.proxy.http.h1client import H1Upstream
from meshlet.proxy.http.h1exchange import (
    LINGER_SECONDS,
    MAX_PIPELINED,
    Conn,
    Exchange,
    H1Machine,
    Parse,
    Req,
    Resp,
)
from meshlet.proxy.http.recorder import Recorder
from meshlet.proxy.metrics import ProxyMetrics
from meshlet_testing.lease import RecordingLease

POD: Addr = HostPort("10.0.0.7", 8080)
LIMITS = HttpLimits()
OK = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
FAILED = b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 4\r\n\r\nfail"


def get(path: str = "/", extra: bytes = b"") -> bytes:
    return b"GET " + path.encode() + b" HTTP/1.1\r\nHost: web:80\r\n" + extra + b"\r\n"


def post(body: bytes, extra: bytes = b"") -> bytes:
    head = b"POST /items HTTP/1.1\r\nHost: web:80\r\nContent-Length: %d\r\n" % len(body)
    return head + extra + b"\r\n" + body


def status_of(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])


def error_header(response: bytes) -> bytes:
    """The `meshlet-proxy-error` of a response (empty when it carries none)."""
    for line in response.split(b"\r\n\r\n", 1)[0].split(b"\r\n")[1:]:
        name, _, value = line.partition(b": ")
        if name.lower() == b"meshlet-proxy-error":
            return value
    return b""


async def no_connect(addr: Addr, factory: Callable[[], asyncio.Protocol]) -> Any:
    raise AssertionError("the machine never connects itself")


class Recording(asyncio.Transport):
    """An upstream connection's transport: what the proxy sent, and whether it closed it."""

    def __init__(self) -> None:
        super().__init__()
        self.sent = bytearray()
        self.closed = self.aborted = False
        self._reading = True

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.sent += data

    def writelines(self, list_of_data: Any) -> None:
        for data in list_of_data:
            self.sent += data

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.aborted = True

    def is_closing(self) -> bool:
        return self.closed or self.aborted

    def pause_reading(self) -> None:
        self._reading = False

    def resume_reading(self) -> None:
        self._reading = True

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass

    def is_reading(self) -> bool:
        return self._reading


class Upstream:
    """One upstream connection: the real protocol, fed the scripted server's bytes."""

    def __init__(self, reused: bool) -> None:
        self.protocol = H1Upstream(LIMITS)
        self.transport = Recording()
        self.protocol.connection_made(self.transport)
        self.protocol.reused = reused

    def respond(self, data: bytes) -> None:
        self.protocol.data_received(data)

    def lost(self, exc: Exception | None = None) -> None:
        self.protocol.connection_lost(exc)

    @property
    def request(self) -> bytes:
        return bytes(self.transport.sent)


class LeasingPicker:
    """Each pick of the one endpoint comes with a new lease."""

    def __init__(self) -> None:
        self.leases: list[RecordingLease] = []

    def pick(self, after: Endpoint | None = None) -> Endpoint:
        self.leases.append(RecordingLease())
        return Endpoint(POD, "web:80", lease=self.leases[-1])


class Router:
    """Routes every request to `target`, which the test sets."""

    def __init__(self) -> None:
        self.target: RouteTarget | RouteError = RouteError(500, "no route set")

    def route(self, request: RequestTarget) -> RouteTarget | RouteError:
        return self.target


class Client:
    """One client connection to the machine. The `Io` side records the machine's effects; the
    methods below play the shell's part, one event at a time."""

    def __init__(self, limits: HttpLimits = LIMITS, accepted_at: float | None = None) -> None:
        self.clock = 0.0
        self.written = bytearray()
        self.closes: list[float] = []  # each close asked, with its linger
        self.reset = False
        self._reading = True
        self.armed: float | None = None
        self.started: list[Exchange] = []
        self.steps: list[Step | None] = []  # the step each start asked for (None: the first)
        self.router = Router()
        self.given_back: list[tuple[H1Upstream, bool]] = []
        self.tunnelled: list[bytes] = []
        self.metrics = ProxyMetrics()
        recorder = Recorder(self.metrics, self.metrics.conn("outbound", "10.0.0.7:8080"))
        self.machine = H1Machine(self, limits, recorder, self.router, accepted_at=accepted_at)

    # -- Io ---------------------------------------------------------------------------------

    def now(self) -> float:
        return self.clock

    def write(self, chunks: list[bytes]) -> None:
        self.written += b"".join(chunks)

    def close(self, linger: float) -> None:
        self.closes.append(linger)

    def abort_client(self) -> None:
        self.reset = True

    def pause_reading(self) -> None:
        self._reading = False

    def resume_reading(self) -> None:
        self._reading = True

    def arm(self, when: float) -> None:
        self.armed = when

    def start(self, exchange: Exchange, step: Step | None) -> None:
        self.started.append(exchange)
        self.steps.append(step)

    def give_back(self, exchange: Exchange, upstream: H1Upstream, reusable: bool) -> None:
        self.given_back.append((upstream, reusable))

    def tunnel(self, exchange: Exchange, upstream: H1Upstream, rest: bytes) -> None:
        self.tunnelled.append(rest)

    # -- the test's side -------------------------------------------------------------------

    def in_flight(self) -> Exchange | None:
        return self.machine.current

    def conn(self) -> Conn:
        return self.machine.conn

    def parse(self) -> Parse:
        return self.machine.parse

    def is_reading(self) -> bool:
        return self._reading

    def send(self, data: bytes) -> None:
        self.machine.data(data)

    def received(self) -> bytes:
        """What the client was sent since the last call."""
        out = bytes(self.written)
        self.written.clear()
        return out

    def wait(self, until: float) -> None:
        """Time passes until `until`; the timer fires whenever it is due on the way."""
        while self.armed is not None and self.armed <= until:
            self.clock, self.armed = max(self.clock, self.armed), None
            self.machine.tick()
        self.clock = until

    @property
    def exchange(self) -> Exchange:
        """The exchange the shell was last asked to start."""
        return self.started[-1]

    @property
    def step(self) -> Step | None:
        """The step the shell was last asked to carry out."""
        return self.steps[-1]

    def route(self, target: RouteTarget | RouteError) -> Step:
        """Starts the exchange last started on its way to `target`, as the shell does: its
        Attempts route it (the machine is told), and pick."""
        ex = self.exchange
        self.router.target = target
        step = ex.att.start()
        if ex.att.route is not None:
            self.machine.routed(ex, ex.att.route)
        self.steps[-1] = step
        if isinstance(step, Answer):
            self.machine.answer(ex, step.status, step.reason)
        return step

    def connect(
        self,
        policy: RoutePolicy = DEFAULT_ROUTE,
        budget: RetryBudget | None = None,
        lease: RecordingLease | None = None,
        reused: bool = False,
    ) -> Upstream:
        """Carries out the step last asked for (routing first, when it is the first) by
        attaching the exchange to a new upstream connection, as the shell does."""
        step = self.step
        if step is None:
            picker = FixedPicker(Endpoint(POD, "web:80", lease=lease))
            step = self.route(RouteTarget("web:80", policy, budget, picker))
        assert isinstance(step, Endpoint) or step is AGAIN, step
        upstream = Upstream(reused)
        self.machine.attach(self.exchange, upstream.protocol, (no_connect, POD))
        self.exchange.att.sent()
        return upstream

    def connect_fails(self, failure: Failure, reason: str) -> bool:
        """The connection for the step last asked for fails: whether the Attempts try again
        (else the machine answers)."""
        ex = self.exchange
        step = ex.att.connect_failed(Failed(failure, reason))
        self.steps[-1] = step
        if isinstance(step, Answer):
            self.machine.answer(ex, step.status, step.reason)
            return False
        return True

    def count(self, name: str, **labels: str) -> float:
        """The sum of a metric's samples whose labels include `labels`."""
        return sum(
            sample.value
            for metric in self.metrics.registry.collect()
            for sample in metric.samples
            if sample.name == name and labels.items() <= sample.labels.items()
        )


def stage(ex: Exchange) -> tuple[Req, Resp]:
    """Where the exchange's request and response are."""
    return ex.req, ex.resp


def retryable(timeout: float | None = None) -> RoutePolicy:
    return RoutePolicy("GET /items", timeout=timeout, retryable=True)


def generous() -> RetryBudget:
    return RetryBudget(0.2, 100, 10, now=0.0)


def spent() -> RetryBudget:
    """A budget that allows no retry at all."""
    return RetryBudget(0.0, 0, 10, now=0.0)


# -- one exchange, event by event ------------------------------------------------------------


async def test_a_request_goes_through_its_states_and_the_connection_stays_open() -> None:
    client = Client()
    assert (client.conn(), client.parse()) == (Conn.OPEN, Parse.IDLE)
    client.send(b"GET /items/1 HTTP/1.1\r\nHost: web:80\r\n")
    assert client.parse() is Parse.HEAD and not client.started  # the head is unfinished
    client.send(b"Accept: */*\r\n\r\n")
    ex = client.exchange
    assert client.in_flight() is ex and client.parse() is Parse.IDLE
    assert stage(ex) == (Req.COMPLETE, Resp.WAITING)
    assert (ex.head.method, ex.head.path, ex.head.authority) == ("GET", "/items/1", "web:80")

    upstream = client.connect()
    assert upstream.request.startswith(b"GET /items/1 HTTP/1.1\r\nHost: web:80\r\n")
    assert b"Accept: */*\r\n" in upstream.request and upstream.request.endswith(b"\r\n\r\n")
    assert client.received() == b""  # nothing for the client until the upstream answers

    upstream.respond(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n")
    assert stage(ex)[1] is Resp.STREAMING
    assert client.received() == b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n"
    upstream.respond(b"ok")
    assert stage(ex)[1] is Resp.DONE and client.in_flight() is None
    assert client.received() == b"ok"
    assert client.given_back == [(upstream.protocol, True)]  # reusable: back to the pool
    assert client.conn() is Conn.OPEN and client.closes == []


@pytest.mark.parametrize(
    ("request_head", "response_says"),
    [
        (get(extra=b"Connection: close\r\n"), b"Connection: close"),
        (b"GET / HTTP/1.0\r\nHost: web:80\r\n\r\n", b"Connection: close"),
    ],
    ids=["close asked", "HTTP/1.0 without keep-alive"],
)
async def test_a_client_that_does_not_keep_the_connection_is_closed_after_its_response(
    request_head: bytes, response_says: bytes
) -> None:
    client = Client()
    client.send(request_head)
    client.connect().respond(OK)
    response = client.received()
    assert status_of(response) == 200 and response_says in response
    assert client.conn() is Conn.CLOSED and client.closes == [0.0]


async def test_an_http10_client_asking_keep_alive_keeps_the_connection() -> None:
    client = Client()
    client.send(b"GET / HTTP/1.0\r\nHost: web:80\r\nConnection: keep-alive\r\n\r\n")
    client.connect().respond(OK)
    assert b"Connection: keep-alive" in client.received()
    assert client.conn() is Conn.OPEN and client.closes == []


async def test_a_client_that_half_closes_after_its_request_still_gets_the_response() -> None:
    client = Client()
    client.send(get())
    assert client.machine.eof() is True  # keep the connection: the response is due
    client.connect().respond(OK)
    assert status_of(client.received()) == 200
    assert client.closes == [0.0]


async def test_a_half_close_with_nothing_in_flight_ends_the_connection() -> None:
    client = Client()
    assert client.machine.eof() is False
    client.send(get(extra=b"X-Partial: 1\r\n")[:-2])  # a head still arriving
    assert client.machine.eof() is False


@pytest.mark.parametrize(
    "head",
    [
        b"POST /items HTTP/1.1\r\nHost: web:80\r\nContent-Length: 1000000\r\n\r\n",
        b"POST /items HTTP/1.1\r\nHost: web:80\r\nTransfer-Encoding: chunked\r\n\r\n1\r\n",
    ],
)
async def test_a_half_close_in_the_middle_of_a_body_aborts_the_upstream_request(
    head: bytes,
) -> None:
    client = Client()
    client.send(head + b"x")
    upstream = client.connect()
    assert client.machine.eof() is False  # nothing more will come: the request cannot end
    assert upstream.transport.aborted  # the app sees the cancel, not a request held for ever
    response = client.received()
    assert status_of(response) == 400 and b"before the request body ended" in response
    assert client.closes and client.conn() in (Conn.LINGER, Conn.CLOSED)


async def test_a_half_close_mid_body_cuts_a_response_already_under_way() -> None:
    client = Client()
    client.send(b"POST /items HTTP/1.1\r\nHost: web:80\r\nContent-Length: 10\r\n\r\nab")
    upstream = client.connect()
    upstream.respond(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\npartial")
    assert status_of(client.received()) == 200
    assert client.machine.eof() is False
    assert upstream.transport.aborted and client.reset  # never passed off as complete


async def test_a_half_close_mid_body_after_a_whole_early_response_closes_gracefully() -> None:
    client = Client()
    client.send(b"POST /items HTTP/1.1\r\nHost: web:80\r\nContent-Length: 10\r\n\r\nab")
    upstream = client.connect()
    upstream.respond(b"HTTP/1.1 413 Payload Too Large\r\ncontent-length: 0\r\n\r\n")
    assert status_of(client.received()) == 413
    assert client.machine.eof() is False
    assert not client.reset and client.closes  # the whole response stays delivered


async def test_a_chunked_request_body_is_reframed_piece_by_piece() -> None:
    client = Client()
    client.send(b"POST / HTTP/1.1\r\nHost: web:80\r\nTransfer-Encoding: chunked\r\n\r\n")
    ex = client.exchange
    assert stage(ex)[0] is Req.BODY and client.parse() is Parse.BODY
    upstream = client.connect()
    client.send(b"3\r\nabc\r\n")
    assert upstream.request.endswith(b"Transfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n")
    client.send(b"0\r\n\r\n")
    assert upstream.request.endswith(b"3\r\nabc\r\n0\r\n\r\n")
    assert stage(ex)[0] is Req.COMPLETE


async def test_body_read_before_the_upstream_is_attached_goes_out_after_the_head() -> None:
    client = Client()
    client.send(post(b"hello"))
    upstream = client.connect()
    head, _, body = upstream.request.partition(b"\r\n\r\n")
    assert head.startswith(b"POST /items HTTP/1.1") and body == b"hello"


async def test_a_response_the_client_cannot_take_pauses_the_upstream() -> None:
    client = Client()
    client.send(get())
    upstream = client.connect()
    client.machine.write_paused()
    assert not upstream.transport.is_reading()
    client.machine.write_resumed()
    assert upstream.transport.is_reading()


async def test_an_upstream_that_cannot_take_the_body_pauses_the_client() -> None:
    client = Client()
    client.send(post(b"x" * 10)[:-10])  # the head only
    client.connect()
    client.machine.upstream_pause_writing()
    assert not client.is_reading()
    client.machine.upstream_resume_writing()
    assert client.is_reading()


# -- pipelining ------------------------------------------------------------------------------


async def test_pipelined_requests_are_started_one_at_a_time_and_answered_in_order() -> None:
    client = Client()
    client.send(get("/a") + get("/b") + get("/c"))
    assert [ex.head.path for ex in client.started] == ["/a"]  # the others wait their turn
    for path in ("/a", "/b", "/c"):
        assert client.exchange.head.path == path
        upstream = client.connect()
        upstream.respond(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n" + path.encode())
        assert client.received().endswith(path.encode())
    assert [ex.head.path for ex in client.started] == ["/a", "/b", "/c"]
    assert client.in_flight() is None and client.conn() is Conn.OPEN


async def test_bytes_of_a_next_request_pause_reading_until_the_response_in_flight_is_done() -> None:
    client = Client()
    client.send(get("/a"))
    upstream = client.connect()
    client.send(get("/b"))
    assert not client.is_reading() and len(client.started) == 1
    upstream.respond(OK)
    assert client.is_reading() and client.exchange.head.path == "/b"


async def test_more_pipelined_requests_than_allowed_get_503_after_the_responses_due() -> None:
    client = Client()
    client.send(get() * (MAX_PIPELINED + 2))  # one in flight, MAX_PIPELINED queued, one over
    response = b""
    for _ in range(MAX_PIPELINED + 1):
        assert client.closes == []
        client.connect().respond(OK)
        response = client.received()
        assert status_of(response) == 200
    assert len(client.started) == MAX_PIPELINED + 1
    refusal = response.split(b"\r\n\r\nok", 1)[1]  # right after the last response
    assert status_of(refusal) == 503 and b"pipelined" in error_header(refusal)
    assert client.conn() is Conn.LINGER and client.closes == [LINGER_SECONDS]


# -- 100-continue ----------------------------------------------------------------------------


async def test_100_continue_from_the_upstream_is_relayed_before_the_body() -> None:
    client = Client()
    client.send(post(b"12345", extra=b"Expect: 100-continue\r\n")[:-5])
    assert client.exchange.head.expect_continue
    upstream = client.connect()
    assert b"Expect: 100-continue" in upstream.request
    upstream.respond(b"HTTP/1.1 100 Continue\r\n\r\n")
    assert client.received() == b"HTTP/1.1 100 Continue\r\n\r\n"
    assert stage(client.exchange)[1] is Resp.WAITING  # an interim response is not the response
    client.send(b"12345")
    assert upstream.request.endswith(b"\r\n\r\n12345")
    upstream.respond(OK)
    assert status_of(client.received()) == 200


async def test_an_http10_client_gets_no_interim_response() -> None:
    client = Client()
    client.send(b"POST / HTTP/1.0\r\nHost: web:80\r\nContent-Length: 0\r\n\r\n")
    upstream = client.connect()
    upstream.respond(b"HTTP/1.1 100 Continue\r\n\r\n")
    assert client.received() == b""


# -- timeouts --------------------------------------------------------------------------------


async def test_a_head_not_received_in_time_is_answered_408_and_the_connection_closed() -> None:
    client = Client(HttpLimits(header_read_timeout=10.0))
    assert client.armed == 10.0  # from the start
    client.wait(5.0)
    client.send(b"GET / HTTP/1.1\r\nHost: web")  # trickled: the clock still runs from the start
    client.wait(9.9)
    assert client.received() == b""
    client.wait(10.0)
    response = client.received()
    assert status_of(response) == 408 and b"Connection: close" in response
    assert error_header(response) == b"request head not received within 10.0s"
    assert client.conn() is Conn.LINGER and client.closes == [LINGER_SECONDS]
    assert not client.started
    assert client.count("http_client_errors_total", status_code="408") == 1


async def test_the_first_head_is_due_from_the_accept_not_from_when_the_machine_starts() -> None:
    client = Client(HttpLimits(header_read_timeout=10.0), accepted_at=-4.0)
    assert client.armed == 6.0


async def test_a_later_head_is_due_from_its_first_byte() -> None:
    client = Client(HttpLimits(header_read_timeout=10.0, idle_timeout=60.0))
    client.send(get())
    client.connect().respond(OK)
    client.received()
    client.wait(30.0)  # idle between requests: no 408 for a head that has not begun
    assert client.closes == []
    client.send(b"GET / HTTP/1.1\r\n")
    client.wait(39.9)
    assert client.received() == b""
    client.wait(40.0)
    assert status_of(client.received()) == 408


async def test_an_idle_keep_alive_connection_is_closed_without_an_answer() -> None:
    client = Client(HttpLimits(idle_timeout=5.0))
    client.send(get())
    client.connect().respond(OK)
    client.received()
    client.wait(4.9)
    assert client.closes == []
    client.wait(5.0)
    assert client.received() == b"" and client.closes == [0.0]
    assert client.conn() is Conn.CLOSED


async def test_a_quiet_response_is_relayed_whole_however_long_it_is_quiet() -> None:
    """A watch, a long poll, `logs -f`: the head and a first chunk, then an hour of nothing,
    then the rest. No default timer cuts a request in flight."""
    client = Client()
    client.send(get("/watch"))
    upstream = client.connect()
    upstream.respond(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nfirst\r\n")
    assert client.received().endswith(b"5\r\nfirst\r\n")
    client.wait(3600.0)
    assert client.received() == b"" and not client.reset and not upstream.transport.aborted
    upstream.respond(b"4\r\nlast\r\n0\r\n\r\n")
    assert client.received() == b"4\r\nlast\r\n0\r\n\r\n"
    assert client.conn() is Conn.OPEN and client.in_flight() is None


async def test_a_quiet_request_body_and_a_long_wait_for_the_head_are_not_cut() -> None:
    client = Client()
    client.send(post(b"x" * 100_000)[:-100_000])  # the head only: a client stream, quiet
    upstream = client.connect()
    client.wait(3600.0)
    client.send(b"x" * 100_000)
    client.wait(7200.0)  # a long poll: the upstream answers when it has something
    assert client.received() == b"" and not upstream.transport.aborted
    upstream.respond(OK)
    assert status_of(client.received()) == 200


async def test_the_idle_timer_runs_again_once_the_request_is_done() -> None:
    client = Client(HttpLimits(idle_timeout=5.0))
    client.send(get())
    upstream = client.connect()
    client.wait(100.0)  # a quiet request: not the connection's idle time
    upstream.respond(OK)
    client.received()
    client.wait(104.9)
    assert client.closes == []
    client.wait(105.0)
    assert client.closes == [0.0]


IDLE = HttpLimits(stream_idle_timeout=30.0)


async def test_opt_in_stream_idle_a_stalled_body_gets_408() -> None:
    client = Client(IDLE)
    client.send(post(b"x" * 100)[:-90])
    upstream = client.connect()
    client.wait(29.0)
    client.send(b"x" * 5)  # a byte keeps it alive
    client.wait(58.9)
    assert client.received() == b""
    client.wait(59.0)
    response = client.received()
    assert status_of(response) == 408
    assert (
        error_header(response)
        == b"request body stalled: no bytes either way for 30s (the idle timeout)"
    )
    assert upstream.transport.aborted  # the upstream never sees the request complete


async def test_opt_in_stream_idle_an_unanswered_request_gets_504() -> None:
    client = Client(IDLE)
    client.send(get())
    upstream = client.connect()
    client.wait(30.0)
    response = client.received()
    assert status_of(response) == 504 and b"no response" in error_header(response)
    assert upstream.transport.aborted  # the upstream sees the cancel
    assert client.conn() is Conn.OPEN  # the connection is kept


async def test_opt_in_stream_idle_a_quiet_response_is_cut() -> None:
    client = Client(IDLE)
    client.send(get())
    upstream = client.connect()
    upstream.respond(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nhalf")
    client.received()
    client.wait(30.0)
    assert client.reset and upstream.transport.aborted  # never passed off as complete


async def test_a_routes_idle_timeout_wins_over_the_workloads() -> None:
    client = Client(IDLE)
    client.send(get())
    upstream = client.connect(RoutePolicy("GET /watch", idle_timeout=600.0))
    client.wait(599.0)
    assert client.received() == b"" and not upstream.transport.aborted
    client.wait(600.0)
    assert status_of(client.received()) == 504
    quiet = Client()  # no workload setting: the route's alone
    quiet.send(get())
    quiet.connect(RoutePolicy("GET /items", idle_timeout=2.0))
    quiet.wait(2.0)
    assert status_of(quiet.received()) == 504


async def test_a_route_timeout_answers_504_and_closes_the_upstream_connection() -> None:
    client = Client()
    client.send(get("/items/1"))
    upstream = client.connect(retryable(timeout=1.5))
    assert client.armed == 1.5
    client.wait(1.4)
    assert client.received() == b""
    client.wait(1.5)
    response = client.received()
    assert status_of(response) == 504
    assert error_header(response) == b"the route's timeout of 1.5s passed"
    assert upstream.transport.aborted  # the upstream sees the cancel
    assert client.conn() is Conn.OPEN and client.in_flight() is None  # kept
    assert client.count("route_response_total", rt_route="GET /items", status_code="504") == 1


async def test_a_response_head_in_time_disarms_the_route_timeout() -> None:
    client = Client()
    client.send(get())
    upstream = client.connect(retryable(timeout=1.0))
    upstream.respond(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n")
    client.wait(5.0)  # the body takes its time: the route's timeout covers the head only
    upstream.respond(b"ok")
    response = client.received()
    assert status_of(response) == 200 and response.endswith(b"ok")


async def test_the_route_timeout_covers_the_retries() -> None:
    client = Client()
    client.send(get())
    client.connect(retryable(timeout=1.0), generous()).respond(FAILED)
    client.wait(0.5)
    assert len(client.started) == 2  # retried
    second = client.connect()
    client.wait(1.0)
    assert status_of(client.received()) == 504
    assert second.transport.aborted


# -- retries ---------------------------------------------------------------------------------


async def test_a_failure_status_on_a_retryable_route_is_retried_and_never_seen() -> None:
    client = Client()
    client.send(post(b"payload"))
    first = client.connect(retryable(), generous())
    first.respond(FAILED)
    assert client.received() == b""  # the 500 never reaches the client
    assert first.transport.aborted
    assert len(client.started) == 2 and isinstance(client.step, Endpoint)  # picked again
    second = client.connect()
    assert second.request == first.request  # the head and the body, replayed
    second.respond(OK)
    assert status_of(client.received()) == 200
    assert client.count("route_actual_request_total") == 2
    assert client.count("route_actual_response_total", status_code="500") == 1
    assert client.count("route_response_total", status_code="200") == 1
    assert client.count("route_response_total", status_code="500") == 0


async def test_a_retryable_route_gives_up_after_three_attempts_with_the_last_response() -> None:
    client = Client()
    client.send(get())
    for _ in range(3):
        client.connect(retryable(), generous()).respond(FAILED)
    assert len(client.started) == 3
    response = client.received()
    assert status_of(response) == 500 and response.endswith(b"fail")
    assert error_header(response) == b""  # the upstream's own response


async def test_without_budget_left_the_failure_is_passed_and_the_skip_counted() -> None:
    client = Client()
    client.send(get())
    client.connect(retryable(), spent()).respond(FAILED)
    assert len(client.started) == 1
    assert status_of(client.received()) == 500
    assert client.count("retry_skipped_total", rt_route="GET /items") == 1


async def test_a_route_that_is_not_retryable_passes_failure_statuses() -> None:
    client = Client()
    client.send(get())
    client.connect(DEFAULT_ROUTE, generous()).respond(FAILED)
    assert len(client.started) == 1 and status_of(client.received()) == 500


@pytest.mark.parametrize(
    ("size", "retried"),
    [(REPLAY_LIMIT, True), (REPLAY_LIMIT + 1, False)],
    ids=["64 KiB: kept", "over 64 KiB: not kept"],
)
async def test_a_request_is_replayed_only_when_its_body_fits_the_replay_limit(
    size: int, retried: bool
) -> None:
    client = Client()
    body = b"b" * size
    client.send(post(body)[:-size])
    first = client.connect(retryable(), generous())
    client.send(body)  # sent as it arrives, and kept while it fits
    first.respond(FAILED)
    assert (len(client.started) == 2) is retried
    if retried:
        second = client.connect()
        assert second.request.endswith(b"\r\n\r\n" + body)
        second.respond(OK)
        assert status_of(client.received()) == 200
    else:
        assert status_of(client.received()) == 500


async def test_nothing_is_retried_once_a_response_byte_went_to_the_client() -> None:
    client = Client()
    client.send(get())
    lease = RecordingLease()
    upstream = client.connect(retryable(), generous(), lease)
    upstream.respond(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nhalf")
    upstream.lost(ConnectionResetError())
    assert len(client.started) == 1
    assert client.reset  # cut, never presented as complete
    assert client.conn() is Conn.CLOSED
    assert lease.events == ["responded", "release"]


async def test_a_reset_before_any_response_byte_retries_an_idempotent_request_once() -> None:
    client = Client()
    client.send(get())
    client.connect().lost(ConnectionResetError("reset"))
    assert len(client.started) == 2  # GET: once more, even on the default route
    client.connect().lost(ConnectionResetError("reset"))
    response = client.received()
    assert status_of(response) == 502
    assert error_header(response) == b"the upstream connection failed before responding: reset"


async def test_a_reset_before_any_response_byte_is_502_for_a_post_on_the_default_route() -> None:
    client = Client()
    client.send(post(b"once"))
    client.connect().lost(None)
    assert len(client.started) == 1
    response = client.received()
    assert status_of(response) == 502
    assert error_header(response) == b"the upstream closed the connection before responding"


async def test_a_stale_pooled_connection_is_retried_once_on_a_fresh_one_to_the_same_endpoint() -> (
    None
):
    client = Client()
    client.send(post(b"once"))
    lease = RecordingLease()
    stale = client.connect(lease=lease, reused=True)
    stale.lost(None)  # closed before any byte: the pool had kept a dead connection
    assert len(client.started) == 2 and client.step is AGAIN
    assert lease.events == []  # the same endpoint, the same lease
    fresh = client.connect()
    assert fresh.request == stale.request
    fresh.respond(OK)
    assert status_of(client.received()) == 200


# -- errors and their statuses ---------------------------------------------------------------


async def test_a_route_error_is_answered_with_its_status_and_the_connection_kept() -> None:
    client = Client()
    client.send(get())
    client.route(RouteError(503, "web:80 has no endpoints"))
    response = client.received()
    assert status_of(response) == 503 and error_header(response) == b"web:80 has no endpoints"
    assert b"Connection: close" not in response
    assert client.conn() is Conn.OPEN and client.in_flight() is None
    assert client.count("request_total", authority="web:80") == 1


async def test_a_route_error_with_a_body_still_to_come_drains_it_when_small() -> None:
    client = Client()
    client.send(post(b"12345")[:-5])
    client.route(RouteError(403, "a routing loop"))
    assert status_of(client.received()) == 403
    assert stage(client.exchange)[0] is Req.DISCARD
    client.send(b"12345" + get("/next"))  # the rest is read and dropped, then the next one
    assert client.exchange.head.path == "/next"
    assert client.conn() is Conn.OPEN


async def test_a_route_error_with_a_body_it_cannot_drain_closes_the_connection() -> None:
    client = Client()
    client.send(post(b"12345", extra=b"Expect: 100-continue\r\n")[:-5])
    client.route(RouteError(503, "no endpoints"))
    response = client.received()
    assert status_of(response) == 503 and b"Connection: close" in response
    assert client.conn() is Conn.LINGER


@pytest.mark.parametrize(
    ("failure", "status"), [(Failure.CONNECT, 502), (Failure.CONNECT_TIMEOUT, 504)]
)
async def test_a_failed_connection_is_answered_502_or_504_for_a_timeout(
    failure: Failure, status: int
) -> None:
    client = Client()
    client.send(get())
    client.route(RouteTarget("web:80", DEFAULT_ROUTE, None, FixedPicker(Endpoint(POD, "web:80"))))
    assert client.connect_fails(failure, "connecting to 10.0.0.7:8080 failed") is False
    response = client.received()
    assert status_of(response) == status
    assert error_header(response) == b"connecting to 10.0.0.7:8080 failed"


async def test_a_balanced_endpoint_that_cannot_be_reached_is_skipped_up_to_the_limit() -> None:
    client = Client()
    client.send(get())
    picker = LeasingPicker()
    client.route(RouteTarget("web:80", DEFAULT_ROUTE, None, picker))
    again = [client.connect_fails(Failure.CONNECT, "refused") for _ in range(MAX_CONNECTS)]
    assert again == [True] * (MAX_CONNECTS - 1) + [False]
    assert [lease.events[0] for lease in picker.leases] == ["failed"] * MAX_CONNECTS
    assert status_of(client.received()) == 502


@pytest.mark.parametrize(
    ("response", "reason"),
    [
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n", b"upstream used a transfer"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n", b"the upstream connection failed"),
        (b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: ws\r\n\r\n", b"upstream switched"),
    ],
    ids=["transfer coding", "malformed", "101 not asked for"],
)
async def test_an_invalid_upstream_response_is_502(response: bytes, reason: bytes) -> None:
    client = Client()
    client.send(post(b"once"))
    upstream = client.connect()
    upstream.respond(response)
    answer = client.received()
    assert status_of(answer) == 502
    assert error_header(answer).startswith(reason)
    assert upstream.transport.aborted


@pytest.mark.parametrize(
    ("data", "status"),
    [
        (b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400),
        (b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\n\r\n", 414),
        (b"GET / HTTP/1.1\r\n" + b"X: y\r\n" * 101 + b"\r\n", 431),
        (b"POST / HTTP/1.1\r\nTransfer-Encoding: gzip, chunked\r\n\r\n", 501),
        (b"GET / HTTP/2.0\r\n\r\n", 505),
        (b"CONNECT web:443 HTTP/1.1\r\n\r\n", 405),
        (b"GET / HTTP/1.1\r\nbad header\r\n\r\n", 400),
    ],
    ids=["two hosts", "long target", "many fields", "gzip", "HTTP/2.0", "CONNECT", "syntax"],
)
async def test_hostile_heads_are_refused_with_their_status_and_nothing_is_started(
    data: bytes, status: int
) -> None:
    client = Client()
    client.send(data)
    response = client.received()
    assert status_of(response) == status and b"Connection: close" in response
    assert error_header(response)
    assert not client.started
    assert client.conn() is Conn.LINGER and client.closes == [LINGER_SECONDS]
    client.send(get())  # what follows is dropped
    assert not client.started and client.received() == b""


async def test_a_bad_chunk_after_the_head_was_forwarded_aborts_the_upstream() -> None:
    client = Client()
    client.send(b"POST / HTTP/1.1\r\nHost: web:80\r\nTransfer-Encoding: chunked\r\n\r\n")
    upstream = client.connect()
    client.send(b"zz\r\n")
    assert status_of(client.received()) == 400
    assert upstream.transport.aborted


# -- the connection's end --------------------------------------------------------------------


async def test_a_lost_client_aborts_the_upstream_and_releases_the_lease() -> None:
    client = Client()
    client.send(get())
    lease = RecordingLease()
    upstream = client.connect(lease=lease)
    client.machine.lost()
    assert upstream.transport.aborted and lease.events == ["release"]
    assert client.conn() is Conn.CLOSED
    assert client.machine.abandoned(client.exchange)


async def test_shutdown_closes_an_idle_connection_at_once() -> None:
    client = Client()
    client.machine.shutdown()
    assert client.closes == [0.0] and client.conn() is Conn.CLOSED


async def test_shutdown_lets_the_exchange_in_flight_finish_with_connection_close() -> None:
    client = Client()
    client.send(get())
    upstream = client.connect()
    client.machine.shutdown()
    assert client.closes == []
    upstream.respond(OK)
    response = client.received()
    assert status_of(response) == 200 and b"Connection: close" in response
    assert client.closes == [0.0]


async def test_a_101_hands_both_connections_to_the_tunnel() -> None:
    client = Client()
    client.send(get(extra=b"Connection: upgrade\r\nUpgrade: websocket\r\n") + b"early")
    assert client.exchange.head.upgrade
    upstream = client.connect()
    assert upstream.request.endswith(b"\r\n\r\nearly")  # relayed as is after the head
    upstream.respond(b"HTTP/1.1 101 Switching Protocols\r\nConnection: upgrade\r\n"
                     b"Upgrade: websocket\r\n\r\nserver-first")  # fmt: skip
    assert status_of(client.received()) == 101
    assert client.tunnelled == [b"server-first"]
    assert client.conn() is Conn.TUNNEL and client.in_flight() is None
