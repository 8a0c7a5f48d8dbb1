"""HTTP/2 header blocks: the checks the proxy runs instead of h2's, and the rewriting."""

from __future__ import annotations

import pytest
from hpack import NeverIndexedHeaderTuple
from hypothesis import given
from hypothesis import strategies as st

from meshlet.api.target import EscapedSlashes
from meshlet.proxy.core.header_modifier import compile_modifier
from meshlet.proxy.http import h2headers
from meshlet.proxy.http.contract import Redirection
from meshlet.proxy.http.h2headers import (
    CONNECTION_HEADERS,
    Malformed,
    Request,
    Response,
    local_response,
    modify_request,
    read_request,
    read_response,
    read_trailers,
)

GET = [(b":method", b"GET"), (b":scheme", b"https"), (b":path", b"/x"), (b":authority", b"web:80")]


def test_a_valid_request_is_rewritten_for_the_upstream() -> None:
    block = [
        *GET,
        (b"content-type", b"application/grpc+proto"),
        (b"meshlet-client-id", b"forged"),
        (b"l5d-dst-canonical", b"forged"),
        (b"authorization", b"Bearer t"),
        (b"te", b"Trailers"),
    ]
    request = read_request(block, [(b"meshlet-client-id", b"web.ns")], max_headers=100)
    assert isinstance(request, Request)
    assert request.authority == "web:80" and request.grpc
    assert request.headers == [
        *GET,
        (b"content-type", b"application/grpc+proto"),
        (b"authorization", b"Bearer t"),
        (b"te", b"Trailers"),
        (b"meshlet-client-id", b"web.ns"),
    ]
    authorization = request.headers[5]
    assert isinstance(authorization, NeverIndexedHeaderTuple)  # kept out of HPACK tables


@pytest.mark.parametrize("from_proxy", [False, True], ids=["a client", "a peer proxy"])
def test_the_orig_proto_mark_is_read_from_a_peer_proxy_only_and_never_forwarded(
    from_proxy: bool,
) -> None:
    block = [*GET, (b"meshlet-orig-proto", b"HTTP/1.1"), (b"l5d-orig-proto", b"HTTP/1.1")]
    request = read_request(block, [], max_headers=100, from_proxy=from_proxy)
    assert isinstance(request, Request)
    assert request.orig_proto is from_proxy
    assert request.headers == GET
    other = read_request([*GET, (b"meshlet-orig-proto", b"HTTP/1.0")], [], 100, from_proxy=True)
    assert isinstance(other, Request) and not other.orig_proto


def test_a_request_http1_cannot_carry_is_refused_before_it_is_downgraded() -> None:
    from meshlet.proxy.http.orig_proto import refusal

    def read(*fields: tuple[bytes, bytes]) -> Request:
        request = read_request([*GET, *fields], [], 100, from_proxy=True)
        assert isinstance(request, Request)
        return request

    assert refusal(read((b"x-ok", b"a\tb \x80"))) is None
    for field in ((b"x(y)", b"v"), (b"x-a", b"b\x01c"), (b"x/y", b"v"), (b"x-a", b"\x7f")):
        refused = refusal(read(field))
        assert isinstance(refused, Malformed) and refused.status == 400 and refused.answer


def test_a_routes_filters_change_the_request_but_not_the_proxys_own_headers() -> None:
    block = [*GET, (b"x-tenant", b"blue"), (b"x-debug", b"1"), (b"meshlet-client-id", b"forged")]
    read = read_request(block, [(b"meshlet-client-id", b"web.ns")], max_headers=100)
    assert isinstance(read, Request)
    modifier = compile_modifier(add=[("X-Region", b"eu")], set=[("x-tenant", b"red"),
                                ("Authorization", b"Bearer s")], remove=["x-debug"])  # fmt: skip
    modified = modify_request(read, modifier)
    assert modified.headers == [
        *GET,
        (b"meshlet-client-id", b"web.ns"),
        (b"x-region", b"eu"),
        (b"x-tenant", b"red"),
        (b"authorization", b"Bearer s"),
    ]
    assert isinstance(modified.headers[-1], NeverIndexedHeaderTuple)  # a credential it writes
    assert modified.authority == read.authority and modified.path == read.path


def test_the_authority_falls_back_to_host() -> None:
    block = [(b":method", b"GET"), (b":scheme", b"http"), (b":path", b"/"), (b"host", b"h:1")]
    request = read_request(block, [], 100)
    assert isinstance(request, Request) and request.authority == "h:1" and not request.grpc


def test_options_may_ask_for_the_server_itself() -> None:
    block = [(b":method", b"OPTIONS"), GET[1], (b":path", b"*"), GET[3]]
    request = read_request(block, [], 100)
    assert isinstance(request, Request) and request.path == "*"


