"""HTTP/1.1 head rules: what is refused, what is forwarded, how responses are re-framed."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshlet.api.target import EscapedSlashes
from meshlet.proxy.core.header_modifier import compile_modifier
from meshlet.proxy.http.contract import Redirection
from meshlet.proxy.http.h1head import (
    Body,
    Rejection,
    RequestHead,
    ResponseHead,
    last_chunk,
    local_response,
    modify_head,
    parse_request,
    parse_response,
)


def request(
    *fields: tuple[bytes, bytes],
    method: bytes = b"GET",
    target: bytes = b"/",
    version: str = "1.1",
    add: tuple[tuple[bytes, bytes], ...] = (),
) -> RequestHead:
    head = parse_request(method, target, version, list(fields), add)
    assert isinstance(head, RequestHead), head
    return head


def refused(*fields: tuple[bytes, bytes], target: bytes = b"/", **kw: str | bytes) -> int:
    method = kw.get("method", b"GET")
    version = kw.get("version", "1.1")
    assert isinstance(method, bytes) and isinstance(version, str)
    head = parse_request(method, target, version, list(fields))
    assert isinstance(head, Rejection), head
    return head.status


@pytest.mark.parametrize("connection", [b"X-Private", b" x-private ", b"close, X-Private"])
def test_a_field_named_by_connection_is_dropped_however_the_option_is_written(
    connection: bytes,
) -> None:
    head = request((b"Host", b"web"), (b"Connection", connection), (b"X-Private", b"1"))
    assert b"x-private" not in head.head.lower()
    upstream = [(b"Connection", connection), (b"X-Private", b"1"), (b"Content-Length", b"0")]
    response = parse_response(200, upstream, head, close=False)
    assert isinstance(response, ResponseHead) and b"x-private" not in response.head.lower()


def test_forwarded_head_is_origin_form_http11_without_hop_by_hop_fields() -> None:
    head = request(
        (b"Host", b"web.default:8080"),
        (b"Accept", b"*/*"),
        (b"Connection", b"keep-alive, X-Private"),
        (b"X-Private", b"1"),
        (b"Keep-Alive", b"timeout=5"),
        (b"Proxy-Connection", b"keep-alive"),
        (b"TE", b"trailers"),
        (b"Trailer", b"X-T"),
        (b"meshlet-client-id", b"forged"),
        (b"Content-Length", b"3"),
        method=b"POST",
        target=b"/a?b=c",
        add=((b"meshlet-client-id", b"web.default.serviceaccount.identity"),),
    )
    assert head.head == (
        b"POST /a?b=c HTTP/1.1\r\nHost: web.default:8080\r\nAccept: */*\r\n"
        b"Content-Length: 3\r\nTE: trailers\r\n"
        b"meshlet-client-id: web.default.serviceaccount.identity\r\n\r\n"
    )
    assert (head.authority, head.body, head.length, head.keep_alive) == (
        "web.default:8080",
        Body.LENGTH,
        3,
        True,
    )


def test_absolute_form_becomes_origin_form_and_its_authority_wins() -> None:
    head = request((b"Host", b"ignored"), target=b"HTTP://api.example:81/p/q?x=1")
    assert head.authority == "api.example:81"
    assert head.head == b"GET /p/q?x=1 HTTP/1.1\r\nHost: api.example:81\r\n\r\n"
    assert request(target=b"http://h:1").head.startswith(b"GET / HTTP/1.1\r\nHost: h:1\r\n")
    assert request(target=b"http://h:1?x").head.startswith(b"GET /?x HTTP/1.1\r\n")


def test_no_host_means_no_authority() -> None:
    head = request(version="1.0")
    assert head.authority is None
    assert head.head == b"GET / HTTP/1.1\r\n\r\n"
    assert request((b"Host", b"")).authority is None


@pytest.mark.parametrize(
    ("version", "connection", "keep_alive"),
    [
        ("1.1", b"", True),
        ("1.1", b"Close", False),
        ("1.1", b"keep-alive, close", False),
        ("1.0", b"", False),
        ("1.0", b"Keep-Alive", True),
    ],
)
def test_keep_alive_follows_the_version_and_connection(
    version: str, connection: bytes, keep_alive: bool
) -> None:
    fields = [(b"Connection", connection)] if connection else []
    assert request(*fields, version=version).keep_alive is keep_alive


def test_connection_cannot_drop_framing_or_host() -> None:
    head = request(
        (b"Host", b"svc"),
        (b"Connection", b"content-length, host, transfer-encoding"),
        (b"Content-Length", b"2"),
        method=b"PUT",
    )
    assert b"Host: svc\r\n" in head.head and b"Content-Length: 2\r\n" in head.head


def test_chunked_request_is_forwarded_chunked() -> None:
    head = request((b"Transfer-Encoding", b" Chunked "), method=b"POST")
    assert head.body is Body.CHUNKED
    assert head.head == b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"


def test_websocket_upgrade_is_kept_and_h2c_is_dropped() -> None:
    ws = request((b"Connection", b"Upgrade"), (b"Upgrade", b"websocket"))
    assert ws.upgrade
    assert ws.head.endswith(b"Connection: upgrade\r\nUpgrade: websocket\r\n\r\n")
    h2c = request(
        (b"Connection", b"Upgrade, HTTP2-Settings"),
        (b"Upgrade", b"h2c"),
        (b"HTTP2-Settings", b"AAMAAABkAAQAAP__"),
    )
    assert not h2c.upgrade
    assert h2c.head == b"GET / HTTP/1.1\r\n\r\n"
    mixed = request((b"Connection", b"upgrade"), (b"Upgrade", b"h2c, websocket"))
    assert mixed.upgrade and mixed.head.endswith(b"Upgrade: websocket\r\n\r\n")
    assert not request((b"Upgrade", b"websocket")).upgrade  # no `Connection: upgrade`
    assert not request((b"Connection", b"upgrade"), (b"Upgrade", b"ws"), version="1.0").upgrade


def test_expect_100_continue_is_noted_and_forwarded() -> None:
    head = request((b"Expect", b"100-Continue"), (b"Content-Length", b"9"), method=b"PUT")
    assert head.expect_continue
    assert b"Expect: 100-Continue\r\n" in head.head


@pytest.mark.parametrize(
    ("fields", "kw", "status"),
    [
        (((b"Content-Length", b"1"), (b"Transfer-Encoding", b"chunked")), {}, 400),
        (((b"Content-Length", b"1"), (b"Content-Length", b"2")), {}, 400),
        (((b"Content-Length", b"+1"),), {}, 400),
        (((b"Content-Length", b"1" * 19),), {}, 400),
        (((b"Transfer-Encoding", b"gzip, chunked"),), {}, 501),
        (((b"Transfer-Encoding", b"chunked, chunked"),), {}, 400),
        (((b"Transfer-Encoding", b"chunked, gzip"),), {}, 400),
        (((b"Transfer-Encoding", b"xchunked"),), {}, 400),
        (((b"Transfer-Encoding", b"chunked"),), {"version": "1.0"}, 400),
        (((b"Host", b"a"), (b"HOST", b"b")), {}, 400),
        (((b"Host", b"a b"),), {}, 400),
        (((b"Host", b"a/b"),), {}, 400),
        ((), {"version": "2.0"}, 505),
        ((), {"version": "0.9"}, 505),
        ((), {"method": b"CONNECT"}, 405),
    ],
)
def test_refused_heads(
    fields: tuple[tuple[bytes, bytes], ...], kw: dict[str, str | bytes], status: int
) -> None:
    assert refused(*fields, **kw) == status


@pytest.mark.parametrize(
    "target", [b"svc:80", b"*", b"https://svc/", b"http:///x", b"http://u@svc/", b"http://a b/"]
)
def test_refused_targets(target: bytes) -> None:
    assert refused((b"Host", b"svc"), target=target) == 400


@pytest.mark.parametrize(
    ("target", "host", "path", "authority"),
    [
        (b"/%61dmin", b"svc", b"/admin", "svc"),
        (b"/x/../admin?q=1", b"svc", b"/admin?q=1", "svc"),
        (b"//admin", b"ADMIN.Store.", b"/admin", "admin.store"),
        (b"http://Admin.Store.:8080/./a%7e", b"ignored", b"/a~", "admin.store:8080"),
    ],
)
def test_the_target_and_host_forwarded_are_the_normal_ones_routed_on(
    target: bytes, host: bytes, path: bytes, authority: str
) -> None:
    head = request((b"Host", host), target=target)
    assert head.path == path.decode() and head.authority == authority
    assert head.head.startswith(b"GET " + path + b" HTTP/1.1\r\nHost: " + authority.encode())


@pytest.mark.parametrize(
    ("target", "host"),
    [
        (b"/admin#frag", b"svc"),
        (b"/a%zz", b"svc"),
        (b"/", b"[admin.store]"),
        (b"/", b"admin.store%00"),
        (b"/", b"admin..store"),
        (b"http://[admin.store]/", b"svc"),
    ],
)
def test_targets_and_hosts_without_one_meaning_are_refused(target: bytes, host: bytes) -> None:
    assert refused((b"Host", host), target=target) == 400


def test_escaped_slashes_follow_the_setting() -> None:
    def path(slashes: EscapedSlashes) -> str | int:
        head = parse_request(b"GET", b"/a%2fb", "1.1", [(b"Host", b"svc")], (), slashes)
        return head.status if isinstance(head, Rejection) else head.path

    assert path(EscapedSlashes.KEEP) == "/a%2Fb"
    assert path(EscapedSlashes.DECODE) == "/a/b"
    assert path(EscapedSlashes.REJECT) == 400


def test_asterisk_form_only_for_options() -> None:
    assert request((b"Host", b"svc"), method=b"OPTIONS", target=b"*").head.startswith(
        b"OPTIONS * HTTP/1.1\r\n"
    )


_names = st.sampled_from(
    [b"Connection", b"keep-alive", b"TE", b"Trailer", b"Upgrade", b"Proxy-Connection",
     b"meshlet-client-id", b"MESHLET-PROXY-ERROR", b"l5d-dst-canonical", b"HTTP2-Settings",
     b"L5d-Client-Id", b"l5d-proxy-error",
     b"X-A", b"Accept", b"Host", b"Expect"]
)  # fmt: skip
_values = st.sampled_from([b"", b"close", b"x-a", b"h2c", b"websocket", b"trailers", b"v"])


@given(st.lists(st.tuples(_names, _values), max_size=12))
def test_no_internal_or_hop_by_hop_field_is_ever_forwarded(
    fields: list[tuple[bytes, bytes]],
) -> None:
    head = parse_request(b"GET", b"/", "1.1", fields)
    if isinstance(head, Rejection):
        assert head.status == 400  # several Host fields
        return
    forwarded = [line.split(b":")[0].lower() for line in head.head.split(b"\r\n")[1:] if line]
    internal = {b"meshlet-client-id", b"meshlet-proxy-error", b"l5d-dst-canonical",
                b"l5d-client-id", b"l5d-proxy-error"}  # fmt: skip
    hop = {b"keep-alive", b"trailer", b"proxy-connection", b"http2-settings"}
    assert not (set(forwarded) & (internal | hop))
    assert forwarded.count(b"host") <= 1
    assert forwarded.count(b"te") <= 1 and forwarded.count(b"connection") <= 1


# -- responses -----------------------------------------------------------------------------


def response(
    status: int, *fields: tuple[bytes, bytes], req: RequestHead | None = None, close: bool = False
) -> ResponseHead:
    head = parse_response(status, list(fields), req or request(), close)
    assert isinstance(head, ResponseHead), head
    return head


def test_length_delimited_response_keeps_its_length() -> None:
    head = response(200, (b"Content-Length", b"5"), (b"Connection", b"keep-alive"))
    assert head.head == b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n"
    assert (head.body_in, head.body_out, head.close) == (Body.LENGTH, Body.LENGTH, False)


def test_chunked_or_close_delimited_response_is_chunked_for_http11_clients() -> None:
    for fields in ([(b"Transfer-Encoding", b"chunked")], []):
        head = response(200, *fields, (b"X", b"1"))
        assert head.head == b"HTTP/1.1 200 OK\r\nX: 1\r\nTransfer-Encoding: chunked\r\n\r\n"
        assert head.body_out is Body.CHUNKED


def test_http10_clients_get_close_delimited_bodies() -> None:
    old = request(version="1.0")
    head = response(200, (b"Transfer-Encoding", b"chunked"), req=old)
    assert (head.body_out, head.close) == (Body.EOF, True)
    assert head.head == b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n"
    kept = request((b"Connection", b"keep-alive"), version="1.0")
    assert response(200, (b"Content-Length", b"0"), req=kept).head.endswith(
        b"Connection: keep-alive\r\n\r\n"
    )


def test_bodiless_responses() -> None:
    head_req = request(method=b"HEAD")
    head = response(200, (b"Content-Length", b"100"), req=head_req)
    assert (head.body_in, head.body_out) == (Body.NONE, Body.NONE)
    assert b"Content-Length: 100" in head.head
    assert response(304).body_out is Body.NONE
    assert response(204).head == b"HTTP/1.1 204 No Content\r\n\r\n"


def test_informational_and_switching_heads() -> None:
    cont = response(100)
    assert (cont.head, cont.body_out) == (b"HTTP/1.1 100 Continue\r\n\r\n", Body.NONE)
    ws = request((b"Connection", b"upgrade"), (b"Upgrade", b"websocket"))
    switched = response(101, (b"Upgrade", b"websocket"), (b"Connection", b"Upgrade"), req=ws)
    assert switched.head == (
        b"HTTP/1.1 101 Switching Protocols\r\nConnection: upgrade\r\nUpgrade: websocket\r\n\r\n"
    )
    unasked = parse_response(101, [(b"Upgrade", b"h2c")], request(), False)
    assert isinstance(unasked, Rejection) and unasked.status == 502


def test_close_is_announced() -> None:
    assert response(200, (b"Content-Length", b"0"), close=True).head.endswith(
        b"Connection: close\r\n\r\n"
    )
    asked = request((b"Connection", b"close"))
    assert response(200, (b"Content-Length", b"0"), req=asked).close


def test_unrelayable_responses_are_502() -> None:
    for fields in (
        [(b"Transfer-Encoding", b"gzip")],
        [(b"Content-Length", b"x")],
        [(b"Content-Length", b"1"), (b"Content-Length", b"2")],
    ):
        head = parse_response(200, fields, request(), False)
        assert isinstance(head, Rejection) and head.status == 502


def test_last_chunk_relays_only_safe_trailers() -> None:
    trailers = [(b"grpc-status", b"0"), (b"Content-Length", b"9"), (b"Transfer-Encoding", b"x")]
    assert last_chunk(trailers) == b"0\r\ngrpc-status: 0\r\n\r\n"
    assert last_chunk([]) == b"0\r\n\r\n"


def test_local_response_names_the_reason() -> None:
    assert local_response(502, "refused\r\nX: injected", close=True) == (
        b"HTTP/1.1 502 Bad Gateway\r\nContent-Type: text/plain\r\nContent-Length: 19\r\n"
        b"meshlet-proxy-error: refusedX: injected\r\nConnection: close\r\n\r\n"
        b"refusedX: injected\n"
    )
    assert b"Connection: keep-alive" in local_response(503, "x", close=False, http10=True)


def test_a_redirect_is_answered_with_its_location_and_no_error_header() -> None:
    where = Redirection("http://api/new?q=é\r\nX: y")
    assert local_response(301, where, close=False) == (
        b"HTTP/1.1 301 Moved Permanently\r\nLocation: http://api/new?q=%C3%A9%0D%0AX:%20y\r\n"
        b"Content-Length: 0\r\n\r\n"
    )


def test_a_routes_filters_rewrite_the_forwarded_head_and_leave_its_framing_alone() -> None:
    head = request(
        (b"Host", b"web:80"), (b"X-Tenant", b"blue"), (b"X-Debug", b"1"), (b"x-debug", b"2"),
        (b"Accept", b"a: b"), (b"Content-Length", b"3"), (b"meshlet-client-id", b"forged"),
        method=b"POST", add=((b"meshlet-client-id", b"web.ns"),),
    )  # fmt: skip
    modifier = compile_modifier(add=[("x-region", b"eu")], set=[("x-tenant", b"red")],
                                remove=["X-DEBUG"])  # fmt: skip
    assert modify_head(head.head, modifier) == (
        b"POST / HTTP/1.1\r\nHost: web:80\r\nAccept: a: b\r\nContent-Length: 3\r\n"
        b"meshlet-client-id: web.ns\r\nx-region: eu\r\nx-tenant: red\r\n\r\n"
    )


def test_a_head_without_fields_or_with_an_empty_value_is_rewritten_whole() -> None:
    bare = request(version="1.0").head
    assert bare == b"GET / HTTP/1.1\r\n\r\n"
    assert modify_head(bare, compile_modifier(add=[("x-a", b"1")])) == (
        b"GET / HTTP/1.1\r\nx-a: 1\r\n\r\n"
    )
    empty = request((b"x-empty", b""), (b"x-gone", b"1")).head
    assert modify_head(empty, compile_modifier(remove=["x-gone"])) == (
        b"GET / HTTP/1.1\r\nx-empty: \r\n\r\n"
    )
