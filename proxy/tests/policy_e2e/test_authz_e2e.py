"""Inbound authorization end to end, as a cluster enforces it: real `meshlet-proxy` processes in
network namespaces with `meshlet-init`'s rules, the real `meshlet-controller policy` over a
manifests folder that each test rewrites, identities from the identity service, and clients
nobody here wrote (curl over HTTP/1.1 and HTTP/2, grpcio, a plain socket).

The mesh (`meshlet_testing.podmesh`, one for the module): `server` runs the test app (HTTP on
8080, Python's http.server on 8081, gRPC on 9090, TCP that speaks first on 7000, opaque) behind
its proxy, which follows the four ports' policies; `alpha` and `beta` are meshed clients in
namespace demo, `gamma` a meshed client in namespace edge whose address is outside the cluster
networks (10.78.0.0/25); `plain` is an unmeshed client inside them. Every client has its own
address, so the server's proxy sees who calls: on loopback every client would be 127.0.0.1,
which a controller's policy allows. The pods are dual stack (an IPv6 address each beside the
IPv4 one, both in the pod's status), as a dual-stack cluster's.

Each test writes the policy objects (one file, replaced in one step) and the server pod's
default-policy annotation, waits until the server's proxy has logged the new policy of each
port, then asserts what each client sees and what the proxy counted.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from meshlet.api import wellknown
from meshlet.cli.demo.topology import Layout, Mode, Pod
from meshlet_testing.podmesh import NS, PodMesh, PodSpec, metric, running

pytestmark = pytest.mark.netns

G = wellknown.POLICY_API_GROUP
ANN = wellknown.DEFAULT_INBOUND_POLICY_ANNOTATION
SERVER, ALPHA, BETA, GAMMA, PLAIN = "server", "alpha", "beta", "gamma", "plain"
HTTP, STDLIB, GRPC, TCP = 8080, 8081, 9090, 7000
PORTS = (HTTP, STDLIB, GRPC, TCP)
CLUSTER = "10.78.0.0/25"
IPS = {SERVER: "10.78.0.10", ALPHA: "10.78.0.21", BETA: "10.78.0.22", GAMMA: "10.78.0.200",
       PLAIN: "10.78.0.50"}  # fmt: skip
EDGE = "edge"  # gamma's namespace
LOG = "proxy-" + SERVER  # the server's proxy's log
START = "all-unauthenticated"  # the server pod's default policy as the mesh starts
GREETING = "hello from server\necho:ping\n"


def identity(pod: str) -> str:
    return wellknown.identity_name(pod, EDGE if pod == GAMMA else NS)


# -- the mesh and its policy --------------------------------------------------------------


class Policy:
    """Writes the policy manifests and waits until the server's proxy applies them."""

    def __init__(self, mesh: PodMesh) -> None:
        self.mesh = mesh
        # port → the policy the proxy logged last (the mesh starts with the annotation's)
        self.current = {port: f"default/{START}" for port in PORTS}
        self.used: set[str] = set()  # Server names: each names one content only
        self.pending: tuple[int, dict[int, str]] = (0, {})  # log offset, port → policy

    def set(self, *objs: dict[str, Any], default: str = "all-unauthenticated") -> None:
        """The server pod's default policy and these objects, in force once this returns."""
        self.write(*objs, default=default)
        self.wait()

    def write(self, *objs: dict[str, Any], default: str = "all-unauthenticated") -> None:
        """Writes the policy (the objects in one file, replaced in one step); `wait` waits
        for it. A Server name is used once, so that each new policy is logged anew."""
        expected = {port: f"default/{default}" for port in PORTS}
        for obj in objs:
            if obj["kind"] == "Server":
                name = obj["metadata"]["name"]
                assert name not in self.used, f"Server {name} was used before: name it anew"
                self.used.add(name)
                expected[obj["spec"]["port"]] = f"server.{G}/{name}"
        self.pending = (self.mesh.log_size(LOG), expected)
        self.mesh.manifests.put("policy", *objs)
        self.mesh.annotate(SERVER, {ANN: default})

    def wait(self) -> None:
        """Until the server's proxy has logged the written policy of each port."""
        since, expected = self.pending
        for port, meta in expected.items():
            if self.current.get(port) != meta:
                self.mesh.wait_log(LOG, rf"port {port}: policy {meta} \(", since=since)
                self.current[port] = meta


