"""Inbound authorization (pure): a port's decoded policy, who it lets in, and which route a
request takes, with Linkerd's meanings (linkerd2-proxy `proxy/server-policy`,
`app/inbound/src/policy`).

A client is allowed by an authorization when one of its networks (less the exceptions) holds
the client's address and its authentication is met: `UNAUTHENTICATED` by anyone, `TLS_ANY` by
any mesh TLS client, `TLS_IDENTITIES` by a mesh TLS client whose identity is listed or ends with
a listed suffix (an empty suffix matches every identity). The identity is the one the TLS
handshake proved; the address is the socket's. Nothing a client writes in a request counts.

Opaque and TLS ports, and connections on a detect port that turn out not to be HTTP, are checked
once per connection against the Server's authorizations. HTTP and gRPC requests are checked per
request against the authorizations of the route they match, which are the route's own followed
by the Server's (so a Server authorization allows every route of it). A request no route matches
is answered 404. With no routes, one default route matches everything. The policy a controller
sends also allows the loopback addresses (127.0.0.1, ::1) unauthenticated; the built-in default
policies do not. An authorization whose metadata is the default `audit` allows, and the caller
counts and logs what it allowed as a would-be denial.

A client is fixed for its connection: `Client.permits(policy)` computes, once per connection
and policy, the first authorization allowing it for each route, so a request costs a route
match and a tuple index. When the policy has one route and it matches every request (no host,
and a rule with no match, or one that asks for nothing but the path prefix `/`: the default
route the policy controller sends for a Server without routes), the request needs no match at
all: `Permits.match_free`. When the routes ask only for paths and methods (the default and
probe routes, most HTTPRoutes), they are matched from a flat table built once per policy
(`path_table`), reading nothing of the request but its method and path.
"""

from __future__ import annotations

import enum
import ipaddress
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Final, NamedTuple
from urllib.parse import parse_qsl

from meshlet.api.pathregex import Meter, Regex, RegexBudgetExceeded
from meshlet.proxy.core.header_modifier import HeaderModifier
from meshlet.proxy.core.ratelimit import RateLimitSpec

IP = ipaddress.IPv4Address | ipaddress.IPv6Address
Net = ipaddress.IPv4Network | ipaddress.IPv6Network
Header = tuple[bytes, bytes]


class Meta(NamedTuple):
    """Where a policy object comes from (Linkerd's `Meta`): a resource, or a default named by
    the controller (`kind` "default", no group)."""

    group: str
    kind: str
    name: str

    @classmethod
    def default(cls, name: str) -> Meta:
        return cls("", "default", name)

    @property
    def is_audit(self) -> bool:
        return self.kind == "default" and not self.group and self.name == "audit"

    def __str__(self) -> str:
        return (
            f"{self.kind}/{self.name}"
            if not self.group
            else f"{self.kind}.{self.group}/{self.name}"
        )


class Authn(enum.Enum):
    UNAUTHENTICATED = "unauthenticated"
    TLS_ANY = "mesh TLS"
    TLS_IDENTITIES = "mesh TLS identity"


@dataclass(frozen=True, slots=True)
class Network:
    net: Net
    excepts: tuple[Net, ...] = ()

    def contains(self, ip: IP) -> bool:
        if ip.version != self.net.version or ip not in self.net:
            return False
        return not any(ip.version == e.version and ip in e for e in self.excepts)


ALL_NETWORKS: Final = (
    Network(ipaddress.IPv4Network("0.0.0.0/0")),
    Network(ipaddress.IPv6Network("::/0")),
)
LOOPBACK: Final = (
    Network(ipaddress.IPv4Network("127.0.0.1/32")),
    Network(ipaddress.IPv6Network("::1/128")),
)


def suffix(parts: Sequence[str]) -> str:
    """The `ends_with` of a suffix given as labels: [] → "" (every name), [a, b] → ".a.b"."""
    return "." + ".".join(parts) if parts else ""


