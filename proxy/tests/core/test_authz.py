"""Who a port lets in and which route a request takes, as linkerd2-proxy decides."""

from __future__ import annotations

import ipaddress

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshlet.api.pathregex import compile_path_regex
from meshlet.proxy.core.authz import (
    ALL_NETWORKS,
    LOCALHOST,
    Allowed,
    Authn,
    Authorization,
    Client,
    Denied,
    GrpcMatch,
    HostKind,
    HostMatch,
    HttpMatch,
    Meta,
    Network,
    NoRoute,
    OverBudget,
    PathKind,
    PathMatch,
    PortProtocol,
    Route,
    ServerPolicy,
    ValueMatch,
    decide,
    default_policy,
    default_route,
    find_in_table,
    find_route,
    find_rule,
    path_table,
    request,
    suffix,
)

WEB = "web.emojivoto.serviceaccount.identity.meshlet.cluster.local"
BOT = "vote-bot.emojivoto.serviceaccount.identity.meshlet.cluster.local"
CLUSTER = (Network(ipaddress.ip_network("10.0.0.0/8")), Network(ipaddress.ip_network("fd00::/8")))


def net(cidr: str, *excepts: str) -> Network:
    return Network(ipaddress.ip_network(cidr), tuple(ipaddress.ip_network(e) for e in excepts))


def authz(
    authn: Authn,
    *networks: Network,
    ids: tuple[str, ...] = (),
    suffixes: tuple[tuple[str, ...], ...] = (),
    name: str = "a",
) -> Authorization:
    return Authorization(
        networks or ALL_NETWORKS, authn, Meta("policy.meshlet.io", "authorizationpolicy", name),
        frozenset(ids), tuple(suffix(list(s)) for s in suffixes),
    )  # fmt: skip


def ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    return ipaddress.ip_address(text)


@pytest.mark.parametrize(
    ("authorization", "client_ip", "client_id", "tls", "allowed"),
    [
        (authz(Authn.UNAUTHENTICATED), "10.1.2.3", None, False, True),
        (authz(Authn.UNAUTHENTICATED), "2001:db8::1", None, False, True),
        (authz(Authn.TLS_ANY), "10.1.2.3", None, False, False),
        (authz(Authn.TLS_ANY), "10.1.2.3", None, True, True),
        (authz(Authn.TLS_IDENTITIES, ids=(WEB,)), "10.1.2.3", WEB, True, True),
        (authz(Authn.TLS_IDENTITIES, ids=(WEB,)), "10.1.2.3", BOT, True, False),
        (authz(Authn.TLS_IDENTITIES, ids=(WEB,)), "10.1.2.3", WEB, False, False),  # no TLS
        (authz(Authn.TLS_IDENTITIES, ids=(WEB,)), "10.1.2.3", None, True, False),
        # Suffixes are whole labels; the empty suffix matches every identity.
        (
            authz(
                Authn.TLS_IDENTITIES,
                suffixes=(
                    ("emojivoto", "serviceaccount", "identity", "meshlet", "cluster", "local"),
                ),
            ),
            "10.1.2.3",
            BOT,
            True,
            True,
        ),
        (
            authz(
                Authn.TLS_IDENTITIES,
                suffixes=(("voto", "serviceaccount", "identity", "meshlet", "cluster", "local"),),
            ),
            "10.1.2.3",
            BOT,
            True,
            False,
        ),
        (authz(Authn.TLS_IDENTITIES, suffixes=((),)), "10.1.2.3", BOT, True, True),
        (authz(Authn.TLS_IDENTITIES, suffixes=((),)), "10.1.2.3", None, False, False),
        # A URI identity only by name, never by suffix.
        (
            authz(Authn.TLS_IDENTITIES, suffixes=((),)),
            "10.1.2.3",
            "spiffe://cluster.local/ns/e/sa/w",
            True,
            False,
        ),
        (
            authz(Authn.TLS_IDENTITIES, ids=("spiffe://cluster.local/ns/e/sa/w",)),
            "10.1.2.3",
            "spiffe://cluster.local/ns/e/sa/w",
            True,
            True,
        ),
        # Networks, with exceptions, per address family.
        (authz(Authn.UNAUTHENTICATED, net("10.0.0.0/8")), "10.9.9.9", None, False, True),
        (authz(Authn.UNAUTHENTICATED, net("10.0.0.0/8")), "11.0.0.1", None, False, False),
        (
            authz(Authn.UNAUTHENTICATED, net("10.0.0.0/8", "10.9.0.0/16")),
            "10.9.9.9",
            None,
            False,
            False,
        ),
        (
            authz(Authn.UNAUTHENTICATED, net("10.0.0.0/8", "10.9.0.0/16")),
            "10.8.9.9",
            None,
            False,
            True,
        ),
        (authz(Authn.UNAUTHENTICATED, net("10.0.0.0/8")), "::ffff:10.0.0.1", None, False, False),
        (
            authz(Authn.UNAUTHENTICATED, net("fd00::/8", "fd00:1::/32")),
            "fd00:2::1",
            None,
            False,
            True,
        ),
        (
            authz(Authn.UNAUTHENTICATED, net("fd00::/8", "fd00:1::/32")),
            "fd00:1::1",
            None,
            False,
            False,
        ),
        (authz(Authn.TLS_ANY, net("0.0.0.0/0")), "::1", None, True, False),
    ],
)
def test_an_authorization_permits_by_network_and_authentication(
    authorization: Authorization, client_ip: str, client_id: str | None, tls: bool, allowed: bool
) -> None:
    assert authorization.permits(ip(client_ip), client_id, tls) is allowed


