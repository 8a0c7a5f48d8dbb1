"""The spike's candidate (c): libnghttp2 through cffi in ABI mode (the shared library only; no
headers or compiler), doing the relay of bench/h2spike.py: a server session and a client session,
callbacks per header and per DATA chunk, data providers for bodies, trailers after them."""

from __future__ import annotations

from typing import Any, Final

import cffi

CDEF: Final = """
typedef struct nghttp2_session nghttp2_session;
typedef struct nghttp2_session_callbacks nghttp2_session_callbacks;
typedef struct {
    uint8_t *name; uint8_t *value; size_t namelen; size_t valuelen; uint8_t flags;
} nghttp2_nv;
typedef struct {
    size_t length; int32_t stream_id; uint8_t type; uint8_t flags; uint8_t reserved;
} nghttp2_frame_hd;
typedef struct { nghttp2_frame_hd hd; } nghttp2_frame;
typedef struct { int32_t settings_id; uint32_t value; } nghttp2_settings_entry;
typedef union { int fd; void *ptr; } nghttp2_data_source;
typedef ssize_t (*nghttp2_data_source_read_callback)(
    nghttp2_session *, int32_t, uint8_t *, size_t, uint32_t *, nghttp2_data_source *, void *);
typedef struct {
    nghttp2_data_source source; nghttp2_data_source_read_callback read_callback;
} nghttp2_data_provider;
int nghttp2_session_callbacks_new(nghttp2_session_callbacks **);
void nghttp2_session_callbacks_set_on_frame_recv_callback(nghttp2_session_callbacks *,
    int (*)(nghttp2_session *, const nghttp2_frame *, void *));
void nghttp2_session_callbacks_set_on_header_callback(nghttp2_session_callbacks *,
    int (*)(nghttp2_session *, const nghttp2_frame *, const uint8_t *, size_t, const uint8_t *,
            size_t, uint8_t, void *));
void nghttp2_session_callbacks_set_on_data_chunk_recv_callback(nghttp2_session_callbacks *,
    int (*)(nghttp2_session *, uint8_t, int32_t, const uint8_t *, size_t, void *));
int nghttp2_session_server_new(nghttp2_session **, const nghttp2_session_callbacks *, void *);
int nghttp2_session_client_new(nghttp2_session **, const nghttp2_session_callbacks *, void *);
ssize_t nghttp2_session_mem_recv(nghttp2_session *, const uint8_t *, size_t);
ssize_t nghttp2_session_mem_send(nghttp2_session *, const uint8_t **);
int nghttp2_submit_settings(nghttp2_session *, uint8_t, const nghttp2_settings_entry *, size_t);
int32_t nghttp2_submit_request(nghttp2_session *, const void *, const nghttp2_nv *, size_t,
    const nghttp2_data_provider *, void *);
int nghttp2_submit_response(nghttp2_session *, int32_t, const nghttp2_nv *, size_t,
    const nghttp2_data_provider *);
int nghttp2_submit_trailer(nghttp2_session *, int32_t, const nghttp2_nv *, size_t);
"""
HEADERS: Final = 1
END_STREAM: Final = 0x1
DATA_FLAG_EOF: Final = 0x1
DATA_FLAG_NO_END_STREAM: Final = 0x2

ffi = cffi.FFI()
ffi.cdef(CDEF)
lib: Any = ffi.dlopen("libnghttp2.so.14")


class Side:
    """One session and what its callbacks collected for the current exchange."""

    def __init__(self, client: bool) -> None:
        self.headers: list[list[tuple[bytes, bytes]]] = []  # complete header blocks
        self.current: list[tuple[bytes, bytes]] = []  # the block being received
        self.data = b""
        self.pending: dict[int, tuple[bytes, list[tuple[bytes, bytes]]]] = {}
        self.keep: list[Any] = []
        self.sid = 0  # the stream of the last HEADERS received
        self.handle = ffi.new_handle(self)
        callbacks = ffi.new("nghttp2_session_callbacks **")
        lib.nghttp2_session_callbacks_new(callbacks)
        cb = callbacks[0]
        lib.nghttp2_session_callbacks_set_on_frame_recv_callback(cb, _on_frame)
        lib.nghttp2_session_callbacks_set_on_header_callback(cb, _on_header)
        lib.nghttp2_session_callbacks_set_on_data_chunk_recv_callback(cb, _on_data)
        session = ffi.new("nghttp2_session **")
        new = lib.nghttp2_session_client_new if client else lib.nghttp2_session_server_new
        assert new(session, cb, self.handle) == 0
        self.session = session[0]
        settings = ffi.new("nghttp2_settings_entry[2]", [(4, 256 * 1024), (2, 0)])
        lib.nghttp2_submit_settings(self.session, 0, settings, 2)
        self.provider = ffi.new("nghttp2_data_provider *")
        self.provider.read_callback = _read

    def recv(self, data: bytes) -> None:
        n = lib.nghttp2_session_mem_recv(self.session, data, len(data))
        assert n == len(data), n

    def send(self) -> bytes:
        out: list[bytes] = []
        ptr = ffi.new("const uint8_t **")
        while True:
            n = lib.nghttp2_session_mem_send(self.session, ptr)
            if n <= 0:
                return b"".join(out)
            out.append(ffi.buffer(ptr[0], n)[:])