@pytest.fixture(scope="module")
def mesh(netns_available: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PodMesh]:
    pods = [
        PodSpec(Pod(SERVER, SERVER, IPS[SERVER], SERVER), app=True, policy_ports=PORTS,
                opaque_ports=(TCP,)),
        PodSpec(Pod(ALPHA, ALPHA, IPS[ALPHA], "client")),
        PodSpec(Pod(BETA, BETA, IPS[BETA], "client")),
        PodSpec(Pod(GAMMA, GAMMA, IPS[GAMMA], "client"), namespace=EDGE),
        PodSpec(Pod(PLAIN, PLAIN, IPS[PLAIN], "client"), meshed=False),
    ]  # fmt: skip
    layout = Layout(Mode.NETNS, tuple(s.pod for s in pods), control_ip="10.78.0.2",
                    host_ip="10.78.0.1", prefix=24)  # fmt: skip
    root = tmp_path_factory.mktemp("podmesh")
    built = PodMesh(root, layout, pods, cluster_networks=CLUSTER,
                    annotations={SERVER: {ANN: START}}, ipv6=True)  # fmt: skip
    with running(built):
        yield built


@pytest.fixture(scope="module")
def policy(mesh: PodMesh) -> Policy:
    return Policy(mesh)


def url(path: str = "/") -> str:
    return f"http://{IPS[SERVER]}:{HTTP}{path}"


def status(mesh: PodMesh, client: str, path: str = "/", *options: str) -> int:
    return mesh.curl(client, url(path), *options).status


# -- resources ----------------------------------------------------------------------------


def res(kind: str, name: str, spec: dict[str, Any], version: str = "v1alpha1") -> dict[str, Any]:
    return {"apiVersion": f"{G}/{version}", "kind": kind,
            "metadata": {"name": name, "namespace": NS}, "spec": spec}  # fmt: skip


def server(name: str, port: int, protocol: str = "unknown") -> dict[str, Any]:
    return res("Server", name, {"podSelector": {"matchLabels": {"app": SERVER}}, "port": port,
                                "proxyProtocol": protocol}, "v1beta3")  # fmt: skip


def ref(kind: str, name: str) -> dict[str, str]:
    return {"group": G, "kind": kind, "name": name}


def authorization(name: str, target: dict[str, str], *refs: dict[str, str]) -> dict[str, Any]:
    spec = {"targetRef": target, "requiredAuthenticationRefs": list(refs)}
    return res("AuthorizationPolicy", name, spec)


def servers_for(tag: str, *refs: dict[str, str]) -> list[dict[str, Any]]:
    """A Server per port (HTTP detected, gRPC, opaque TCP), each authorized by `refs`."""
    objs = []
    for port, protocol in ((HTTP, "unknown"), (GRPC, "gRPC"), (TCP, "opaque")):
        name = f"{tag}-{port}"
        objs += [server(name, port, protocol), authorization(name, ref("Server", name), *refs)]
    return objs


class Outcome:
    """What one client sees on each protocol, and what the server's proxy counted for it."""

    def __init__(self, mesh: PodMesh, client: str) -> None:
        self.http = mesh.curl(client, url("/hello"))
        self.h2 = mesh.curl(client, url("/hello"), "--http2-prior-knowledge")
        self.grpc = mesh.grpc(client, f"{IPS[SERVER]}:{GRPC}")
        self.tcp = mesh.tcp(client, IPS[SERVER], TCP, "ping\n")

    def allowed(self) -> bool:
        return (self.http.status, self.h2.status, self.grpc["code"], self.tcp["received"]) == (
            200, 200, "OK", GREETING)  # fmt: skip

    def denied(self) -> bool:
        return (
            self.http.status == 403
            and "meshlet-proxy-error" in self.http.headers
            and self.h2.status == 403
            and self.grpc["code"] == "PERMISSION_DENIED"
            and self.tcp["received"] == ""  # closed before the app could greet
        )

    def __repr__(self) -> str:
        return repr((self.http, self.h2, self.grpc, self.tcp))