def test_loopback_is_allowed_on_controller_policies_only_from_127_0_0_1_and_the_v6_one() -> None:
    assert LOCALHOST.permits(ip("127.0.0.1"), None, False)
    assert LOCALHOST.permits(ip("::1"), None, False)
    assert not LOCALHOST.permits(ip("127.0.0.2"), None, False)  # another "pod" on loopback


@pytest.mark.parametrize(
    ("name", "client", "allowed"),
    [
        ("all-unauthenticated", Client(ip("192.0.2.1"), None, False), True),
        ("all-authenticated", Client(ip("192.0.2.1"), None, False), False),
        ("all-authenticated", Client(ip("192.0.2.1"), BOT, True), True),
        ("cluster-unauthenticated", Client(ip("10.1.1.1"), None, False), True),
        ("cluster-unauthenticated", Client(ip("192.0.2.1"), None, False), False),
        ("cluster-authenticated", Client(ip("10.1.1.1"), BOT, True), True),
        ("cluster-authenticated", Client(ip("10.1.1.1"), None, False), False),
        ("deny", Client(ip("127.0.0.1"), BOT, True), False),  # fails closed, even on loopback
        ("audit", Client(ip("192.0.2.1"), None, False), True),
    ],
)
def test_default_policies(name: str, client: Client, allowed: bool) -> None:
    policy = default_policy(name, CLUSTER)
    assert isinstance(client.connection(policy), Allowed) is allowed
    if policy.routes:
        *_, decision = decide(
            client.permits(policy), "GET", "/", lambda: request("x", "GET", "/", ())
        )
        assert isinstance(decision, Allowed) is allowed
    else:
        assert policy.protocol is PortProtocol.OPAQUE  # deny: not even detected


def test_audit_is_the_default_named_audit() -> None:
    assert Meta.default("audit").is_audit
    assert not Meta("policy.meshlet.io", "authorizationpolicy", "audit").is_audit
    with pytest.raises(ValueError, match="unknown default policy"):
        default_policy("allow", CLUSTER)


