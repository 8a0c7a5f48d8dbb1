"""A real `meshlet-proxy` process serving tap, for tests and measures of its control port:
certified by a real `meshlet-controller identity` process (the test CA's issuer, a tokens
file), listening on 127.0.0.1. With it: TLS client contexts holding a certificate of any
identity from the same CA, a raw HTTP/2 client that can break the rules a real client keeps
(declare a huge message, ignore flow control, reset streams at once), the proxy's memory (RSS)
and metrics, and a probe of its data plane (`stallprobe`, a process of its own)."""

from __future__ import annotations

import contextlib
import json
import os
import select
import socket
import ssl
import struct
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from hpack import Decoder, Encoder, NeverIndexedHeaderTuple

from meshlet.api import wellknown as wk
from meshlet_testing.processes import stop
from meshlet_testing.sockets import free_port

NS: Final = "emojivoto"
PROXY_ID: Final = wk.identity_name("web", NS)
TAP_ID: Final = wk.TAP_SERVICE_NAME  # the identity the proxy answers (its default)
OTHER_ID: Final = wk.identity_name("vote-bot", NS)  # a valid identity of the mesh, not tap's
OBSERVE: Final = b"/io.linkerd.proxy.tap.Tap/Observe"
PREFACE: Final = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE = 0, 1, 3, 4, 6, 7, 8
END_STREAM, END_HEADERS = 0x1, 0x4
_HEAD: Final = struct.Struct(">HBBBL")


@dataclass(frozen=True)
class TapProxy:
    pid: int
    control: int  # the tap server's port on 127.0.0.1
    admin: int
    outbound: int
    log: Path

    def rss_mib(self) -> float:
        """The proxy's resident memory now."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise AssertionError("no VmRSS")

    def metric(self, name: str, **labels: str) -> float:
        """The sum of `name`'s samples whose labels include `labels`, from /metrics."""
        url = f"http://127.0.0.1:{self.admin}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            text = response.read().decode()
        total = 0.0
        for line in text.splitlines():
            if not line.startswith(name):
                continue
            series, _, value = line.rpartition(" ")
            if series != name and not series.startswith(name + "{"):
                continue
            if all(f'{k}="{v}"' in series for k, v in labels.items()):
                total += float(value)
        return total


def start(stack: contextlib.ExitStack, root: Path, test_ca: Any, within: float = 30.0) -> TapProxy:
    """Starts the identity service and the proxy (workload `web` in emojivoto), each stopped
    when `stack` closes; returns once the proxy is certified and ready."""
    root.mkdir(parents=True, exist_ok=True)
    tokens = root / "tokens.yaml"
    tokens.write_text(json.dumps({"tok-web": {"namespace": NS, "serviceaccount": "web"}}))
    token = root / "web.token"
    token.write_text("tok-web")

    def started(argv: list[str], log: Path, **env: str) -> subprocess.Popen[bytes]:
        out = stack.enter_context(log.open("wb"))
        proc = subprocess.Popen(argv, stdout=out, stderr=out, env={**os.environ, **env})
        stack.callback(stop, proc)
        return proc

    identity, identity_admin = free_port(), free_port()
    started([sys.executable, "-m", "meshlet.controlplane.main", "identity", "--addr",
             f"127.0.0.1:{identity}", "--admin-addr", f"127.0.0.1:{identity_admin}",
             "--trust-anchors", str(test_ca.anchors_path), "--issuer-dir",
             str(test_ca.issuer_dir), "--tokens-file", str(tokens), "--log-level", "warning"],
            root / "identity.log")  # fmt: skip
    control, admin, outbound = free_port(), free_port(), free_port()
    p = wk.PROXY_ENV_PREFIX
    proc = started([sys.executable, "-m", "meshlet.proxy.main"], root / "proxy.log", **{
        f"{p}OUTBOUND_LISTEN_ADDR": f"127.0.0.1:{outbound}",
        f"{p}INBOUND_LISTEN_ADDR": f"127.0.0.1:{free_port()}",
        f"{p}ADMIN_LISTEN_ADDR": f"127.0.0.1:{admin}",
        f"{p}CONTROL_LISTEN_ADDR": f"127.0.0.1:{control}",
        f"{p}IDENTITY_SVC_ADDR": f"127.0.0.1:{identity}",
        f"{p}IDENTITY_SVC_NAME": wk.IDENTITY_SERVICE_NAME,
        f"{p}IDENTITY_LOCAL_NAME": PROXY_ID,
        f"{p}IDENTITY_TOKEN_FILE": str(token),
        f"{p}IDENTITY_TRUST_ANCHORS": test_ca.anchors_pem,
        f"{p}SHUTDOWN_GRACE_PERIOD": "1s",
    })  # fmt: skip
    end = time.monotonic() + within
    while True:
        assert proc.poll() is None, (root / "proxy.log").read_text()
        with contextlib.suppress(OSError):
            url = f"http://127.0.0.1:{admin}/ready"
            with urllib.request.urlopen(url, timeout=1) as response:
                if response.status == 200:
                    break
        assert time.monotonic() < end, "the proxy was not ready in time"
        time.sleep(0.05)
    return TapProxy(proc.pid, control, admin, outbound, root / "proxy.log")