def test_a_connect_request_needs_only_an_authority() -> None:
    request = read_request([(b":method", b"CONNECT"), (b":authority", b"db:5432")], [], 100)
    assert isinstance(request, Request) and request.authority == "db:5432"


@pytest.mark.parametrize(
    ("block", "reason"),
    [
        ([*GET, (b"X-Upper", b"1")], "invalid header name"),
        ([*GET, (b"", b"1")], "invalid header name"),
        ([*GET, (b"a b", b"1")], "invalid header name"),
        ([*GET, (b"a:b", b"1")], "invalid header name"),
        ([*GET, (b"\xff", b"1")], "invalid header name"),
        ([*GET, (b"x", b"a\nb")], "invalid value"),
        ([*GET, (b"x", b"a\x00")], "invalid value"),
        ([*GET, (b"x", b" lead")], "invalid value"),
        ([*GET, (b"x", b"trail\t")], "invalid value"),
        ([(b"x", b"1"), *GET], "after headers"),
        ([*GET, (b"x", b"1"), (b":method", b"GET")], "after headers"),
        ([*GET[:3], (b":method", b"GET")], "duplicate"),
        ([*GET, (b":status", b"200")], "not allowed"),
        ([*GET, (b":path", b"/y")], "duplicate"),
        ([(b":status", b"200"), *GET], "not allowed"),
        ([(b":protocol", b"websocket"), *GET], "not allowed"),
        (GET[1:], "no :method"),
        ([GET[0], GET[1], GET[3]], "no :scheme or :path"),
        ([GET[0], GET[1], (b":path", b""), GET[3]], "no :scheme or :path"),
        ([GET[0], GET[1], (b":path", b"x/y"), GET[3]], "not starting with /"),
        ([GET[0], GET[1], (b":path", b"*"), GET[3]], "not starting with /"),
        ([GET[0], GET[1], (b":path", b"http://a/"), GET[3]], "not starting with /"),
        ([(b":method", b"CONNECT"), GET[1], (b":authority", b"a:1")], "CONNECT"),
        ([*GET, (b"host", b"other:80")], "differs"),
        ([*GET, (b"host", b"web:80"), (b"host", b"web:80")], "more than one host"),
        ([*GET, (b"te", b"gzip")], "te other than trailers"),
        ([(b":method", b"G T"), *GET[1:]], "invalid value for :method"),
        ([(b":method", b"(GET)"), *GET[1:]], "invalid value for :method"),
        ([(b":method", b""), *GET[1:]], "invalid value for :method"),
        ([GET[0], GET[1], (b":path", b"/a b"), GET[3]], "space or control"),
        ([GET[0], GET[1], (b":path", b"/a\tb"), GET[3]], "space or control"),
        ([GET[0], GET[1], (b":path", b"/a\x7f"), GET[3]], "space or control"),
        ([(b":authority", b"a\r\n"), *GET[:3]], "invalid value"),
        *[([*GET, (name, b"x")], "connection-specific") for name in sorted(CONNECTION_HEADERS)],
    ],
)
def test_malformed_requests_are_refused(block: list[tuple[bytes, bytes]], reason: str) -> None:
    result = read_request(block, [], 100)
    assert isinstance(result, Malformed) and result.status == 400
    assert reason in result.reason


@pytest.mark.parametrize(
    ("path", "authority", "normal_path", "normal_authority"),
    [
        (b"/%61dmin", b"web:80", b"/admin", b"web:80"),
        (b"/x/../admin?a=%2e", b"Web:80", b"/admin?a=%2e", b"web:80"),
        (b"//admin", b"admin.store.", b"/admin", b"admin.store"),
        (b"/ok", b"web:80", b"/ok", b"web:80"),
    ],
)
def test_the_path_and_authority_forwarded_are_the_normal_ones_routed_on(
    path: bytes, authority: bytes, normal_path: bytes, normal_authority: bytes
) -> None:
    block = [GET[0], GET[1], (b":path", path), (b":authority", authority),
             (b"host", authority), (b"authorization", b"secret")]  # fmt: skip
    result = read_request(block, [], 100)
    assert isinstance(result, Request)
    assert (result.path, result.authority) == (normal_path.decode(), normal_authority.decode())
    sent = dict(result.headers)
    assert sent[b":path"] == normal_path
    assert sent[b":authority"] == sent[b"host"] == normal_authority
    assert any(isinstance(h, NeverIndexedHeaderTuple) for h in result.headers)