class Pair:
    """The proxy's server side (facing the client) and client side (facing the upstream)."""

    def __init__(self, request_body: bool, trailers: bool) -> None:
        self.server = Side(client=False)
        self.client = Side(client=True)

    def setup(self, client_start: bytes, upstream_start: bytes) -> tuple[bytes, bytes]:
        self.server.recv(client_start)
        self.client.recv(upstream_start)
        return self.server.send(), self.client.send()

    def relay(self, client_chunk: bytes, upstream_chunk: bytes) -> tuple[bytes, bytes]:
        server, client = self.server, self.client
        server.recv(client_chunk)
        down = server.sid
        (request,) = server.headers
        server.headers = []
        body, server.data = server.data, b""
        nva, _keep = _nv(request)
        provider = client.provider if body else ffi.NULL
        up = lib.nghttp2_submit_request(client.session, ffi.NULL, nva, len(request), provider,
                                        ffi.NULL)  # fmt: skip
        if body:
            client.pending[up] = (body, [])
        to_upstream = client.send()
        client.recv(upstream_chunk)
        blocks, client.headers = client.headers, []
        data, client.data = client.data, b""
        response = blocks[0]
        trailers = blocks[1] if len(blocks) > 1 else []
        server.pending[down] = (data, trailers)
        nva, _keep = _nv(response)
        lib.nghttp2_submit_response(server.session, down, nva, len(response), server.provider)
        return server.send(), to_upstream


@ffi.callback("int(nghttp2_session *, const nghttp2_frame *, void *)")
def _on_frame(session: Any, frame: Any, user: Any) -> int:
    if frame.hd.type == HEADERS:
        side: Side = ffi.from_handle(user)
        side.headers.append(side.current)
        side.current = []
        side.sid = frame.hd.stream_id
    return 0


@ffi.callback(
    "int(nghttp2_session *, const nghttp2_frame *, const uint8_t *, size_t, const uint8_t *,"
    " size_t, uint8_t, void *)"
)
def _on_header(
    session: Any, frame: Any, name: Any, namelen: int, value: Any, valuelen: int, f: int, user: Any
) -> int:
    side: Side = ffi.from_handle(user)
    side.current.append((ffi.buffer(name, namelen)[:], ffi.buffer(value, valuelen)[:]))
    return 0


@ffi.callback("int(nghttp2_session *, uint8_t, int32_t, const uint8_t *, size_t, void *)")
def _on_data(session: Any, flags: int, sid: int, data: Any, length: int, user: Any) -> int:
    side: Side = ffi.from_handle(user)
    side.data += ffi.buffer(data, length)[:]
    return 0


@ffi.callback(
    "ssize_t(nghttp2_session *, int32_t, uint8_t *, size_t, uint32_t *, nghttp2_data_source *,"
    " void *)"
)
def _read(session: Any, sid: int, buf: Any, length: int, flags: Any, source: Any, user: Any) -> int:
    side: Side = ffi.from_handle(user)
    body, trailers = side.pending.pop(sid)
    n = len(body)
    ffi.memmove(buf, body, n)
    flags[0] = DATA_FLAG_EOF | (DATA_FLAG_NO_END_STREAM if trailers else 0)
    if trailers:
        nva, keep = _nv(trailers)
        lib.nghttp2_submit_trailer(session, sid, nva, len(trailers))
        side.keep = keep
    return n


def _nv(fields: list[tuple[bytes, bytes]]) -> tuple[Any, list[Any]]:
    """An nghttp2_nv array pointing into `fields` (nghttp2 copies what it sends)."""
    nva = ffi.new("nghttp2_nv[]", len(fields))
    keep: list[Any] = []
    for i, (name, value) in enumerate(fields):
        n, v = ffi.from_buffer(name), ffi.from_buffer(value)
        keep += (n, v)
        item = nva[i]
        item.name = ffi.cast("uint8_t *", n)
        item.value = ffi.cast("uint8_t *", v)
        item.namelen = len(name)
        item.valuelen = len(value)
    return nva, keep