@dataclass(frozen=True, slots=True)
class Authorization:
    networks: tuple[Network, ...]
    authn: Authn
    meta: Meta
    identities: frozenset[str] = frozenset()
    suffixes: tuple[str, ...] = ()  # each an `ends_with`, see `suffix`

    def permits(self, ip: IP, client_id: str | None, tls: bool) -> bool:
        if not any(n.contains(ip) for n in self.networks):
            return False
        if self.authn is Authn.UNAUTHENTICATED:
            return True
        if not tls:
            return False
        if self.authn is Authn.TLS_ANY:
            return True
        if client_id is None:
            return False
        if client_id in self.identities:
            return True
        if client_id.startswith("spiffe://"):  # a URI identity: only named, never by suffix
            return False
        return any(client_id.endswith(s) for s in self.suffixes)

    def describe(self) -> str:
        """What a client needs to meet this authorization, for a denial's log line."""
        who = self.authn.value
        if self.authn is Authn.TLS_IDENTITIES:
            names = sorted(self.identities) + [f"*{s}" for s in self.suffixes]
            who += " (" + ", ".join(names[:4]) + (", …" if len(names) > 4 else "") + ")"
        nets = ", ".join(str(n.net) for n in self.networks[:3])
        return f"{self.meta}: {who} from {nets}"


LOCALHOST: Final = Authorization(LOOPBACK, Authn.UNAUTHENTICATED, Meta.default("localhost"))


# -- routes ---------------------------------------------------------------------------------


class PathKind(enum.Enum):
    EXACT = "exact"
    PREFIX = "prefix"
    REGEX = "regex"


@dataclass(frozen=True, slots=True)
class PathMatch:
    kind: PathKind
    value: str
    regex: Regex | None = None  # compiled, for REGEX

    @property
    def matches_all(self) -> bool:
        return self.kind is PathKind.PREFIX and self.value == "/"

    def length(self, path: str, meter: Meter) -> int | None:
        """The match's length (Linkerd orders path matches by it), None when it fails; a regex
        is paid from the request's `meter` (RegexBudgetExceeded)."""
        if self.kind is PathKind.EXACT:
            return len(path) if path == self.value else None
        if self.kind is PathKind.REGEX:
            assert self.regex is not None
            return len(path) if self.regex.matches(path, meter) else None
        return prefix_length(self.value, path)


def prefix_length(prefix: str, path: str) -> int | None:
    """How much of `path` the path prefix `prefix` matches, by whole segments (`/api` matches
    `/api` and `/api/x`, not `/apis`); None when it does not."""
    if prefix == "/":
        return 1
    prefix = prefix.rstrip("/")
    rest = path.rstrip("/")
    if not rest.startswith(prefix):
        return None
    tail = rest[len(prefix) :]
    return len(prefix) if not tail or tail[0] == "/" else None


@dataclass(frozen=True, slots=True)
class ValueMatch:
    """A header's (bytes) or a query parameter's (str) value: exact, or a full regex match."""

    name: str  # lower case for headers
    exact: bytes | str | None = None
    regex: Regex | None = None

    def matches(self, value: bytes | str, meter: Meter, subject: str) -> bool:
        """Whether `value` matches; a regex is paid from the request's `meter`, `subject`
        saying what the value is (header, query)."""
        if self.exact is not None:
            return bool(value == self.exact)
        assert self.regex is not None
        text = value.decode("latin-1") if isinstance(value, bytes) else value
        return self.regex.matches(text, meter, subject)


@dataclass(frozen=True, slots=True)
class HttpMatch:
    path: PathMatch | None = None
    headers: tuple[ValueMatch, ...] = ()
    query: tuple[ValueMatch, ...] = ()
    method: str | None = None

    @property
    def matches_all(self) -> bool:
        return (
            self.method is None
            and not self.headers
            and not self.query
            and (self.path is None or self.path.matches_all)
        )

    def summary(self, req: Request) -> tuple[int, int, int, bool] | None:
        """Linkerd's `RequestMatch` order: path length, headers, query params, method."""
        if self.method is not None and req.method != self.method:
            return None
        length = 1
        if self.path is not None:
            found = self.path.length(req.path_only, req.meter)
            if found is None:
                return None
            length = found
        if self.headers and not all(_header(m, req) for m in self.headers):
            return None
        if self.query:
            params = parse_qsl(req.query, keep_blank_values=True)
            meter = req.meter
            if not all(
                any(k == m.name and m.matches(v, meter, "query") for k, v in params)
                for m in self.query
            ):
                return None
        return (length, len(self.headers), len(self.query), self.method is not None)


