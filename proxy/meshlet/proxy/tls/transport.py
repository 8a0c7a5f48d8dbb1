"""TLS over a plain asyncio transport (`ssl.SSLObject` over memory BIOs) that can half-close.

uvloop's and asyncio's TLS transports cannot: `can_write_eof()` is False, and the peer's
close_notify closes the whole connection, so a client that sends its request, half-closes and
waits loses the reply. TLS 1.3 closes each direction on its own (RFC 8446 §6.1) and OpenSSL
allows it: after our close_notify the session still reads, after the peer's it still writes.

`tls_accept` and `tls_connect` attach a socket to the running loop as a plain transport, run the
handshake within a timeout, and only then make the app's protocol; its transport is a
`TlsTransport`:

- `write_eof()` sends close_notify, then a TCP FIN, and keeps reading;
- the peer's close_notify calls the app's `eof_received()`: a true value keeps our direction open
  (half-closed), else the connection is closed (our close_notify goes back); once both
  directions are closed, so is the plain transport;
- a TCP FIN without a close_notify before it is a truncation, never a half-close: the app gets
  `connection_lost(TruncatedError)`; a fatal TLS error while reading (a bad record, an alert)
  aborts the connection and the app gets `connection_lost(that error)`.

`close()` sends close_notify and closes once the plain transport's buffer is written; it does
not wait for the peer's. While the app has paused reading, nothing reaches it (what was read is
held, and delivered in order after `resume_reading`, the peer's close_notify included).

The byte path: each read from the socket (into a per-thread scratch buffer) goes into the
incoming BIO and is decrypted while the BIO or the session holds any (so that no exception is
raised when records arrive whole), and reaches the app as one `data_received`; per `write`, one
`SSLObject.write` and one plain `write`. TLS records are written to the plain transport at once,
so its write buffer is the only one (back-pressure: its `pause_writing` / `resume_writing`
reach the app).
"""

from __future__ import annotations

import asyncio
import enum
import errno
import socket
import ssl
import threading
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Final, Generic, TypeVar, cast

P = TypeVar("P", bound=asyncio.Protocol)

_READ_SIZE: Final = 16384  # a TLS record's most plaintext: one `read` returns one record at most
# Read from the socket per call: under glibc's mmap threshold (128 KiB), so that the plaintext
# joined from one read is allocated from the heap, not mapped and faulted in again each time.
_SCRATCH_SIZE: Final = 64 * 1024
# Each thread's scratch buffer (uvloop reads into it outside the GIL: never shared by threads).
_per_thread: Final = threading.local()


class TruncatedError(ConnectionResetError):
    """The peer ended TCP without a TLS close_notify: what it sent may have been cut short."""

    def __init__(self) -> None:
        super().__init__(
            errno.ECONNRESET,
            "the peer closed TCP without a TLS close_notify: the session may be truncated",
        )


class _State(enum.Enum):
    OPEN = "open"  # both directions open
    READ_SHUT = "read_shut"  # the peer's close_notify delivered; the app still writes
    WRITE_SHUT = "write_shut"  # our close_notify and FIN sent; the peer still writes
    CLOSING = "closing"  # the plain transport is closing (both shut, close, abort, failure)
    CLOSED = "closed"  # connection_lost delivered


class _Event(enum.Enum):
    PEER_EOF = "peer_eof"  # the peer's close_notify, delivered to the app
    WRITE_EOF = "write_eof"  # our close_notify (write_eof)
    CLOSE = "close"  # close(), abort(), or a failure
    LOST = "lost"  # the plain transport's connection_lost


_OPEN, _READ_SHUT, _WRITE_SHUT = _State.OPEN, _State.READ_SHUT, _State.WRITE_SHUT
_CLOSING, _CLOSED = _State.CLOSING, _State.CLOSED

# Every legal transition; any other is a bug (KeyError).
_NEXT: Final[dict[tuple[_State, _Event], _State]] = {
    (_OPEN, _Event.PEER_EOF): _READ_SHUT,
    (_OPEN, _Event.WRITE_EOF): _WRITE_SHUT,
    (_READ_SHUT, _Event.WRITE_EOF): _CLOSING,
    (_WRITE_SHUT, _Event.PEER_EOF): _CLOSING,
    **{(state, _Event.CLOSE): _CLOSING for state in (_OPEN, _READ_SHUT, _WRITE_SHUT)},
    **{(state, _Event.LOST): _CLOSED for state in (_OPEN, _READ_SHUT, _WRITE_SHUT, _CLOSING)},
}