# -- 1. default policies ------------------------------------------------------------------

# Who each default lets in (an HTTP request each): alpha is meshed inside the cluster
# networks, gamma meshed outside them, plain unmeshed inside them.
DEFAULTS = {
    "all-unauthenticated": {ALPHA: 200, GAMMA: 200, PLAIN: 200},
    "all-authenticated": {ALPHA: 200, GAMMA: 200, PLAIN: 403},
    "cluster-authenticated": {ALPHA: 200, GAMMA: 403, PLAIN: 403},
    "cluster-unauthenticated": {ALPHA: 200, GAMMA: 403, PLAIN: 200},
    "deny": {ALPHA: 403, GAMMA: 403, PLAIN: 403},
    "audit": {ALPHA: 200, GAMMA: 200, PLAIN: 200},
}


@pytest.mark.parametrize("default", list(DEFAULTS))
def test_each_default_policy_by_the_pod_annotation(
    mesh: PodMesh, policy: Policy, default: str
) -> None:
    policy.set(default=default)
    before, since = mesh.metrics(SERVER), mesh.log_size(LOG)
    seen = {client: status(mesh, client) for client in DEFAULTS[default]}
    assert seen == DEFAULTS[default]
    after = mesh.metrics(SERVER)
    for client, code in seen.items():
        tls = {"client_id": identity(client)} if client != PLAIN else {"tls": "no_identity"}
        name = "inbound_http_authz_allow_total" if code == 200 else "inbound_http_authz_deny_total"
        labels = {"srv_kind": "default", "srv_name": default, **tls}
        assert metric(after, name, **labels) - metric(before, name, **labels) == 1, (client, name)
    if default == "audit":  # allowed by the audit authorization, and logged as would-be denials
        allowed = metric(after, "inbound_http_authz_allow_total", authz_name="audit")
        assert allowed - metric(before, "inbound_http_authz_allow_total", authz_name="audit") == 3
        # (a few lines a second at most: a flood of requests must not flood the log)
        mesh.wait_log(LOG, "allowed by the audit policy .* would be denied otherwise", since=since)


# -- 2. MeshTLSAuthentication ---------------------------------------------------------------

MESH_TLS = {  # how the authentication names the client → (allowed, denied)
    "literal identity": ({"identities": [identity(ALPHA)]}, ALPHA, BETA),
    "suffix": ({"identities": ["*." + identity(BETA).partition(".")[2]]}, BETA, GAMMA),
    "service account": ({"identityRefs": [{"kind": "ServiceAccount", "name": BETA}]}, BETA, ALPHA),
}  # fmt: skip


@pytest.mark.parametrize("how", list(MESH_TLS))
def test_mesh_tls_authentication_admits_the_named_client_only(
    mesh: PodMesh, policy: Policy, how: str
) -> None:
    spec, allowed, denied = MESH_TLS[how]
    tag = "mtls-" + how.split()[0]
    policy.set(res("MeshTLSAuthentication", tag, spec),
               *servers_for(tag, ref("MeshTLSAuthentication", tag)))  # fmt: skip
    before = mesh.metrics(SERVER)
    ok = Outcome(mesh, allowed)
    assert ok.allowed(), ok
    assert ok.http.json()["meshlet-client-id"] == [identity(allowed)]
    refused = Outcome(mesh, denied)
    assert refused.denied(), refused
    assert status(mesh, PLAIN) == 403
    after = mesh.metrics(SERVER)

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    for client, verdict in ((allowed, "allow"), (denied, "deny")):
        who = {"client_id": identity(client), "tls": "true"}
        http = delta(f"inbound_http_authz_{verdict}_total", srv_name=f"{tag}-{HTTP}", **who)
        grpc = delta(f"inbound_http_authz_{verdict}_total", srv_name=f"{tag}-{GRPC}", **who)
        tcp = delta(f"inbound_tcp_authz_{verdict}_total", srv_name=f"{tag}-{TCP}", **who)
        assert (http, grpc, tcp) == (2, 1, 1), (client, verdict)
    assert delta("inbound_http_authz_deny_total", srv_name=f"{tag}-{HTTP}", tls="no_identity") == 1


