"""An outbound target's policy as the router reads it (Linkerd's `ClientPolicy`,
linkerd2-proxy `proxy/client-policy`): the protocol to speak, the routes a request may take, and
for each rule where its requests go (a distribution over backends), how they are retried and
timed out, and how each backend finds and balances its endpoints.

Every value is frozen and checked when it is built from the policy controller's message
(`discovery/outbound_decode.py`), so the router never meets a half-valid policy: a route's
matches are the inbound ones (`core.authz.HttpMatch`, `GrpcMatch`, `HostMatch`, regexes compiled
by RE2), a distribution is never empty unless it says so, and a weighted one has a positive
total. Durations are seconds (float).
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field, replace
from typing import Final

from meshlet.proxy.core.authz import GrpcMatch, HostMatch, HttpMatch
from meshlet.proxy.core.endpoints import DiscoveredEndpoint
from meshlet.proxy.core.header_modifier import HeaderModifier
from meshlet.proxy.core.route_index import RouteTable


@dataclass(frozen=True, slots=True)
class PolicyRef:
    """Where a policy object comes from (Linkerd's outbound `Meta`): a resource, or a default
    the controller names (`kind` "default", nothing else but the name)."""

    kind: str
    name: str
    group: str = ""
    namespace: str = ""
    section: str = ""
    port: int = 0

    @classmethod
    def default(cls, name: str) -> PolicyRef:
        return cls("default", name)

    def __str__(self) -> str:
        where = f"{self.namespace}/" if self.namespace else ""
        kind = f"{self.kind}.{self.group}" if self.group else self.kind
        return f"{kind}/{where}{self.name}"


# -- backends -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ExponentialBackoff:
    """Linkerd's `ExponentialBackoff`: waits from `min` doubling to `max`, each stretched by a
    random share up to `jitter` (a ratio, 0 to 100)."""

    min: float
    max: float
    jitter: float


@dataclass(frozen=True, slots=True)
class ConsecutiveFailures:
    """An endpoint is taken out of the balancer after `max_failures` failures in a row and
    probed again after `backoff`."""

    max_failures: int
    backoff: ExponentialBackoff


@dataclass(frozen=True, slots=True)
class Queue:
    capacity: int
    failfast_timeout: float


@dataclass(frozen=True, slots=True)
class Penalty:
    """Linkerd's PenaltyPeakEwma additions: a failed or throttled endpoint's latency is taken
    as `penalty` (decaying over `decay`), a Retry-After hint honoured up to `max_retry_after`."""

    penalty: float
    decay: float
    max_retry_after: float


@dataclass(frozen=True, slots=True)
class PeakEwma:
    default_rtt: float
    decay: float
    penalty: Penalty | None = None  # None: plain peak EWMA


@dataclass(frozen=True, slots=True)
class Balance:
    """Power-of-two-choices over the endpoints the destination service's `Get(path)` names,
    with the failure accrual of the protocol the backend serves (None: endpoints are never
    taken out; opaque backends have none)."""

    path: str
    load: PeakEwma
    accrual: ConsecutiveFailures | None = None


@dataclass(frozen=True, slots=True)
class Forward:
    """One endpoint, without discovery (an address the controller resolved), read as the
    destination service's addresses are (its identity verified when it has one)."""

    endpoint: DiscoveredEndpoint


@dataclass(frozen=True, slots=True)
class Fail:
    """A backend the controller could not resolve: its requests fail with `message`."""

    message: str


@dataclass(frozen=True, slots=True)
class Backend:
    meta: PolicyRef
    queue: Queue
    dispatch: Balance | Forward | Fail


# -- filters --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FailureInjector:
    """Answer a share (`numerator/denominator`) of requests with `status` (HTTP) or `status`
    as a gRPC code, without forwarding them."""

    status: int
    message: str
    numerator: int = 1
    denominator: int = 1


@dataclass(frozen=True, slots=True)
class Redirect:
    """Answer with a redirect; each part left None keeps the request's own. Exactly one of
    `full_path` and `prefix` may be set."""

    status: int
    scheme: str | None = None
    host: str | None = None
    port: int | None = None
    full_path: str | None = None
    prefix: str | None = None


@dataclass(frozen=True, slots=True)
class RequestHeaders:
    modifier: HeaderModifier


@dataclass(frozen=True, slots=True)
class ResponseHeaders:
    modifier: HeaderModifier


@dataclass(frozen=True, slots=True)
class Forbidden:
    """An opaque route's filter: the connection is refused."""


@dataclass(frozen=True, slots=True)
class Invalid:
    """An opaque route's filter: the route is misconfigured; connections fail with `message`."""

    message: str


Filter = FailureInjector | Redirect | RequestHeaders | ResponseHeaders | Forbidden | Invalid


# -- distributions --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RouteBackend:
    backend: Backend
    filters: tuple[Filter, ...] = ()
    request_timeout: float | None = None  # the deprecated per-backend timeout
    weight: int = 1  # only a RandomAvailable distribution reads it


class Dispatch(enum.Enum):
    EMPTY = "empty"  # no backend: requests fail
    FIRST_AVAILABLE = "first available"  # the first backend that is ready
    RANDOM_AVAILABLE = "random available"  # a weighted random pick


@dataclass(frozen=True, slots=True)
class Distribution:
    """Where a rule's requests go. For RANDOM_AVAILABLE, `cumulative[i]` is the sum of the
    weights of backends 0..i (a weighted pick is one bisection); its last entry is positive."""

    kind: Dispatch
    backends: tuple[RouteBackend, ...] = ()
    cumulative: tuple[int, ...] = ()

    @classmethod
    def weighted(cls, backends: tuple[RouteBackend, ...]) -> Distribution:
        """RANDOM_AVAILABLE over `backends`; ValueError unless their total weight is positive."""
        cumulative = tuple(itertools.accumulate(b.weight for b in backends))
        if not cumulative or cumulative[-1] <= 0 or any(b.weight < 0 for b in backends):
            raise ValueError("a weighted distribution needs non-negative weights, one positive")
        return cls(Dispatch.RANDOM_AVAILABLE, backends, cumulative)


EMPTY: Final = Distribution(Dispatch.EMPTY)


# -- rules and routes -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Timeouts:
    request: float | None = None  # the whole stream, from the request's start
    response: float | None = None  # once the request has been sent
    idle: float | None = None  # with no frame either way


@dataclass(frozen=True, slots=True)
class Retry:
    """Retry a failed request up to `limit` times when its response meets a condition: an HTTP
    status within one of `statuses` (inclusive ranges) or a gRPC code in `grpc_codes`."""

    limit: int
    max_request_bytes: int
    statuses: tuple[tuple[int, int], ...] = ()
    grpc_codes: frozenset[int] = frozenset()
    timeout: float | None = None  # of each attempt
    backoff: ExponentialBackoff | None = None


@dataclass(frozen=True, slots=True)
class Rule:
    matches: tuple[HttpMatch, ...] | tuple[GrpcMatch, ...]  # empty: every request
    filters: tuple[Filter, ...]
    distribution: Distribution
    timeouts: Timeouts = Timeouts()
    retry: Retry | None = None
    allow_l5d_request_headers: bool = False


@dataclass(frozen=True, slots=True)
class Route:
    """An HTTP or gRPC route: the hosts it serves (none: every host) and its rules."""

    meta: PolicyRef
    hosts: tuple[HostMatch, ...]
    rules: tuple[Rule, ...]


@dataclass(frozen=True, slots=True)
class OpaqueRoute:
    meta: PolicyRef
    rules: tuple[Rule, ...]  # no matches; filters and distributions only


class Protocol(enum.Enum):
    DETECT = "detect"
    OPAQUE = "opaque"
    HTTP1 = "http1"
    HTTP2 = "http2"
    GRPC = "grpc"
    TLS = "tls"


@dataclass(frozen=True, slots=True)
class ClientPolicy:
    """One target's policy. `http1`/`http2` hold HTTP routes (both for DETECT), `grpc` gRPC
    routes, `opaque` the routes of connections that are not HTTP. Each balancer carries its
    protocol's failure accrual (`Balance.accrual`)."""

    meta: PolicyRef
    protocol: Protocol
    detect_timeout: float | None = None
    http1: tuple[Route, ...] = ()
    http2: tuple[Route, ...] = ()
    grpc: tuple[Route, ...] = ()
    opaque: tuple[OpaqueRoute, ...] = ()
    tables: dict[tuple[int, bool], RouteTable] = field(
        default_factory=dict, init=False, compare=False, repr=False
    )

    def table(self, routes: tuple[Route, ...], grpc: bool) -> RouteTable:
        """`routes` (one of this policy's lists) indexed for route selection, once per policy."""
        key = (id(routes), grpc)
        found = self.tables.get(key)
        if found is None:
            found = self.tables[key] = RouteTable(routes, grpc)
        return found

    @property
    def backends(self) -> tuple[Backend, ...]:
        """Every backend any rule names, each once, in the order first named."""
        seen: dict[Backend, None] = {}
        for routes in (self.http1, self.http2, self.grpc, self.opaque):
            for route in routes:
                for rule in route.rules:
                    for rb in rule.distribution.backends:
                        seen.setdefault(rb.backend, None)
        return tuple(seen)


def with_accrual(routes: tuple[Route, ...], accrual: ConsecutiveFailures) -> tuple[Route, ...]:
    """`routes` with `accrual` on every balancer they name."""

    def backend(rb: RouteBackend) -> RouteBackend:
        d = rb.backend.dispatch
        if not isinstance(d, Balance):
            return rb
        return replace(rb, backend=replace(rb.backend, dispatch=replace(d, accrual=accrual)))

    return tuple(
        replace(route, rules=tuple(
            replace(rule, distribution=replace(rule.distribution, backends=tuple(
                backend(rb) for rb in rule.distribution.backends)))
            for rule in route.rules))
        for route in routes
    )  # fmt: skip
