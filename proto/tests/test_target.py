"""The one form of a request target: every spelling of a path or host an HTTP server folds
together comes out the same, or is refused; a target already normal comes back as it is (the
same object: no work on the common path)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshlet.api.target import (
    FRAGMENT,
    EscapedSlashes,
    Refused,
    normal_path_match,
    normalize_host,
    normalize_target,
)

KEEP, REJECT, DECODE = EscapedSlashes.KEEP, EscapedSlashes.REJECT, EscapedSlashes.DECODE

SPELLINGS_OF_ADMIN = [
    b"/admin",
    b"/%61dmin",
    b"/adm%69n",
    b"/%61%64%6D%69%6E",
    b"/%61%64%6d%69%6e",
    b"/./admin",
    b"//admin",
    b"///admin",
    b"/x/../admin",
    b"/x/y/../../admin",
    b"/../admin",
    b"/%2e/admin",
    b"/%2E%2E/admin",
    b"/x/%2e%2e/admin",
    b"/.//./admin",
]


@pytest.mark.parametrize("spelling", SPELLINGS_OF_ADMIN)
def test_every_spelling_of_a_path_is_that_path(spelling: bytes) -> None:
    assert normalize_target(spelling, KEEP) == b"/admin"
    assert normalize_target(spelling + b"?q=%2e", KEEP) == b"/admin?q=%2e"  # query as it is


@pytest.mark.parametrize(
    ("target", "expected"),
    [
        (b"/", b"/"),
        (b"/a/b/", b"/a/b/"),  # a trailing slash stays
        (b"/a/b/.", b"/a/b/"),
        (b"/a/b/..", b"/a/"),
        (b"/a//", b"/a/"),
        (b"/..", b"/"),
        (b"/../..", b"/"),
        (b"/a/..b/c", b"/a/..b/c"),  # not a dot segment
        (b"/a/.b", b"/a/.b"),
        (b"/a%3ab", b"/a%3Ab"),  # reserved: kept, upper-case hex
        (b"/a%20b", b"/a%20b"),
        (b"/%7e%5f%2d", b"/~_-"),  # unreserved: decoded
        (b"/caf%C3%A9", b"/caf%C3%A9"),  # not ASCII: kept
        (b"/ADMIN", b"/ADMIN"),  # paths are case-sensitive
        (b"/admin;x", b"/admin;x"),
        (b"/a?b=/../c", b"/a?b=/../c"),
        (b"/a/../b?x#", Refused(FRAGMENT)),
    ],
)
def test_paths(target: bytes, expected: bytes | Refused) -> None:
    assert normalize_target(target, KEEP) == expected


@pytest.mark.parametrize("target", [b"/admin#frag", b"/admin?x#y", b"/#", b"/a/b#/../c"])
def test_a_fragment_is_refused(target: bytes) -> None:
    assert normalize_target(target, KEEP) == Refused(FRAGMENT)


@pytest.mark.parametrize("target", [b"/a%", b"/a%4", b"/a%zz", b"/a%4g", b"/%%61"])
def test_a_percent_that_is_not_an_encoding_is_refused(target: bytes) -> None:
    assert isinstance(normalize_target(target, KEEP), Refused)


@pytest.mark.parametrize(
    ("target", "keep", "decode"),
    [
        (b"/a%2fb", b"/a%2Fb", b"/a/b"),
        (b"/a%2Fb", b"/a%2Fb", b"/a/b"),
        (b"/x/..%2Fadmin", b"/x/..%2Fadmin", b"/admin"),
        (b"/%2Fadmin", b"/%2Fadmin", b"/admin"),
        (b"/a%5cb", b"/a%5Cb", b"/a\\b"),
    ],
)
def test_escaped_slashes_are_kept_refused_or_decoded(
    target: bytes, keep: bytes, decode: bytes
) -> None:
    assert normalize_target(target, KEEP) == keep
    assert normalize_target(target, DECODE) == decode
    refused = normalize_target(target, REJECT)
    assert isinstance(refused, Refused)
    assert "encoded slash" in refused.reason


def test_a_normal_target_is_returned_as_it_is() -> None:
    for target in (b"/", b"/api/v1/users?id=7&x=%2e", b"/a.b/c_d/~e"):
        assert normalize_target(target, REJECT) is target


@pytest.mark.parametrize(
    ("authority", "expected"),
    [
        (b"admin.store", b"admin.store"),
        (b"Admin.Store", b"admin.store"),
        (b"admin.store.", b"admin.store"),
        (b"ADMIN.store.:8080", b"admin.store:8080"),
        (b"api.emojivoto.svc.cluster.local:8080", b"api.emojivoto.svc.cluster.local:8080"),
        (b"10.0.0.7:8080", b"10.0.0.7:8080"),
        (b"localhost:65535", b"localhost:65535"),
        (b"[::1]:8080", b"[::1]:8080"),
        (b"[0:0::1]", b"[::1]"),
        (b"[FE80::1]", b"[fe80::1]"),
        (b"my_host", b"my_host"),
        # not a host: refused
        (b"[admin.store]", None),
        (b"admin.store%00", None),
        (b"admin%2estore", None),
        (b"admin.store..", None),
        (b"admin..store", None),
        (b".admin.store", None),
        (b"", None),
        (b":8080", None),
        (b"admin.store:", None),
        (b"admin.store:65536", None),
        (b"admin.store:80:80", None),
        (b"admin.store:8x", None),
        (b"user@admin.store", None),
        (b"admin store", None),
        (b"admin.store\x00", None),
        (b"[::1", None),
        (b"[::1]x", None),
        (b"[fe80::1%25eth0]", None),
    ],
)
def test_hosts(authority: bytes, expected: bytes | None) -> None:
    assert normalize_host(authority) == expected


@pytest.mark.parametrize(
    "host", [b"api.emojivoto.svc.cluster.local:8080", b"127.0.0.1:54321", b"[::1]:443"]
)
def test_a_normal_host_is_returned_as_it_is(host: bytes) -> None:
    assert normalize_host(host) is host  # callers remember it as normal by that


_PIECES = st.sampled_from(
    [b"a", b"admin", b".", b"..", b"", b"%2e", b"%2E%2e", b"%61", b"%2f", b"%3A", b"x.y", b"~"]
)
_PATHS = st.lists(_PIECES, max_size=8).map(lambda segments: b"/" + b"/".join(segments))


@given(_PATHS, st.sampled_from(list(EscapedSlashes)))
def test_normalizing_twice_changes_nothing(path: bytes, slashes: EscapedSlashes) -> None:
    once = normalize_target(path, slashes)
    if isinstance(once, Refused):
        return
    assert normalize_target(once, slashes) == once


@given(_PATHS)
def test_a_normal_path_has_no_dot_or_empty_segment_and_no_decodable_byte(path: bytes) -> None:
    normal = normalize_target(path, DECODE)
    assert isinstance(normal, bytes)
    assert normal.startswith(b"/")
    inner = normal[1:-1] if normal.endswith(b"/") else normal[1:]
    if inner:
        assert all(s not in (b"", b".", b"..") for s in inner.split(b"/"))
    assert b"%2E" not in normal.upper() and b"%61" not in normal


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("/admin", "/admin"),
        ("/", "/"),
        ("/x/../admin", "/admin"),
        ("//admin/", "/admin/"),
        ("/%7Euser", "/~user"),
        ("/group%2fproject", "/group%2Fproject"),  # kept: a route names what it matches
        ("/café", Refused("not ASCII: percent-encode it (as UTF-8), as requests carry it")),
        ("admin", Refused("not an absolute path; start it with '/'")),
        ("/a?b", Refused("a path match carries no query (?); match queryParams instead")),
        ("/a#b", Refused(FRAGMENT)),
    ],
)
def test_a_routes_path_value_in_the_form_requests_are_routed_on(
    value: str, expected: str | Refused
) -> None:
    assert normal_path_match(value) == expected