def test_a_denial_names_what_was_needed() -> None:
    policy = ServerPolicy(
        Meta("policy.meshlet.io", "server", "web-http"), PortProtocol.DETECT,
        (authz(Authn.TLS_IDENTITIES, ids=(WEB,), name="web-only"),), (),
    )  # fmt: skip
    decision = Client(ip("10.0.0.1"), BOT, True).connection(policy)
    assert isinstance(decision, Denied)
    assert "server.policy.meshlet.io/web-http" in decision.reason
    assert "authorizationpolicy.policy.meshlet.io/web-only" in decision.reason
    assert WEB in decision.reason


# -- routes -----------------------------------------------------------------------------------


def route(name: str, *rules: tuple[HttpMatch | GrpcMatch, ...], hosts: tuple[HostMatch, ...] = (),
          authzs: tuple[Authorization, ...] = ()) -> Route:  # fmt: skip
    return Route(Meta("policy.meshlet.io", "httproute", name), hosts, rules, authzs)


def path(kind: PathKind, value: str) -> HttpMatch:
    regex = compile_path_regex(value) if kind is PathKind.REGEX else None
    return HttpMatch(PathMatch(kind, value, regex))


def taken(routes: list[Route], authority: str, method: str = "GET", target: str = "/",
          headers: tuple[tuple[bytes, bytes], ...] = ()) -> str | None:  # fmt: skip
    index = find_route(routes, request(authority, method, target, headers))
    return None if index is None else routes[index].meta.name


def test_path_matches_exact_prefix_by_segment_and_regex() -> None:
    routes = [
        route("prefix", (path(PathKind.PREFIX, "/api"),)),
        route("exact", (path(PathKind.EXACT, "/api/v1"),)),
        route("regex", (path(PathKind.REGEX, "/api/v[0-9]+/items"),)),
    ]
    assert taken(routes, "web", target="/api/v1") == "exact"
    assert taken(routes, "web", target="/api/v2/items?x=1") == "regex"  # longer than the prefix
    assert taken(routes, "web", target="/api/") == "prefix"
    assert taken(routes, "web", target="/apis") is None  # a prefix is whole segments
    assert taken(routes, "web", target="/") is None


def test_the_rule_that_matched_best_is_found_with_its_route() -> None:
    """A rule's filters are the best-matching rule's: its index comes with the route's."""
    routes = [
        route("other", (path(PathKind.PREFIX, "/other"),)),
        route("api", (path(PathKind.PREFIX, "/api"),), (path(PathKind.EXACT, "/api/v1"),), ()),
    ]
    get = lambda target: find_rule(routes, request("web", "GET", target, ()))  # noqa: E731
    assert get("/api/v1") == (1, 1)  # the exact rule outranks the prefix one
    assert get("/api/v2") == (1, 0)
    assert get("/elsewhere") == (1, 2)  # the rule with no matches takes everything
    assert get("/other") == (0, 0)


def test_precedence_host_then_path_length_then_headers_query_method_then_first() -> None:
    exact_host = HostMatch(HostKind.EXACT, "web.example.com")
    suffix_host = HostMatch(HostKind.SUFFIX, ".example.com")
    routes = [
        route("any-host", (path(PathKind.PREFIX, "/very/long/prefix"),)),
        route("suffix-host", (), hosts=(suffix_host,)),
        route("exact-host", (), hosts=(exact_host,)),
    ]
    assert taken(routes, "web.example.com:80", target="/very/long/prefix") == "exact-host"
    assert taken(routes, "api.example.com", target="/very/long/prefix") == "suffix-host"
    assert taken(routes, "other", target="/very/long/prefix") == "any-host"
    assert taken(routes, "other", target="/") is None

    header = ValueMatch("x-canary", exact=b"1")
    query = ValueMatch("debug", regex=compile_path_regex("y.*"))
    routes = [
        route("plain", (path(PathKind.PREFIX, "/"),)),
        route("method", (HttpMatch(PathMatch(PathKind.PREFIX, "/"), method="POST"),)),
        route("query", (HttpMatch(PathMatch(PathKind.PREFIX, "/"), query=(query,)),)),
        route("header", (HttpMatch(PathMatch(PathKind.PREFIX, "/"), headers=(header,)),)),
        route("plain-again", (path(PathKind.PREFIX, "/"),)),
    ]
    assert taken(routes, "w", "POST", "/?debug=yes", ((b"X-Canary", b"1"),)) == "header"
    assert taken(routes, "w", "POST", "/?debug=yes") == "query"
    assert taken(routes, "w", "POST", "/?debug=no") == "method"
    assert taken(routes, "w", "GET", "/", ((b"x-canary", b"2"),)) == "plain"  # the first of equals