# -- 3. NetworkAuthentication ---------------------------------------------------------------


def test_network_authentication_with_an_exception(mesh: PodMesh, policy: Policy) -> None:
    nets = {"networks": [{"cidr": "10.78.0.0/24", "except": [f"{IPS[ALPHA]}/32"]}]}
    policy.set(res("NetworkAuthentication", "pods", nets),
               *servers_for("net", ref("NetworkAuthentication", "pods")))  # fmt: skip
    before = mesh.metrics(SERVER)
    for client in (BETA, PLAIN):  # inside the network, meshed or not
        assert status(mesh, client) == 200, client
        assert mesh.tcp(client, IPS[SERVER], TCP, "ping\n")["received"] == GREETING
    assert status(mesh, ALPHA) == 403  # the exception, though meshed
    assert mesh.tcp(ALPHA, IPS[SERVER], TCP, "ping\n")["received"] == ""
    after = mesh.metrics(SERVER)
    labels = {"srv_name": f"net-{TCP}", "client_id": identity(ALPHA)}
    deny = "inbound_tcp_authz_deny_total"
    assert metric(after, deny, **labels) - metric(before, deny, **labels) == 1


# -- 4. routes ------------------------------------------------------------------------------


def route(name: str, server_name: str, method: str, path: str) -> dict[str, Any]:
    match = {"path": {"type": "PathPrefix", "value": path}, "method": method}
    spec = {"parentRefs": [ref("Server", server_name)], "rules": [{"matches": [match]}]}
    return res("HTTPRoute", name, spec, "v1beta3")


def test_route_level_authorization(mesh: PodMesh, policy: Policy) -> None:
    caller = {"identityRefs": [{"kind": "ServiceAccount", "name": ALPHA}]}
    admins = {"identityRefs": [{"kind": "ServiceAccount", "name": BETA}]}
    policy.set(
        server("routes", HTTP),
        route("public", "routes", "GET", "/public"),
        route("admin", "routes", "POST", "/admin"),
        res("MeshTLSAuthentication", "caller", caller),
        res("MeshTLSAuthentication", "admins", admins),
        authorization("public", ref("HTTPRoute", "public"), ref("MeshTLSAuthentication", "caller")),
        authorization("admin", ref("HTTPRoute", "admin"), ref("MeshTLSAuthentication", "admins")),
    )
    before = mesh.metrics(SERVER)
    assert status(mesh, ALPHA, "/public/page") == 200
    assert status(mesh, ALPHA, "/admin", "-X", "POST") == 403
    assert status(mesh, BETA, "/admin", "-X", "POST") == 200
    assert status(mesh, ALPHA, "/admin") == 404  # GET /admin: no route matches
    after = mesh.metrics(SERVER)
    for name, route_name, expected in (
        ("inbound_http_authz_allow_total", "public", 1),
        ("inbound_http_authz_deny_total", "admin", 1),
    ):
        labels = {"srv_name": "routes", "route_name": route_name, "client_id": identity(ALPHA)}
        assert metric(after, name, **labels) - metric(before, name, **labels) == expected
    nf = "inbound_http_route_not_found_total"
    assert metric(after, nf, srv_name="routes") - metric(before, nf, srv_name="routes") == 1


# -- 4b. one request, one meaning ----------------------------------------------------------

SPELLINGS = ["/admin", "/%61dmin", "/adm%69n", "/./admin", "//admin", "/x/../admin",
             "/%2e/admin", "/admin/.././admin"]  # fmt: skip


