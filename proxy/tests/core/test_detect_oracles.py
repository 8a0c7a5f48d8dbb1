"""Detection against the HTTP/1 servers in common use: whatever Python's `http.server` (the
parser under wsgiref and the development servers of werkzeug and Django), h11, llhttp (through
httptools) or a real nginx parses as a request is HTTP to the detector, at every length it may
arrive in: never opaque TCP, where the proxy's HTTP defences and its `meshlet-client-id` do not
apply. Each server is asked itself; the corpus is every request line built from odd leading
bytes, methods, separators, targets, versions and line ends."""

from __future__ import annotations

import contextlib
import http.server
import io
import itertools
import socket
from collections.abc import Callable, Iterator

import h11
import httptools
import pytest

from meshlet.proxy.core.detect import NEED_MORE, Protocol, detect
from meshlet_testing import nginx

LEADING = [b"", b" ", b"\t", b"\r\n", b"\n", b"\x0b", b"\x0c", b"\x1c", b"  \t"]
METHODS = [b"GET", b"POST", b"get", b"FOO", b"M-SEARCH"]
SEPARATORS = [b" ", b"  ", b"\t", b"\x0b", b"\x0c", b"\x1f", b"\x85", b"\xa0", b" \t"]
TARGETS = [b"/admin", b"admin", b"*", b"http://a/admin", b"/a%20b"]
VERSIONS = [b"HTTP/1.1", b"HTTP/1.0", b""]  # "": HTTP/0.9's `GET /path`
ENDS = [b"\r\n", b"\n"]


def corpus() -> Iterator[bytes]:
    for lead, method, sep, target, version, end in itertools.product(
        LEADING, METHODS, SEPARATORS, TARGETS, VERSIONS, ENDS
    ):
        line = lead + method + sep + target + (sep + version if version else b"") + end
        yield line + (b"Host: a\r\nmeshlet-client-id: forged\r\n\r\n" if version else b"")


def http_server_parses(data: bytes) -> bool:
    """Whether http.server's request handler parses `data` as a request."""
    handler = http.server.BaseHTTPRequestHandler.__new__(http.server.BaseHTTPRequestHandler)
    handler.rfile = io.BytesIO(data)
    handler.wfile = io.BytesIO()
    handler.client_address = ("127.0.0.1", 0)
    handler.log_message = lambda *args: None  # type: ignore[method-assign]
    handler.raw_requestline = handler.rfile.readline(65537)
    return bool(handler.raw_requestline) and handler.parse_request()


def h11_parses(data: bytes) -> bool:
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(data)
    try:
        return isinstance(conn.next_event(), h11.Request)
    except h11.RemoteProtocolError:
        return False


class _Head:
    done = False

    def on_headers_complete(self) -> None:
        self.done = True


def llhttp_parses(data: bytes) -> bool:
    head = _Head()
    try:
        httptools.HttpRequestParser(head).feed_data(data)
    except httptools.HttpParserUpgrade:
        return True
    except httptools.HttpParserError:
        return False
    return head.done


@pytest.fixture(scope="module")
def nginx_parses(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[bytes], bool]]:
    """A real nginx on loopback: whether it serves `data` (anything but a 400 or nothing)."""
    root = tmp_path_factory.mktemp("nginx")
    with nginx.running(root, 'location / { return 200 "served $uri\\n"; }') as port:

        def parses(data: bytes) -> bool:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
                conn.sendall(data)
                conn.shutdown(socket.SHUT_WR)
                answer = b""
                with contextlib.suppress(ConnectionResetError):
                    while chunk := conn.recv(4096):
                        answer += chunk
            return bool(answer) and not answer.startswith((b"HTTP/1.1 400", b"HTTP/1.0 400"))

        yield parses


def test_whatever_a_common_server_parses_as_a_request_is_http_at_every_length(
    nginx_parses: Callable[[bytes], bool],
) -> None:
    oracles: dict[str, Callable[[bytes], bool]] = {
        "http.server": http_server_parses,
        "h11": h11_parses,
        "llhttp": llhttp_parses,
        "nginx": nginx_parses,
    }
    parsed_by = {name: 0 for name in oracles}
    missed: list[tuple[bytes, list[str]]] = []
    for data in corpus():
        servers = [name for name, parses in oracles.items() if parses(data)]
        for name in servers:
            parsed_by[name] += 1
        if not servers:
            continue
        prefixes = (data[:n] for n in range(1, len(data)))
        if detect(data, final=True) is not Protocol.HTTP1 or any(
            detect(p) not in (NEED_MORE, Protocol.HTTP1)
            or detect(p, final=True) is not Protocol.HTTP1
            for p in prefixes
        ):
            missed.append((data, servers))
    assert not missed, f"{len(missed)} requests detected as not HTTP, first: {missed[:5]}"
    # Each server parsed a part of the corpus, and http.server the lenient lines the others
    # refuse: the corpus holds the cases that matter.
    assert all(count > 0 for count in parsed_by.values()), parsed_by
    assert http_server_parses(b"\t GET\t/admin\x1cHTTP/1.1\r\n\r\n")
    assert not llhttp_parses(b"\t GET\t/admin\x1cHTTP/1.1\r\n\r\n")


@pytest.mark.parametrize(
    "data",
    [
        b"GET\t/admin\tHTTP/1.1\r\nmeshlet-client-id: forged\r\n\r\n",
        b" GET /admin HTTP/1.1\r\n\r\n",
        b"\x0bGET /admin HTTP/1.1\r\n\r\n",
        b"\x0c\tGET\x0b/admin\x0cHTTP/1.1\r\n\r\n",
        b"FOO\x1f/admin\x1fHTTP/1.1\r\n\r\n",
        b"FOO admin HTTP/1.1\r\n\r\n",
        b"GET /admin\n",  # HTTP/0.9, which http.server serves
    ],
)
def test_lines_with_odd_spaces_are_http(data: bytes) -> None:
    assert http_server_parses(data)
    assert detect(data) is Protocol.HTTP1


def test_protocols_that_are_not_http_stay_opaque() -> None:
    for data in (b"get foo\r\n", b"EHLO mail.example.com\r\n", b"PING\r\n", b"*1\r\n$4\r\n",
                 b"AUTH secret\r\n", b"\tPING\r\n", b"SSH-2.0-OpenSSH_9.2\r\n"):  # fmt: skip
        assert detect(data) is Protocol.OPAQUE, data
        assert not http_server_parses(data), data


def test_the_corpus_is_built_from_every_part() -> None:
    lines = list(corpus())
    assert (
        len(lines)
        == len(set(lines))
        == (
            len(LEADING) * len(METHODS) * len(SEPARATORS) * len(TARGETS) * len(VERSIONS) * len(ENDS)
        )
    )