def test_grpc_routes_match_service_method_and_headers() -> None:
    routes = [
        route("service", (GrpcMatch("meshlet.test.Echo"),)),
        route("method", (GrpcMatch("meshlet.test.Echo", "Unary"),)),
        route("other", (GrpcMatch("other.Svc"),)),
    ]
    assert taken(routes, "web", "POST", "/meshlet.test.Echo/Unary") == "method"
    assert taken(routes, "web", "POST", "/meshlet.test.Echo/Chat") == "service"
    assert taken(routes, "web", "POST", "/nope.Svc/X") is None


def test_route_decisions_use_the_routes_authorizations_and_no_route_is_a_404() -> None:
    bot_only = authz(Authn.TLS_IDENTITIES, ids=(BOT,), name="bot-only")
    policy = ServerPolicy(
        Meta("policy.meshlet.io", "server", "web"), PortProtocol.HTTP1, (LOCALHOST,),
        (route("admin", (path(PathKind.PREFIX, "/admin"),), authzs=(bot_only, LOCALHOST)),
         route("public", (path(PathKind.PREFIX, "/public"),),
               authzs=(authz(Authn.UNAUTHENTICATED, name="anyone"), LOCALHOST))),
    )  # fmt: skip
    web = Client(ip("10.0.0.5"), WEB, True).permits(policy)
    bot = Client(ip("10.0.0.6"), BOT, True).permits(policy)
    get = lambda p: lambda: request("web", "GET", p, ())  # noqa: E731
    assert isinstance(decide(web, "GET", "/admin", get("/admin"))[2], Denied)
    assert decide(bot, "GET", "/admin", get("/admin")) == (0, 0, Allowed(bot_only))
    assert decide(web, "GET", "/public", get("/public"))[2] == Allowed(
        policy.routes[1].authorizations[0]
    )
    index, rule, decision = decide(web, "GET", "/elsewhere", get("/elsewhere"))
    assert index == rule == -1 and isinstance(decision, NoRoute)


def test_a_path_too_long_for_a_regex_never_falls_to_a_more_permissive_route() -> None:
    """`/admin/...` (a regex) is the bot's; `/` everyone's. Were an unaffordable regex skipped,
    a long `/admin/...` path would fall to `/` and be let in: it is refused whole (414) instead,
    before any route or authorization is chosen."""
    bot_only = authz(Authn.TLS_IDENTITIES, ids=(BOT,), name="bot-only")
    anyone = authz(Authn.UNAUTHENTICATED, name="anyone")
    for admin in ("/admin/.*", ".*/admin/.*"):  # with a known prefix, and with none
        policy = ServerPolicy(
            Meta("policy.meshlet.io", "server", "web"), PortProtocol.HTTP1, (),
            (route("admin", (path(PathKind.REGEX, admin),), authzs=(bot_only,)),
             route("public", (path(PathKind.PREFIX, "/"),), authzs=(anyone,))),
        )  # fmt: skip
        web = Client(ip("10.0.0.5"), WEB, True).permits(policy)
        get = lambda p: lambda: request("web", "GET", p, ())  # noqa: E731
        assert isinstance(decide(web, "GET", "/admin/x", get("/admin/x"))[2], Denied)
        long = "/admin/" + "x" * 20_000
        index, rule, decision = decide(web, "GET", long, get(long))
        assert (index, rule) == (-1, -1) and isinstance(decision, OverBudget), decision
        assert decision.status == 414 and "too long" in decision.reason
    # a path the regex cannot match (outside its range of matches) costs nothing to rule out
    other = "/public/" + "x" * 20_000
    narrow = ServerPolicy(
        Meta("policy.meshlet.io", "server", "web"), PortProtocol.HTTP1, (),
        (route("admin", (path(PathKind.REGEX, "/admin/.*"),), authzs=(bot_only,)),
         route("public", (path(PathKind.PREFIX, "/"),), authzs=(anyone,))),
    )  # fmt: skip
    web = Client(ip("10.0.0.5"), WEB, True).permits(narrow)
    assert decide(web, "GET", other, lambda: request("web", "GET", other, ()))[2] == Allowed(anyone)