@dataclass(frozen=True, slots=True)
class GrpcMatch:
    service: str = ""  # empty: any
    method: str = ""
    headers: tuple[ValueMatch, ...] = ()

    @property
    def matches_all(self) -> bool:
        return not self.service and not self.method and not self.headers

    def summary(self, req: Request) -> tuple[int, int, int, bool] | None:
        service, _, method = req.path_only[1:].partition("/")
        if self.service and service != self.service:
            return None
        if self.method and method != self.method:
            return None
        if self.headers and not all(_header(m, req) for m in self.headers):
            return None
        return (len(self.service), len(self.method), len(self.headers), False)


def _header(match: ValueMatch, req: Request) -> bool:
    name = match.name.encode("latin-1")
    meter = req.meter
    return any(n.lower() == name and match.matches(v, meter, "header") for n, v in req.headers)


class HostKind(enum.Enum):
    EXACT = "exact"
    SUFFIX = "suffix"


@dataclass(frozen=True, slots=True)
class HostMatch:
    kind: HostKind
    value: str  # EXACT: the host; SUFFIX: ".example.com" ("" for every host)

    def summary(self, host: str) -> tuple[int, int] | None:
        """(exact?, length): an exact match outranks any suffix, a longer one a shorter."""
        if self.kind is HostKind.EXACT:
            return (1, len(self.value)) if host == self.value else None
        return (0, len(self.value)) if host.endswith(self.value) else None


@dataclass(frozen=True, slots=True)
class Route:
    """An HTTP or gRPC route: its rules' matches (an empty list matches every request) and the
    authorizations of the route, followed by the Server's. `modifiers` holds each rule's request
    header modification (None: the rule has none), or nothing when no rule has one."""

    meta: Meta
    hosts: tuple[HostMatch, ...]
    rules: tuple[tuple[HttpMatch | GrpcMatch, ...], ...]
    authorizations: tuple[Authorization, ...]
    modifiers: tuple[HeaderModifier | None, ...] = ()

    @property
    def matches_all(self) -> bool:
        """Whether every request matches this route (a rule matches when any of its matches
        does, and a rule without matches matches every request)."""
        return not self.hosts and any(
            not rule or any(m.matches_all for m in rule) for rule in self.rules
        )


class Request(NamedTuple):
    """What route matching reads of a request, and what it may still spend on regexes."""

    host: str  # the authority without its port, lower case
    method: str
    path_only: str
    query: str
    headers: Sequence[Header]
    meter: Meter


def request(
    authority: str | None,
    method: str,
    path: str,
    headers: Sequence[Header],
    meter: Meter | None = None,
) -> Request:
    """The matching view of a request; `meter` (a new one when None) pays its regexes."""
    host = (authority or "").lower()
    if host.startswith("["):
        host = host[: host.find("]") + 1]
    elif host.count(":") == 1:
        host = host.partition(":")[0]
    path_only, _, query = path.partition("?")
    return Request(host, method, path_only, query, headers, meter or Meter())


_Summary = tuple[tuple[int, int] | tuple[()], tuple[int, int, int, bool]]


def find_route(routes: Sequence[Route], req: Request) -> int | None:
    """The index of the route a request takes (Linkerd's precedence: the best host match, then
    the best rule match; the first of equals), None when none matches."""
    found = find_rule(routes, req)
    return None if found is None else found[0]


def find_rule(routes: Sequence[Route], req: Request) -> tuple[int, int] | None:
    """The indexes of the route a request takes and of its rule that matched best (the first of
    equals), as `find_route` chooses; None when no route matches."""
    best: _Summary | None = None
    found = None
    for index, route in enumerate(routes):
        host: tuple[int, int] | tuple[()] = ()
        if route.hosts:
            hosts = [hs for h in route.hosts if (hs := h.summary(req.host)) is not None]
            if not hosts:
                continue
            host = max(hosts)
        rule_best = None
        rule_index = 0
        for at, rule in enumerate(route.rules):
            if not rule:
                summary: tuple[int, int, int, bool] | None = (1, 0, 0, False)
            else:
                summaries = [ms for m in rule if (ms := m.summary(req)) is not None]
                summary = max(summaries) if summaries else None
            if summary is not None and (rule_best is None or summary > rule_best):
                rule_best, rule_index = summary, at
        if rule_best is None:
            continue
        candidate = (host, rule_best)
        if best is None or candidate > best:
            best, found = candidate, (index, rule_index)
    return found