@pytest.mark.parametrize(
    ("path", "authority"),
    [
        (b"/admin#x", b"web:80"),
        (b"/a%zz", b"web:80"),
        (b"/", b"[admin.store]"),
        (b"/", b"admin.store%00"),
        (b"/", b""),
    ],
)
def test_targets_without_one_meaning_are_answered_400(path: bytes, authority: bytes) -> None:
    for _ in range(2):  # and never remembered as valid
        result = read_request([GET[0], GET[1], (b":path", path), (b":authority", authority)], [],
                              100)  # fmt: skip
        assert isinstance(result, Malformed) and result.status == 400 and result.answer


def test_escaped_slashes_follow_the_setting() -> None:
    block = [GET[0], GET[1], (b":path", b"/a%2fb"), GET[3]]
    keep = read_request(block, [], 100, EscapedSlashes.KEEP)
    decode = read_request(block, [], 100, EscapedSlashes.DECODE)
    reject = read_request(block, [], 100, EscapedSlashes.REJECT)
    assert isinstance(keep, Request) and keep.path == "/a%2Fb"
    assert isinstance(decode, Request) and decode.path == "/a/b"
    assert isinstance(reject, Malformed) and reject.status == 400 and reject.answer


def test_too_many_headers_are_431() -> None:
    result = read_request([*GET, *[(b"x", b"1")] * 97], [], 100)
    assert isinstance(result, Malformed) and result.status == 431
    assert isinstance(read_request([*GET, *[(b"x", b"1")] * 96], [], 100), Request)


# Header names and values an attacker might try: anything in bytes.
_fields = st.lists(st.tuples(st.binary(max_size=12), st.binary(max_size=12)), max_size=8)


@given(_fields)
def test_whatever_is_accepted_carries_nothing_forbidden(extra: list[tuple[bytes, bytes]]) -> None:
    result = read_request([*GET, *extra], [], 100)
    if isinstance(result, Malformed):
        return
    for name, value in result.headers[4:]:
        assert name and name == name.lower() and b":" not in name and b" " not in name
        assert not {b"\r", b"\n", b"\x00"} & {value[i : i + 1] for i in range(len(value))}
        assert name not in CONNECTION_HEADERS
        assert name not in (b"meshlet-client-id", b"meshlet-proxy-error", b"l5d-dst-canonical")


def test_responses_need_a_status_first_and_alone() -> None:
    ok = read_response([(b":status", b"200"), (b"grpc-status", b"0"), (b"x", b"1")])
    assert isinstance(ok, Response) and ok.status == 200 and ok.grpc_status == "0"
    for block in (
        [],
        [(b"x", b"1"), (b":status", b"200")],
        [(b":status", b"20")],
        [(b":status", b"abc")],
        [(b":status", b"200"), (b":path", b"/")],
        [(b":status", b"200"), (b"Bad", b"1")],
        [(b":status", b"200"), (b"transfer-encoding", b"chunked")],
    ):
        result = read_response(block)
        assert isinstance(result, Malformed) and result.status == 502, block


def test_trailers_carry_no_pseudo_headers() -> None:
    trailers = read_trailers([(b"grpc-status", b"5"), (b"grpc-message", b"nope")])
    assert not isinstance(trailers, Malformed) and trailers.grpc_status == "5"
    assert isinstance(read_trailers([(b":status", b"200")]), Malformed)


def test_local_responses() -> None:
    assert local_response(503, "no endpoints", grpc=False) == [
        (b":status", b"503"),
        (b"meshlet-proxy-error", b"no endpoints"),
        (b"content-length", b"0"),
    ]
    grpc = dict(local_response(502, "connect to 10.0.0.1:80 failed: 100% down\n", grpc=True))
    assert grpc[b":status"] == b"200" and grpc[b"grpc-status"] == b"14"
    assert grpc[b"grpc-message"] == b"connect to 10.0.0.1:80 failed: 100%25 down"
    assert grpc[b"meshlet-proxy-error"] == b"connect to 10.0.0.1:80 failed: 100% down"


def test_fields_checked_once_are_remembered_and_bad_ones_never_are() -> None:
    h2headers._VALID.clear()
    good = (b"user-agent", b"h2load nghttp2/1.52.0")
    bad = (b"x-bad", b"a\r\nb")
    for _ in range(2):  # the second time from the memory of checked fields
        assert h2headers._field_error(*good) is None
        assert h2headers._field_error(*bad) == "invalid value for header b'x-bad'"
    assert good in h2headers._VALID and bad not in h2headers._VALID
    for i in range(h2headers._VALID_ENTRIES + 5):
        assert h2headers._field_error(b"x-n", str(i).encode()) is None
    assert len(h2headers._VALID) <= h2headers._VALID_ENTRIES


def test_a_redirect_is_answered_with_its_location() -> None:
    head = local_response(302, Redirection("http://api/b"), False)
    assert head == [(b":status", b"302"), (b"location", b"http://api/b"), (b"content-length", b"0")]