def test_header_and_query_regexes_are_paid_by_the_request_too() -> None:
    canary = ValueMatch("x-canary", regex=compile_path_regex(".*yes.*"))
    debug = ValueMatch("debug", regex=compile_path_regex(".*on.*"))
    anyone = authz(Authn.UNAUTHENTICATED, name="anyone")
    policy = ServerPolicy(
        Meta("policy.meshlet.io", "server", "web"), PortProtocol.HTTP1, (),
        (route("canary", (HttpMatch(PathMatch(PathKind.PREFIX, "/"), headers=(canary,)),),
               authzs=(anyone,)),
         route("debug", (HttpMatch(PathMatch(PathKind.PREFIX, "/"), query=(debug,)),),
               authzs=(anyone,))),
    )  # fmt: skip
    web = Client(ip("10.0.0.5"), WEB, True).permits(policy)
    many = tuple((b"x-canary", b"n" * 4000) for _ in range(50))  # one header, fifty times
    decision = decide(web, "GET", "/", lambda: request("web", "GET", "/", many))[2]
    assert isinstance(decision, OverBudget) and decision.status == 431
    query = "/?" + "&".join(["debug=" + "n" * 4000] * 50)
    decision = decide(web, "GET", query, lambda: request("web", "GET", query, ()))[2]
    assert isinstance(decision, OverBudget) and decision.status == 414


def test_the_default_route_takes_everything_with_the_servers_authorizations() -> None:
    server = (authz(Authn.TLS_ANY),)
    policy = ServerPolicy(Meta.default("x"), PortProtocol.DETECT, server, (default_route(server),))
    assert (
        decide(Client(ip("10.0.0.1"), BOT, True).permits(policy), "GET", "/", lambda: 1 / 0)[0] == 0
    )  # type: ignore[arg-type,return-value]


EVERYTHING = path(PathKind.PREFIX, "/")
MATCH_FREE = [  # one route's rules (and hosts) -> whether a request needs no match
    (((),), (), True),  # the proxy's built-in default route
    (((EVERYTHING,),), (), True),  # the controller's default route: PathPrefix /
    (((HttpMatch(),),), (), True),
    (((GrpcMatch(),),), (), True),
    (((path(PathKind.PREFIX, "/api"), EVERYTHING),), (), True),  # any match of a rule will do
    (((path(PathKind.PREFIX, "/api"),), (EVERYTHING,)), (), True),  # any rule will do
    (((EVERYTHING,),), (HostMatch(HostKind.SUFFIX, ""),), False),  # hosts are matched
    (((path(PathKind.PREFIX, "/api"),),), (), False),
    (((path(PathKind.EXACT, "/"),),), (), False),
    (((path(PathKind.PREFIX, ""),),), (), False),  # not "*" (OPTIONS *)
    (((HttpMatch(EVERYTHING.path, method="GET"),),), (), False),
    (((HttpMatch(EVERYTHING.path, headers=(ValueMatch("x", exact=b"1"),)),),), (), False),
    (((HttpMatch(EVERYTHING.path, query=(ValueMatch("q", exact="1"),)),),), (), False),
    (((GrpcMatch("svc"),),), (), False),
    (((GrpcMatch(method="M"),),), (), False),
    (((GrpcMatch(headers=(ValueMatch("x", exact=b"1"),)),),), (), False),
    ((), (), False),  # no rule: matches nothing
]