# A path table's entry: route, rule, how the path is matched, its value, the method (None: any).
PathEntry = tuple[int, int, int, str, str | None]
_ANY, _EXACT, _PREFIX = 0, 1, 2


def path_table(routes: Sequence[Route]) -> tuple[PathEntry, ...] | None:
    """The routes as a flat table when they ask only for a path (exact or prefix) and a method:
    no host, header, query or regex match (the default and probe routes a controller sends, and
    most HTTPRoutes). None when some route asks for more: `find_rule` then does the matching."""
    table: list[PathEntry] = []
    for index, route in enumerate(routes):
        if route.hosts:
            return None
        for at, rule in enumerate(route.rules):
            if not rule:
                table.append((index, at, _ANY, "", None))
            for m in rule:
                if not isinstance(m, HttpMatch) or m.headers or m.query:
                    return None
                path = m.path
                if path is None or path.matches_all:
                    table.append((index, at, _ANY, "", m.method))
                elif path.kind is PathKind.EXACT:
                    table.append((index, at, _EXACT, path.value, m.method))
                elif path.kind is PathKind.PREFIX:
                    table.append((index, at, _PREFIX, path.value, m.method))
                else:
                    return None
    return tuple(table)


def find_in_table(
    table: Sequence[PathEntry], method: str, path_only: str
) -> tuple[int, int] | None:
    """`find_rule` for a `path_table`, reading only the method and the path: the first entry of
    the highest (path length, method given) wins, which is the route and rule `find_rule`
    picks (no host, header or query counts to compare)."""
    best = -1
    found = None
    for index, at, how, value, wanted in table:
        if wanted is not None and wanted != method:
            continue
        if how == _ANY:
            length = 1
        elif how == _EXACT:
            if path_only != value:
                continue
            length = len(path_only)
        else:
            matched = prefix_length(value, path_only)
            if matched is None:
                continue
            length = matched
        key = 2 * length + (wanted is not None)
        if key > best:
            best, found = key, (index, at)
    return found


# -- the policy of a port -------------------------------------------------------------------


class PortProtocol(enum.Enum):
    DETECT = "detect"
    OPAQUE = "opaque"
    TLS = "tls"
    HTTP1 = "http1"
    HTTP2 = "http2"
    GRPC = "grpc"


@dataclass(frozen=True, slots=True)
class ServerPolicy:
    """One port's policy. `tcp_authorizations` decide connections that are not HTTP (none on
    HTTP-only ports); `routes` decide HTTP or gRPC requests (`grpc` says which kind)."""

    meta: Meta
    protocol: PortProtocol
    tcp_authorizations: tuple[Authorization, ...]
    routes: tuple[Route, ...]
    grpc: bool = False
    rate_limit: RateLimitSpec | None = None
    detect_timeout: float | None = None
    version: int = field(default=0, compare=False)  # set by whoever publishes it
    table: tuple[PathEntry, ...] | None = field(default=None, init=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "table", path_table(self.routes))

    @property
    def http_only(self) -> bool:
        return self.protocol in (PortProtocol.HTTP1, PortProtocol.HTTP2, PortProtocol.GRPC)


def default_route(authorizations: tuple[Authorization, ...]) -> Route:
    return Route(Meta.default("default"), (), ((),), authorizations)


def builtin(name: str, networks: tuple[Network, ...], authn: Authn) -> ServerPolicy:
    """A default policy as linkerd2-proxy builds it (`policy/defaults.rs`): detection, one
    authorization for TCP and for the default route; no loopback exception."""
    authz = Authorization(
        networks, authn, Meta.default(name), suffixes=("",) if authn is Authn.TLS_IDENTITIES else ()
    )
    return ServerPolicy(
        Meta.default(name), PortProtocol.DETECT, (authz,), (default_route((authz,)),)
    )


DENY: Final = ServerPolicy(Meta.default("deny"), PortProtocol.OPAQUE, (), ())