class TlsTransport(asyncio.Transport):
    """An established TLS session over a plain transport, for the app's protocol (see the
    module docstring). Made by `tls_accept` / `tls_connect`."""

    __slots__ = (
        "_app",
        "_eof_held",
        "_error",
        "_incoming",
        "_loop",
        "_outgoing",
        "_paused",
        "_plain",
        "_sslobj",
        "_state",
    )

    def __init__(
        self,
        plain: asyncio.Transport,
        sslobj: ssl.SSLObject,
        incoming: ssl.MemoryBIO,
        outgoing: ssl.MemoryBIO,
        app: asyncio.Protocol,
    ) -> None:
        super().__init__()
        self._loop = asyncio.get_running_loop()
        self._plain = plain
        self._sslobj = sslobj
        self._incoming = incoming
        self._outgoing = outgoing
        self._app = app
        self._state = _OPEN
        self._paused = False  # by the app: nothing is delivered, the plain transport is paused
        self._eof_held = False  # the peer's close_notify, read while the app was paused
        self._error: Exception | None = None  # for connection_lost, when we aborted on it
        plain.set_protocol(_Wire(self))

    # The app's side: asyncio.Transport.

    def write(self, data: bytes | bytearray | memoryview[Any]) -> None:
        state = self._state
        if state is not _OPEN and state is not _READ_SHUT:
            self._write_refused()
            return
        if data:
            self._sslobj.write(data)
            self._plain.write(self._outgoing.read())

    def writelines(self, list_of_data: Iterable[bytes | bytearray | memoryview[Any]]) -> None:
        """One TLS write for all the pieces (full records, one plain write)."""
        self.write(b"".join(list_of_data))

    def _write_refused(self) -> None:
        if self._state is _WRITE_SHUT:
            raise RuntimeError("write() after write_eof()")
        # Closing or closed: dropped, as asyncio's TLS transport does.

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        """Sends close_notify, then a TCP FIN; the peer's direction keeps flowing."""
        state = self._state
        if state is not _OPEN and state is not _READ_SHUT:
            return
        self._send_close_notify()
        self._go(_Event.WRITE_EOF)
        if self._state is _CLOSING:  # the peer had closed its direction too
            self._plain.close()
        else:
            self._plain.write_eof()

    def close(self) -> None:
        """Sends close_notify (unless sent), then closes once buffered bytes are written."""
        state = self._state
        if state is _CLOSING or state is _CLOSED:
            return
        if state is not _WRITE_SHUT:
            self._send_close_notify()
        self._go(_Event.CLOSE)
        self._plain.close()

    def abort(self) -> None:
        if self._state is _CLOSED:
            return
        if self._state is not _CLOSING:
            self._go(_Event.CLOSE)
        self._plain.abort()

    def is_closing(self) -> bool:
        return self._state is _CLOSING or self._state is _CLOSED

    def pause_reading(self) -> None:
        if self._paused or self.is_closing():
            return
        self._paused = True
        if not self._plain.is_closing():
            self._plain.pause_reading()

    def resume_reading(self) -> None:
        """Resumes soon: nothing is delivered before this returns (as with uvloop's
        transports), so a caller can deliver what it held first."""
        if not self._paused or self.is_closing():
            return
        self._paused = False
        self._loop.call_soon(self._resume)

    def _resume(self) -> None:
        if self._paused or self.is_closing():
            return  # paused again, or closed, since resume_reading
        if self._eof_held:
            self._eof_held = False
            self._peer_eof()
        elif self._incoming.pending or self._sslobj.pending():
            self._read()  # read before the pause (with the handshake's last flight, say)
        if not self._paused and not self.is_closing() and not self._plain.is_closing():
            self._plain.resume_reading()

    def is_reading(self) -> bool:
        return not self._paused and not self.is_closing()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._plain.set_write_buffer_limits(high, low)

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._plain.get_write_buffer_limits()

    def get_write_buffer_size(self) -> int:
        """The plain transport's: records are written to it at once."""
        return self._plain.get_write_buffer_size()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        match name:
            case "ssl_object":
                return self._sslobj
            case "sslcontext":
                return self._sslobj.context
            case "peercert":
                return self._sslobj.getpeercert()
            case "cipher":
                return self._sslobj.cipher()
            case "compression":
                return self._sslobj.compression()
        return self._plain.get_extra_info(name, default)

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._app = cast(asyncio.Protocol, protocol)

    def get_protocol(self) -> asyncio.Protocol:
        return self._app

    def __repr__(self) -> str:
        return f"<TlsTransport {self._state.value} {self._plain.get_extra_info('peername')}>"

    # The plain transport's side, through `_Wire`.

    def _received(self, data: memoryview) -> None:
        state = self._state
        if state is not _OPEN and state is not _WRITE_SHUT:
            return  # after the peer's close_notify, or while closing: ignored
        self._incoming.write(data)
        if not self._paused:
            self._read()

    def _read(self) -> None:
        """Decrypts what the BIO holds, delivers it as one `data_received`, then the peer's
        close_notify if it came."""
        incoming, sslobj = self._incoming, self._sslobj
        data = b""
        more: list[bytes] | None = None
        eof = False
        failure: ssl.SSLError | None = None
        try:
            while incoming.pending or sslobj.pending():
                chunk = sslobj.read(_READ_SIZE)
                if not chunk:
                    eof = True
                    break
                if not data:
                    data = chunk
                elif more is None:
                    more = [data, chunk]
                else:
                    more.append(chunk)
        except ssl.SSLWantReadError:
            pass  # a partial record, or a post-handshake message (a session ticket)
        except ssl.SSLZeroReturnError:
            eof = True  # CPython raises this, not b'', once our close_notify was sent
        except ssl.SSLError as exc:
            failure = exc
        if self._outgoing.pending and self._state is _OPEN:
            self._plain.write(self._outgoing.read())  # a KeyUpdate answer, an alert
        if more is not None:
            data = b"".join(more)
        if data:
            self._app.data_received(data)
        if self.is_closing():
            return  # the app closed it in data_received
        if failure is not None:
            self._fail(failure)
        elif eof:
            if self._paused:
                self._eof_held = True
            else:
                self._peer_eof()

    def _peer_eof(self) -> None:
        keep_writing = self._app.eof_received()
        state = self._state
        if state is _OPEN:
            if keep_writing:
                self._go(_Event.PEER_EOF)
            else:
                self.close()
        elif state is _WRITE_SHUT:
            self._go(_Event.PEER_EOF)
            self._plain.close()
        # Else the app closed it in eof_received.

    def _eof_received(self) -> bool:
        """The plain transport's FIN: true to keep it open for our writes."""
        state = self._state
        if state is _READ_SHUT or self._eof_held:
            return True  # after the peer's close_notify: a clean half-close
        if state is _OPEN or state is _WRITE_SHUT:
            self._fail(TruncatedError())
        return False

    def _fail(self, exc: Exception) -> None:
        self._error = exc
        self._go(_Event.CLOSE)
        self._plain.abort()

    def _lost(self, exc: Exception | None) -> None:
        self._go(_Event.LOST)
        self._app.connection_lost(self._error or exc)

    def _send_close_notify(self) -> None:
        try:
            self._sslobj.unwrap()
        except ssl.SSLWantReadError:
            pass  # sent; the peer's is still to come
        except ssl.SSLError:
            pass  # a broken session: closed all the same
        if self._outgoing.pending:
            self._plain.write(self._outgoing.read())

    def _go(self, event: _Event) -> None:
        self._state = _NEXT[self._state, event]