def private_admin(tag: str, **route_spec: Any) -> list[dict[str, Any]]:
    """A Server on HTTP, a public route `/` for every meshed identity and a route for `/admin`
    (its spec changed by `route_spec`) that only beta may call."""
    admin = route(f"{tag}-admin", tag, "GET", "/admin")
    admin["spec"].update(route_spec)
    return [
        server(tag, HTTP),
        route(f"{tag}-public", tag, "GET", "/"),
        admin,
        res("MeshTLSAuthentication", f"{tag}-anyone", {"identities": ["*"]}),
        res("MeshTLSAuthentication", f"{tag}-admins",
            {"identityRefs": [{"kind": "ServiceAccount", "name": BETA}]}),
        authorization(f"{tag}-public", ref("HTTPRoute", f"{tag}-public"),
                      ref("MeshTLSAuthentication", f"{tag}-anyone")),
        authorization(f"{tag}-admin", ref("HTTPRoute", f"{tag}-admin"),
                      ref("MeshTLSAuthentication", f"{tag}-admins")),
    ]  # fmt: skip


@pytest.mark.parametrize("h2", [False, True], ids=["http1", "h2"])
def test_a_private_route_is_not_reached_by_another_spelling_of_its_path(
    mesh: PodMesh, policy: Policy, h2: bool
) -> None:
    """curl sends each spelling as written (`--path-as-is`): the proxy routes and authorizes the
    one form the app is sent, so alpha is refused every spelling and beta's reach the app as
    `/admin`."""
    if policy.current[HTTP] != f"server.{G}/spell":
        policy.set(*private_admin("spell"))
    options = ["--path-as-is", *(["--http2-prior-knowledge"] if h2 else [])]
    for path in SPELLINGS:
        assert mesh.curl(ALPHA, url(path), *options).status == 403, path
        allowed = mesh.curl(BETA, url(path), *options)
        assert allowed.status == 200 and allowed.json()["path"] == "/admin", (path, allowed)
    # Paths are case-sensitive, as Gateway API's matches: /ADMIN is another (public) path.
    assert mesh.curl(ALPHA, url("/ADMIN"), *options).json()["path"] == "/ADMIN"


def test_a_fragment_or_a_broken_encoding_is_refused(mesh: PodMesh, policy: Policy) -> None:
    """No request target carries a fragment, and servers differ on cutting one: 400, from the
    client's own proxy (meshed) and from the server's (plain, unmeshed)."""
    if policy.current[HTTP] != f"server.{G}/spell":
        policy.set(*private_admin("spell"))
    for client in (ALPHA, PLAIN):
        for target in ("/admin#frag", "/adm%zzin"):
            sent = mesh.tcp(client, IPS[SERVER], HTTP, f"GET {target} HTTP/1.1\r\nHost: s\r\n\r\n")
            assert sent["received"].startswith("HTTP/1.1 400 "), (client, target, sent)
            assert '"path"' not in sent["received"]  # the app never saw it


def test_a_private_host_is_not_reached_by_another_spelling_of_its_name(
    mesh: PodMesh, policy: Policy
) -> None:
    policy.set(*private_admin("hosts", hostnames=["admin.store"]))
    for host in ("admin.store", "admin.store.", "ADMIN.Store.", "admin.store.:8080"):
        for h2 in ([], ["--http2-prior-knowledge"]):
            denied = mesh.curl(ALPHA, url("/admin"), "-H", f"Host: {host}", *h2)
            assert denied.status == 403, (host, h2, denied)
            assert mesh.curl(BETA, url("/admin"), "-H", f"Host: {host}", *h2).status == 200
    for host in ("[admin.store]", "admin.store%00", "admin..store"):
        assert mesh.curl(ALPHA, url("/admin"), "-H", f"Host: {host}").status == 400, host


# -- 4c. what is HTTP is never opaque -------------------------------------------------------