def default_policy(name: str, cluster: tuple[Network, ...]) -> ServerPolicy:
    """One of wellknown.DEFAULT_INBOUND_POLICIES; ValueError for another name."""
    if name == "deny":
        return DENY
    table: dict[str, tuple[tuple[Network, ...], Authn]] = {
        "all-unauthenticated": (ALL_NETWORKS, Authn.UNAUTHENTICATED),
        "all-authenticated": (ALL_NETWORKS, Authn.TLS_IDENTITIES),
        "cluster-unauthenticated": (cluster, Authn.UNAUTHENTICATED),
        "cluster-authenticated": (cluster, Authn.TLS_IDENTITIES),
        "audit": (ALL_NETWORKS, Authn.UNAUTHENTICATED),
    }
    if name not in table:
        raise ValueError(f"unknown default policy {name!r}")
    return builtin(name, *table[name])


# -- decisions ------------------------------------------------------------------------------


class Allowed(NamedTuple):
    authz: Authorization


class Denied(NamedTuple):
    """Why a client was refused: the authorizations it met none of."""

    reason: str


def deny_reason(authorizations: Sequence[Authorization], what: str) -> str:
    if not authorizations:
        return f"{what} authorizes no client"
    needed = "; ".join(a.describe() for a in authorizations[:3])
    more = f" (and {len(authorizations) - 3} more)" if len(authorizations) > 3 else ""
    return f"{what} needs one of: {needed}{more}"


def authorize(
    authorizations: Sequence[Authorization], ip: IP, client_id: str | None, tls: bool, what: str
) -> Allowed | Denied:
    """The first authorization that allows the client, or why none does."""
    for authz in authorizations:
        if authz.permits(ip, client_id, tls):
            return Allowed(authz)
    return Denied(deny_reason(authorizations, what))


@dataclass(frozen=True, slots=True)
class Client:
    """A connection's client, fixed for the connection: the socket's address and the identity
    its TLS handshake proved (None: plaintext, or mesh TLS without an identity)."""

    ip: IP
    client_id: str | None
    tls: bool

    def connection(self, policy: ServerPolicy) -> Allowed | Denied:
        return authorize(policy.tcp_authorizations, self.ip, self.client_id, self.tls,
                         f"server {policy.meta}")  # fmt: skip

    def permits(self, policy: ServerPolicy) -> Permits:
        routes = tuple(
            authorize(
                r.authorizations,
                self.ip,
                self.client_id,
                self.tls,
                f"route {r.meta} of server {policy.meta}",
            )
            for r in policy.routes
        )
        only = policy.routes[0] if len(policy.routes) == 1 else None
        match_free = only is not None and only.matches_all and not only.modifiers
        return Permits(policy, routes, match_free)


class Permits(NamedTuple):
    """A client's decisions on every route of one policy (see `Client.permits`)."""

    policy: ServerPolicy
    routes: tuple[Allowed | Denied, ...]
    # one route, matching every request, without filters: a request needs no match
    match_free: bool = False


class NoRoute(NamedTuple):
    reason: str


class OverBudget(NamedTuple):
    """A request refused because matching it against the routes' regexes would cost more than
    a request may spend (meshlet.api.pathregex): no route is chosen, so none it would not reach
    with every regex evaluated can be."""

    status: int  # 414, or 431 when a header value was too long
    reason: str


Decision = Allowed | Denied | NoRoute | OverBudget


def decide(
    permits: Permits, method: str, path: str, view: Callable[[], Request]
) -> tuple[int, int, Decision]:
    """The route a request (`method`, `path` with its query) takes, its rule and its decision.
    `view` builds the whole matching view, only when a route asks for more than a path and a
    method."""
    if permits.match_free:  # the rule does not matter: no rule has a filter
        return 0, 0, permits.routes[0]
    policy = permits.policy
    if policy.table is not None:
        found = find_in_table(policy.table, method, path.partition("?")[0])
    else:
        try:
            found = find_rule(policy.routes, view())
        except RegexBudgetExceeded as exc:
            return -1, -1, OverBudget(exc.status, str(exc))
    if found is None:
        return -1, -1, NoRoute(f"no route of server {policy.meta} matches the request")
    return found[0], found[1], permits.routes[found[0]]