class _Wire(asyncio.BufferedProtocol):
    """The plain transport's protocol once the handshake is done: hands its events to the
    TlsTransport, and back-pressure to the app. The socket is read into this thread's scratch
    buffer, whose bytes the TlsTransport copies into its BIO at once."""

    __slots__ = ("_scratch", "_tls")

    def __init__(self, tls: TlsTransport) -> None:
        self._tls = tls
        self._scratch = _thread_scratch()

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._scratch

    def buffer_updated(self, nbytes: int) -> None:
        self._tls._received(self._scratch[:nbytes])

    def eof_received(self) -> bool:
        return self._tls._eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._tls._lost(exc)

    def pause_writing(self) -> None:
        self._tls.get_protocol().pause_writing()

    def resume_writing(self) -> None:
        self._tls.get_protocol().resume_writing()


def _thread_scratch() -> memoryview:
    """This thread's scratch buffer, shared by its connections: one read at a time fills it,
    and the bytes are copied out before the next (a copy fewer than `data_received`, and no
    allocation per read)."""
    scratch: memoryview | None = getattr(_per_thread, "scratch", None)
    if scratch is None:
        scratch = _per_thread.scratch = memoryview(bytearray(_SCRATCH_SIZE))
    return scratch


class _Handshake(asyncio.Protocol, Generic[P]):
    """The plain transport's protocol during the handshake; on success it makes the app's
    protocol and its TlsTransport, and hands the plain transport over to them."""

    __slots__ = ("_factory", "_incoming", "_outgoing", "_plain", "_sock", "_sslobj", "done")

    def __init__(
        self,
        sock: socket.socket,
        context: ssl.SSLContext,
        server_hostname: str | None,
        factory: Callable[[], P],
    ) -> None:
        self._sock = sock
        self._incoming, self._outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        self._sslobj = context.wrap_bio(
            self._incoming,
            self._outgoing,
            server_side=server_hostname is None,
            server_hostname=server_hostname,
        )
        self._factory = factory
        self._plain: asyncio.Transport | None = None
        self.done: asyncio.Future[tuple[TlsTransport, P]] = (
            asyncio.get_running_loop().create_future()
        )

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._plain = cast(asyncio.Transport, transport)  # uvloop's are not subclasses
        if not self._sslobj.server_side:
            self._step()  # the ClientHello

    def data_received(self, data: bytes) -> None:
        self._incoming.write(data)
        self._step()

    def eof_received(self) -> bool:
        self._failed(ConnectionResetError("the peer closed the connection during the handshake"))
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._failed(exc or ConnectionResetError("the connection closed during the handshake"))

    def _step(self) -> None:
        plain = self._plain
        assert plain is not None
        try:
            self._sslobj.do_handshake()
        except ssl.SSLWantReadError:
            self._send(plain)
            return
        except Exception as exc:  # ssl.SSLError, its verification errors included
            self._send(plain)  # the alert
            plain.close()
            self._failed(exc)
            return
        self._send(plain)  # our Finished, the server's session tickets
        self._established(plain)

    def _send(self, plain: asyncio.Transport) -> None:
        if self._outgoing.pending:
            plain.write(self._outgoing.read())

    def _established(self, plain: asyncio.Transport) -> None:
        try:
            app = self._factory()
            tls = TlsTransport(plain, self._sslobj, self._incoming, self._outgoing, app)
            app.connection_made(tls)
        except Exception as exc:
            plain.abort()
            self._failed(exc)
            return
        if not self.done.done():  # else timed out or cancelled: the caller aborts it
            self.done.set_result((tls, app))
        if tls.is_reading() and self._incoming.pending:
            tls._read()  # records that came with the handshake's last flight

    def _failed(self, exc: Exception) -> None:
        if not self.done.done():
            self.done.set_exception(exc)

    def discard(self) -> None:
        """Closes the socket (an attached one by aborting its transport)."""
        if self._plain is None:
            self._sock.close()
        elif not self._plain.is_closing():
            self._plain.abort()