@pytest.mark.parametrize(
    "line", ["GET\t/admin\tHTTP/1.1", " GET /admin HTTP/1.1", "\x0bGET\x0c/admin HTTP/1.1"]
)
def test_a_request_line_with_odd_spaces_is_http_and_never_reaches_the_app(
    mesh: PodMesh, policy: Policy, line: str
) -> None:
    """http.server (wsgiref, werkzeug's and Django's development servers) reads these lines as
    requests; relayed as opaque TCP they would reach it with a forged identity header and no
    route check. The client's proxy (alpha) or the server's (plain) answers 400 instead."""
    policy.set(default="all-unauthenticated")
    forged = f"{line}\r\nHost: s\r\nmeshlet-client-id: {identity(BETA)}\r\n\r\n"
    plain = mesh.tcp(ALPHA, IPS[SERVER], STDLIB, "GET / HTTP/1.1\r\nHost: s\r\n\r\n")
    assert plain["received"].startswith("HTTP/1.1 200 ")  # http.server serves a plain request
    assert identity(ALPHA) in plain["received"]
    for client in (ALPHA, PLAIN):
        sent = mesh.tcp(client, IPS[SERVER], STDLIB, forged)
        assert sent["received"].startswith("HTTP/1.1 400 "), (client, sent)
        assert identity(BETA) not in sent["received"]


# -- 4d. a request's end is its end --------------------------------------------------------


def test_a_fin_in_the_middle_of_a_body_releases_the_apps_request(
    mesh: PodMesh, policy: Policy
) -> None:
    """20 POSTs declaring a million bytes, each sending one and then its FIN, from a meshed
    client (through both proxies) and an unmeshed one (the server's proxy alone): each gets a
    400 and the app is not left waiting for the rest of any body."""
    policy.set(default="all-unauthenticated")
    head = "POST /upload HTTP/1.1\r\nHost: s\r\nContent-Length: 1000000\r\n\r\nx"
    for client in (ALPHA, PLAIN):
        for _ in range(10):
            sent = mesh.tcp(client, IPS[SERVER], HTTP, head)
            assert sent["received"].startswith("HTTP/1.1 400 "), (client, sent)
            assert "before the request body ended" in sent["received"]
    deadline = time.monotonic() + 5
    while (waiting := mesh.curl(ALPHA, url("/_waiting")).json()["waiting"]) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.1)
    assert waiting == 0


# -- 5. rate limits -------------------------------------------------------------------------


def everyone(tag: str) -> list[dict[str, Any]]:
    return [
        server(tag, HTTP),
        res("MeshTLSAuthentication", tag, {"identities": ["*"]}),
        authorization(tag, ref("Server", tag), ref("MeshTLSAuthentication", tag)),
    ]


def limit(tag: str, **spec: Any) -> dict[str, Any]:
    return res("HTTPLocalRateLimitPolicy", tag, {"targetRef": ref("Server", tag), **spec})


def test_the_total_rate_limit_answers_429_past_it(mesh: PodMesh, policy: Policy) -> None:
    policy.set(*everyone("rl-total"), limit("rl-total", total={"requestsPerSecond": 5}))
    before = mesh.metrics(SERVER)
    codes = mesh.curl_codes(ALPHA, url(), 20)
    assert codes[:5] == [200] * 5 and 429 in codes and set(codes) == {200, 429}, codes
    assert codes.count(200) <= 8  # 5 at once, and at most a few refilled while they ran
    after = mesh.metrics(SERVER)
    rl = "inbound_http_local_ratelimit_total"
    labels = {"srv_name": "rl-total", "ratelimit_scope": "total", "client_id": identity(ALPHA)}
    assert metric(after, rl, **labels) - metric(before, rl, **labels) == codes.count(429)