def client_context(test_ca: Any, identity: str | None, root: Path) -> ssl.SSLContext:
    """TLS 1.3 to the proxy's control port, verifying its identity; presenting a certificate of
    `identity` from the test CA (None: none)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.load_verify_locations(cadata=test_ca.anchors_pem)
    context.set_alpn_protocols(["h2"])
    if identity is not None:
        chain, key = test_ca.serving_cert(identity, root / "clients" / identity)
        context.load_cert_chain(chain, key)
    return context


def stranger_context(identity: str, root: Path) -> ssl.SSLContext:
    """A client context holding a certificate of `identity` from a CA of its own, which the
    proxy does not trust (it trusts nothing itself: load what it should)."""
    import datetime as dt

    from meshlet.controlplane.identity import ca, signer

    now = dt.datetime.now(dt.UTC)
    anchor, anchor_key = ca.create_trust_anchor(now)
    issuer_cert, issuer_key = ca.create_issuer(anchor, anchor_key, now)
    issuer = ca.Issuer(chain=(issuer_cert,), key=issuer_key, anchors=(anchor,))
    chain, key = signer.write_serving_files(issuer, identity, root, now, signer.LEAF_LIFETIME)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.set_alpn_protocols(["h2"])
    context.load_cert_chain(chain, key)
    return context


def frame(kind: int, flags: int, sid: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return _HEAD.pack(n >> 8, n & 0xFF, kind, flags, sid) + payload


def call_head(sid: int, end: bool = False, **changed: str) -> bytes:
    """An Observe call's HEADERS, with fields `changed` (`method`, `path`, ...), never indexed:
    the same bytes open any stream."""
    fields = {
        ":method": "POST",
        ":scheme": "https",
        ":path": OBSERVE.decode(),
        ":authority": "tap",
        "content-type": "application/grpc",
        "te": "trailers",
    }
    for name, value in changed.items():
        fields[f":{name}" if f":{name}" in fields else name.replace("_", "-")] = value
    block = Encoder().encode([NeverIndexedHeaderTuple(k, v) for k, v in fields.items()])
    return frame(HEADERS, END_HEADERS | (END_STREAM if end else 0), sid, block)


def grpc_prefix(length: int) -> bytes:
    """The 5 bytes before a gRPC message of `length` bytes."""
    return struct.pack(">BL", 0, length)


Frame = tuple[int, int, int, Any]  # type, flags, stream id, payload (HEADERS: a dict)


class RawH2:
    """An HTTP/2 client over TLS to 127.0.0.1:`port` that writes whatever frames it is told,
    reading what comes back as it writes (one thread, a non-blocking socket)."""

    def __init__(self, port: int, context: ssl.SSLContext, timeout: float = 10.0) -> None:
        raw = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.sock = context.wrap_socket(raw, server_hostname=PROXY_ID)
        self.decoder = Decoder()
        self.received: list[Frame] = []
        self.sent = 0  # bytes the socket took
        self.closed = False  # by the proxy (a FIN, a reset, a TLS alert)
        # Send windows as the proxy grants them (for `upload`, which keeps them).
        self.conn_window = 65_535
        self.initial_window = 65_535
        self.windows: dict[int, int] = {}
        self.stopped: set[int] = set()  # streams the proxy reset; 0 once it said GOAWAY
        self.owed = b""  # SETTINGS ACKs to send (a peer applies its settings on them)
        self._buf = b""
        self.sock.sendall(PREFACE + frame(SETTINGS, 0, 0))
        self.sock.setblocking(False)

    def exchange(
        self,
        out: Iterable[bytes] = (),
        within: float = 10.0,
        until: Callable[[list[Frame]], bool] | None = None,
    ) -> None:
        """Writes the pieces of `out` as fast as the socket takes them, reading meanwhile,
        until everything is written and the proxy closed the connection (or `until` holds of
        the frames received), or `within` seconds passed. Writing stops when the proxy
        closes."""
        pieces = iter(out)
        pending = b""
        writing = True
        end = time.monotonic() + within
        while time.monotonic() < end and not self.closed:
            if not writing and until is not None and until(self.received):
                return
            if writing and not pending:
                pending = next(pieces, b"")
                writing = bool(pending)
            if self.owed:
                pending, self.owed = self.owed + pending, b""
                writing = True
            wants = [self.sock] if writing else []
            readable, writable, _ = select.select([self.sock], wants, [], 0.1)
            if readable or self.sock.pending():
                self._read()
            if writable and pending and not self.closed:
                try:
                    n = self.sock.send(pending)
                except (ssl.SSLWantWriteError, ssl.SSLWantReadError):
                    continue
                except OSError:
                    writing, pending = False, b""
                    continue
                self.sent += n
                pending = pending[n:]

    def _read(self) -> None:
        while True:
            try:
                data = self.sock.recv(65536)
            except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
                return
            except OSError:  # a reset or an alert
                self.closed = True
                return
            if not data:
                self.closed = True
                return
            self._buf += data
            self._frames()

    def _frames(self) -> None:
        while len(self._buf) >= 9:
            hi, lo, kind, flags, sid = _HEAD.unpack_from(self._buf)
            length = (hi << 8) | lo
            if len(self._buf) < 9 + length:
                return
            payload, self._buf = self._buf[9 : 9 + length], self._buf[9 + length :]
            sid &= 0x7FFFFFFF
            if kind == HEADERS:
                fields = self.decoder.decode(payload, raw=True)
                self.received.append((kind, flags, sid, dict(fields)))
                continue
            self.received.append((kind, flags, sid, payload))
            if kind in (RST_STREAM, GOAWAY):
                self.stopped.add(sid)
            elif kind == WINDOW_UPDATE:
                increment = struct.unpack(">L", payload)[0] & 0x7FFFFFFF
                if sid == 0:
                    self.conn_window += increment
                else:
                    self.windows[sid] = self.windows.get(sid, self.initial_window) + increment
            elif kind == SETTINGS and not flags & 1:
                self.owed += frame(SETTINGS, 1, 0)
                for at in range(0, len(payload), 6):
                    key, value = struct.unpack_from(">HL", payload, at)
                    if key == 4:  # SETTINGS_INITIAL_WINDOW_SIZE
                        for stream in self.windows:
                            self.windows[stream] += value - self.initial_window
                        self.initial_window = value

    def send(self, data: bytes) -> None:
        """Writes `data` whole (waiting while the socket is full)."""
        self.sock.setblocking(True)
        try:
            self.sock.sendall(data)
        finally:
            self.sock.setblocking(False)
        self.sent += len(data)

    def upload(self, sid: int, first: bytes, zeros: int = 0, within: float = 10.0) -> None:
        """Sends `first` then `zeros` zero bytes as DATA on `sid`, as a well-behaved client
        does: within the windows the proxy grants, stopping when it resets the stream, says
        GOAWAY, or closes (or after `within` seconds)."""
        end = time.monotonic() + within
        left = len(first) + zeros
        at = 0
        while left > 0 and time.monotonic() < end and not self.closed:
            if sid in self.stopped or 0 in self.stopped:
                return
            window = min(self.conn_window, self.windows.setdefault(sid, self.initial_window))
            n = min(window, 16384, left)
            if n <= 0:
                if select.select([self.sock], [], [], 0.1)[0] or self.sock.pending():
                    self._read()
                continue
            piece = first[at : at + n]
            piece += bytes(n - len(piece))
            at += n
            owed, self.owed = self.owed, b""
            self.sock.setblocking(True)
            self.sock.settimeout(max(end - time.monotonic(), 0.01))
            try:
                self.sock.sendall(owed + frame(DATA, 0, sid, piece))
            except OSError:
                self.closed = True
                return
            finally:
                self.sock.setblocking(False)
            self.sent += 9 + n
            self.conn_window -= n
            self.windows[sid] -= n
            left -= n
            self._read()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


def rapid_reset(pairs: int, batch: int = 500) -> Iterator[bytes]:
    """`pairs` Observe HEADERS each followed by its RST_STREAM (CVE-2023-44487), `batch` pairs
    to a chunk of bytes."""
    head = call_head(1)
    sid = 1
    for _ in range(pairs // batch):
        chunk = []
        for _ in range(batch):
            chunk.append(head[:5] + sid.to_bytes(4, "big") + head[9:])
            chunk.append(frame(RST_STREAM, 0, sid, (8).to_bytes(4, "big")))
            sid += 2
        yield b"".join(chunk)


def any_of(leaves: int) -> bytes:
    """An ObserveRequest whose match is `any` of `leaves` empty matches (2 bytes each), as the
    protobuf wire has it (an attacker need not build it with the generated code)."""
    seq = b"\x0a\x00" * leaves
    match = b"\x12" + _varint(len(seq)) + seq
    return b"\x12" + _varint(len(match)) + match  # ObserveRequest.match


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def goaway_code(payload: bytes) -> int:
    code: int = struct.unpack_from(">LL", payload)[1]
    return code


class Probe:
    """`stallprobe` through the proxy's outbound listener while a `with` block runs;
    `result` once it ends."""

    def __init__(self, proxy: TapProxy) -> None:
        self.proxy = proxy
        self.result: dict[str, Any] = {}

    def __enter__(self) -> Probe:
        # meshlet_testing is importable from the folder above this file's (pytest's pythonpath
        # reaches no child process).
        testing = str(Path(__file__).resolve().parent.parent)
        path = os.pathsep.join(p for p in (testing, os.environ.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "meshlet_testing.stallprobe", "--via",
             f"127.0.0.1:{self.proxy.outbound}"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONPATH": path},
        )  # fmt: skip
        assert self.proc.stdout is not None
        first = self.proc.stdout.readline()
        assert json.loads(first) == {"ready": True}, first
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.close()
        line = self.proc.stdout.readline()
        self.proc.wait(timeout=30)
        self.proc.stdout.close()
        self.result = json.loads(line) if line else {}