async def tls_accept(
    sock: socket.socket,
    context: ssl.SSLContext,
    factory: Callable[[], P],
    *,
    handshake_timeout: float,
) -> tuple[TlsTransport, P]:
    """The server side: attaches an accepted, non-blocking socket whose ClientHello is still
    unread, completes the handshake within `handshake_timeout` seconds, then calls `factory()`
    and the protocol's `connection_made`. On failure the socket is closed and the error raised:
    TimeoutError, or ssl.SSLError (ssl.SSLCertVerificationError for a refused certificate) or
    another OSError, as uvloop's TLS raises them; so is it when the caller is cancelled (by its
    own deadline, say)."""
    loop = asyncio.get_running_loop()

    def attach(handshake: _Handshake[P]) -> Awaitable[object]:
        return loop.connect_accepted_socket(lambda: handshake, sock=sock)

    return await _handshake(sock, context, None, factory, attach, handshake_timeout)


async def tls_connect(
    sock: socket.socket,
    context: ssl.SSLContext,
    server_hostname: str,
    factory: Callable[[], P],
    *,
    handshake_timeout: float,
) -> tuple[TlsTransport, P]:
    """The client side, as `tls_accept`, for a connected non-blocking socket; SNI is
    `server_hostname` (the context checks the server's certificate against it)."""
    loop = asyncio.get_running_loop()

    def attach(handshake: _Handshake[P]) -> Awaitable[object]:
        return loop.create_connection(lambda: handshake, sock=sock)

    return await _handshake(sock, context, server_hostname, factory, attach, handshake_timeout)


async def _handshake(
    sock: socket.socket,
    context: ssl.SSLContext,
    server_hostname: str | None,
    factory: Callable[[], P],
    attach: Callable[[_Handshake[P]], Awaitable[object]],
    handshake_timeout: float,
) -> tuple[TlsTransport, P]:
    try:
        handshake = _Handshake(sock, context, server_hostname, factory)
    except BaseException:
        sock.close()
        raise
    try:
        async with asyncio.timeout(handshake_timeout) as budget:
            await attach(handshake)
            return await handshake.done
    except TimeoutError:
        handshake.discard()
        if budget.expired():
            why = f"the TLS handshake did not complete within {handshake_timeout}s"
            raise TimeoutError(why) from None
        raise
    except BaseException:
        handshake.discard()
        raise