def test_a_per_identity_limit_leaves_other_identities_their_share(
    mesh: PodMesh, policy: Policy
) -> None:
    policy.set(*everyone("rl-id"), limit("rl-id", identity={"requestsPerSecond": 5}))
    before = mesh.metrics(SERVER)
    heavy = mesh.curl_codes(ALPHA, url(), 30)
    assert heavy[:5] == [200] * 5 and heavy.count(429) >= 20, heavy
    light = mesh.curl_codes(BETA, url(), 5)
    assert light == [200] * 5  # beta's own bucket, whatever alpha did
    after = mesh.metrics(SERVER)
    rl = "inbound_http_local_ratelimit_total"
    for client, refused in ((ALPHA, heavy.count(429)), (BETA, 0)):
        labels = {"srv_name": "rl-id", "ratelimit_scope": "identity", "client_id": identity(client)}
        assert metric(after, rl, **labels) - metric(before, rl, **labels) == refused, client


# -- 6. a change applies at once -----------------------------------------------------------


def only(tag: str, client: str) -> list[dict[str, Any]]:
    spec = {"identities": [identity(client)]}
    return [res("MeshTLSAuthentication", tag, spec),
            *servers_for(tag, ref("MeshTLSAuthentication", tag))]  # fmt: skip


def test_a_policy_change_applies_to_the_next_request_within_a_second(
    mesh: PodMesh, policy: Policy
) -> None:
    policy.set(*only("change-a", ALPHA))
    assert (status(mesh, ALPHA), status(mesh, BETA)) == (200, 403)
    policy.write(*only("change-b", BETA))
    written = time.monotonic()
    while status(mesh, BETA) != 200:
        assert time.monotonic() - written < 1.0, "beta still denied a second after the change"
    assert status(mesh, ALPHA) == 403
    policy.wait()


# -- 7. the controller goes away and comes back ---------------------------------------------


def test_without_the_controller_the_last_policy_stands_then_changes_resume(
    mesh: PodMesh, policy: Policy
) -> None:
    policy.set(*only("gone-a", ALPHA))
    since = mesh.log_size(LOG)
    mesh.kill("policy")
    try:
        mesh.wait_log(LOG, r"WatchPort :\d+ from the policy controller .* failed", since=since)
        assert Outcome(mesh, ALPHA).allowed()
        assert Outcome(mesh, BETA).denied()
        policy.write(*only("gone-b", BETA))  # a change nobody serves yet
        time.sleep(0.5)
        assert (status(mesh, ALPHA), status(mesh, BETA)) == (200, 403)
    finally:
        mesh.start_again("policy")
    policy.wait()
    assert (status(mesh, ALPHA), status(mesh, BETA)) == (403, 200)


# -- 8. hostile clients ---------------------------------------------------------------------


def test_a_forged_identity_header_never_grants_access(mesh: PodMesh, policy: Policy) -> None:
    policy.set(*only("forged", ALPHA))
    forged = [f"{h}: {identity(ALPHA)}" for h in ("l5d-client-id", "meshlet-client-id")]
    headers = [arg for h in forged for arg in ("-H", h)]
    for client in (PLAIN, BETA):
        assert status(mesh, client, "/", *headers) == 403, client
        assert status(mesh, client, "/", "--http2-prior-knowledge", *headers) == 403, client
        metadata = (("l5d-client-id", identity(ALPHA)),)
        assert mesh.grpc(client, f"{IPS[SERVER]}:{GRPC}", metadata)["code"] == "PERMISSION_DENIED"
    seen = mesh.curl(ALPHA, url(), *headers).json()  # the real alpha: its own identity, once
    assert seen["meshlet-client-id"] == [identity(ALPHA)] and seen["l5d-client-id"] == []


def test_an_allowed_unmeshed_client_cannot_pass_on_a_forged_identity(
    mesh: PodMesh, policy: Policy
) -> None:
    policy.set(default="all-unauthenticated")
    forged = ("-H", f"l5d-client-id: {identity(ALPHA)}",
              "-H", f"meshlet-client-id: {identity(ALPHA)}")  # fmt: skip
    seen = mesh.curl(PLAIN, url(), *forged).json()
    assert seen["meshlet-client-id"] == [] and seen["l5d-client-id"] == []