@pytest.mark.parametrize(("rules", "hosts", "free"), MATCH_FREE)
def test_a_single_route_matching_everything_needs_no_match_and_decides_alike(
    rules: tuple[tuple[HttpMatch | GrpcMatch, ...], ...], hosts: tuple[HostMatch, ...], free: bool
) -> None:
    server = (authz(Authn.TLS_ANY),)
    one = Route(Meta("policy.meshlet.io", "httproute", "r"), hosts, rules, server)
    policy = ServerPolicy(Meta.default("x"), PortProtocol.DETECT, server, (one,))
    permits = Client(ip("10.0.0.1"), BOT, True).permits(policy)
    assert permits.match_free is free
    two = ServerPolicy(Meta.default("x"), PortProtocol.DETECT, server, (one, one))
    assert not Client(ip("10.0.0.1"), BOT, True).permits(two).match_free
    for method, target in [("GET", "/"), ("POST", "/api/x?q=2"), ("OPTIONS", "*"), ("GET", "/a")]:
        req = request("web.example.com", method, target, ())
        matched = find_route(policy.routes, req)
        if free:  # the shortcut takes route 0 for every request, as matching would
            assert matched == 0
            assert decide(permits, method, target, lambda: 1 / 0) == (0, 0, permits.routes[0])  # type: ignore[arg-type,return-value]
        else:
            expected = (-1, NoRoute) if matched is None else (0, Allowed)
            index, _, decision = decide(permits, method, target, lambda req=req: req)  # type: ignore[misc]
            assert (index, type(decision)) == expected


_SEGMENTS = st.sampled_from(["", "a", "api", "apis", "live", "x"])
_PATHS = st.lists(_SEGMENTS, max_size=3).map(lambda parts: "/" + "/".join(parts))
_METHODS = st.sampled_from([None, "GET", "POST"])
_MATCHES = st.builds(
    lambda kind, value, method: HttpMatch(
        None if kind is None else PathMatch(kind, value), method=method
    ),
    st.sampled_from([None, PathKind.EXACT, PathKind.PREFIX]),
    _PATHS,
    _METHODS,
)
_RULES = st.lists(st.lists(_MATCHES, max_size=3).map(tuple), min_size=1, max_size=3)
_ROUTES = st.lists(_RULES, min_size=1, max_size=4).map(
    lambda routes: tuple(route(f"r{i}", *rules) for i, rules in enumerate(routes))
)


@given(_ROUTES, st.sampled_from(["GET", "POST", "PUT"]), _PATHS, st.sampled_from(["", "?q=1"]))
def test_the_path_table_picks_the_route_and_rule_matching_picks(
    routes: tuple[Route, ...], method: str, path_only: str, query: str
) -> None:
    table = path_table(routes)
    assert table is not None
    expected = find_rule(routes, request("web", method, path_only + query, ()))
    assert find_in_table(table, method, path_only) == expected


def test_routes_that_ask_for_more_than_a_path_and_a_method_have_no_table() -> None:
    headers = HttpMatch(headers=(ValueMatch("x", exact=b"1"),))
    regex = path(PathKind.REGEX, "/a.*")
    host = route("h", (), hosts=(HostMatch(HostKind.EXACT, "web"),))
    for routes in ((route("r", (headers,)),), (route("r", (regex,)),), (host,),
                   (route("g", (GrpcMatch("svc"),)),)):  # fmt: skip
        assert path_table(routes) is None
    assert path_table((route("r", (path(PathKind.EXACT, "/live"),)),)) is not None