def test_an_unmeshed_client_against_all_authenticated(mesh: PodMesh, policy: Policy) -> None:
    policy.set(default="all-authenticated")
    assert Outcome(mesh, PLAIN).denied()
    assert Outcome(mesh, ALPHA).allowed()


def test_an_opaque_port_under_deny_closes_connections(mesh: PodMesh, policy: Policy) -> None:
    policy.set(default="deny")
    before = mesh.metrics(SERVER)
    for client in (ALPHA, PLAIN):
        assert mesh.tcp(client, IPS[SERVER], TCP, "ping\n")["received"] == "", client
    after = mesh.metrics(SERVER)
    deny = "inbound_tcp_authz_deny_total"
    assert metric(after, deny, srv_name="deny") - metric(before, deny, srv_name="deny") == 2


def test_the_pods_own_address_and_loopback_bypass_the_proxy_as_in_linkerd(
    mesh: PodMesh, policy: Policy
) -> None:
    """As with linkerd-init: a pod's connections to itself (its own address or loopback) leave
    through `lo`, which the rules ignore, so they reach the app without its proxy: no policy
    applies, none is counted, and no identity is passed."""
    policy.set(default="deny")
    before = mesh.metrics(SERVER)
    for host in ("127.0.0.1", IPS[SERVER]):
        answer = mesh.curl(SERVER, f"http://{host}:{HTTP}/self")
        assert answer.status == 200 and answer.json()["meshlet-client-id"] == [], host
        assert mesh.tcp(SERVER, host, TCP, "ping\n")["received"] == GREETING
    after = mesh.metrics(SERVER)
    for name in ("inbound_http_authz_allow_total", "inbound_http_authz_deny_total",
                 "inbound_tcp_authz_allow_total", "inbound_tcp_authz_deny_total"):  # fmt: skip
        assert metric(after, name) == metric(before, name), name
    assert status(mesh, ALPHA) == 403  # while from another pod, deny stands


def test_ipv6_is_redirected_authenticated_and_authorized_as_ipv4(
    mesh: PodMesh, policy: Policy
) -> None:
    """The server's IPv6 address: the client's proxy gets the request through meshlet-init's
    ip6tables rules, learns the server's identity from the destination by that address, and
    speaks mTLS to the server's proxy, which applies the same policy: the named client is
    admitted (its identity the one the app sees), another meshed client and an unmeshed one
    (whose connection the server's ip6tables rules also send to its proxy) are refused."""
    policy.set(res("MeshTLSAuthentication", "v6", {"identities": [identity(ALPHA)]}),
               *servers_for("v6", ref("MeshTLSAuthentication", "v6")))  # fmt: skip
    target = f"http://[{mesh.ip6(SERVER)}]:{HTTP}/hello"
    before, alpha_before = mesh.metrics(SERVER), mesh.metrics(ALPHA)
    ok = mesh.curl(ALPHA, target, "-g")
    assert ok.status == 200, ok
    assert ok.json()["meshlet-client-id"] == [identity(ALPHA)]
    assert mesh.curl(BETA, target, "-g").status == 403
    assert mesh.curl(PLAIN, target, "-g").status == 403
    after, alpha_after = mesh.metrics(SERVER), mesh.metrics(ALPHA)

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    name = f"v6-{HTTP}"
    assert delta("inbound_http_authz_allow_total", srv_name=name, client_id=identity(ALPHA),
                 tls="true") == 1  # fmt: skip
    assert delta("inbound_http_authz_deny_total", srv_name=name, client_id=identity(BETA),
                 tls="true") == 1  # fmt: skip
    assert delta("inbound_http_authz_deny_total", srv_name=name, tls="no_identity") == 1
    # alpha's proxy: one request to the server's IPv6 address, over mTLS to its identity
    sent = {"direction": "outbound", "tls": "true", "server_id": identity(SERVER)}
    assert metric(alpha_after, "request_total", **sent) - metric(
        alpha_before, "request_total", **sent) == 1  # fmt: skip
