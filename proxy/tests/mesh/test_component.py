"""The mesh end to end, without root.

The control plane runs on 127.0.0.1 as it runs in a cluster, over TLS from the test CA: the
destination service reading a manifests folder and the identity service checking a tokens file.
Pods are loopback addresses in a /24 of the test process's own: a client pod (.2) and three
replicas of service `web` (.3-5), each with a real proxy (identity, discovery, balancing, mTLS,
metrics) on the pod's address, and each replica with its app (HTTP/1.1 and HTTP/2 on 8080, gRPC
on 8081, a server-speaks-first TCP service on 9000).

Nothing redirects traffic without iptables, so HTTP is sent to the client proxy's outbound
listener and routed by its authority (`web.emojivoto.svc.cluster.local:80`, looked up in
discovery). Opaque TCP has no authority: those connections are handed to the outbound handler
with the original destination set to the service's cluster IP, as SO_ORIGINAL_DST gives it
(proxy/tests/test_netns.py covers that call with real iptables).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import ssl
import urllib.request
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import h2.config
import h2.connection
import h2.errors
import h2.events
import httptools
import pytest
import wsproto
import wsproto.events
import yaml

from meshlet.api import wellknown
from meshlet.api.hostport import HostPort
from meshlet.api.transport_header import SessionProtocol
from meshlet.controlplane.destination.server import DestinationConfig, DestinationServer
from meshlet.controlplane.identity.server import IdentityConfig, IdentityServer
from meshlet.controlplane.k8s import objects
from meshlet.controlplane.k8s.manifests import ManifestsFolder, ManifestsSource
from meshlet.proxy.app import Proxy
from meshlet.proxy.config import load
from meshlet.proxy.io.listener import Accepted, bind
from meshlet.proxy.mesh import mesh_connect
from meshlet.proxy.tls import contexts
from meshlet_testing.grpcload import deadline_storm
from meshlet_testing.leaks import open_sockets, sockets_closed
from meshlet_testing.polling import eventually
from meshlet_testing.sockets import free_port

NS = "emojivoto"
FQN = f"web.{NS}.svc.cluster.local"
CLUSTER_IP = "10.96.0.20"
WEB_ID = wellknown.identity_name("web", NS)
BOT_ID = wellknown.identity_name("vote-bot", NS)
HTTP_PORT, GRPC_PORT, TCP_PORT = 80, 81, 9000
BANNER_PORT = 9001  # a server-speaks-first service on a port nobody declared opaque
INBOUND_DETECT_TIMEOUT = 1.0
# The pods bind the proxy's well-known ports: in a /24 of this process's own (never 127.0.0.x),
# another checkout's suite running this module on the same machine binds other addresses.
POD_NET = f"127.{1 + os.getpid() // 256 % 254}.{os.getpid() % 256}."
CLIENT_IP = f"{POD_NET}2"
REPLICAS = {"web-1": f"{POD_NET}3", "web-2": f"{POD_NET}4", "web-3": f"{POD_NET}5"}
EXTRA_POD_IP = f"{POD_NET}6"  # a pod a test adds
CANARY_IP = f"{POD_NET}7"
OUTSIDE_IP = f"{POD_NET}9"  # no pod: an address discovery does not know
TOKENS = {"tok-web": "web", "tok-bot": "vote-bot", "tok-impostor": "impostor"}
ECHO = "/meshlet.test.Echo/Unary"
SLOW = "/meshlet.test.Echo/Slow"
CHAT = "/meshlet.test.Echo/Chat"
Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
LAST_WORD = b"bye\n" + bytes(range(256)) * 4096  # what the TCP app says after the client's FIN


async def closed(writer: asyncio.StreamWriter) -> None:
    """Closes the connection and waits until its transport has let go of the socket (a
    transport still closing when the test's loop closes is a leak)."""
    writer.close()
    with contextlib.suppress(ConnectionError, ssl.SSLError):
        await writer.wait_closed()


# --- the apps --------------------------------------------------------------------------------


@dataclass
class Faults:
    """What web's apps do on some HTTP/1 paths: under /flaky/ one attempt in five fails with
    500 (a seeded draw: a run is repeatable); under /broken/ every attempt fails with 503; under
    /sick/ every attempt on one replica, the first to get one, fails with 503 (the others
    answer; its fast failures then make it the balancer's favourite for first attempts); under
    /slow/ the answer takes 1.5 s, unless the client goes away first."""

    draw: random.Random = field(default_factory=lambda: random.Random(7))
    attempts: Counter[str] = field(default_factory=Counter)  # by the path's first segment
    visits: Counter[tuple[str, str]] = field(default_factory=Counter)  # /sick/: (pod, path)
    sick: str = ""  # the pod that fails /sick/
    cancelled: int = 0  # /slow/ (or HTTP/2 /hold/) requests whose client left before the answer
    held: int = 0  # HTTP/2 /hold/ requests received (never answered)

    async def status(self, path: str, reader: asyncio.StreamReader, pod: str) -> int | None:
        kind = path.split("/")[1]
        self.attempts[kind] += 1
        if kind == "sick":
            self.visits[pod, path] += 1
            self.sick = self.sick or pod
            return 503 if pod == self.sick else 200
        if kind == "flaky":
            return 500 if self.draw.random() < 0.2 else 200
        if kind == "broken":
            return 503
        if kind == "slow":
            try:
                async with asyncio.timeout(1.5):
                    await reader.read(1)  # b"" once the client closes the connection
            except TimeoutError:
                return 200
            self.cancelled += 1
            return None
        return 200


def _field(line: str) -> tuple[str, str]:
    name, _, value = line.partition(": ")
    return name.lower(), value


class App:
    """One replica's app: it answers with its pod name and the caller identity its proxy
    passed in `meshlet-client-id`, after `delay` seconds; on HTTP/1 paths that `Faults`
    names, it fails or is slow as told."""

    def __init__(self, pod: str, ip: str, faults: Faults) -> None:
        self.pod, self.ip = pod, ip
        self.delay = 0.0
        self.faults = faults
        self._servers: list[asyncio.Server] = []
        self._writers: set[asyncio.StreamWriter] = set()
        self._grpc: grpc.aio.Server | None = None
        # The header fields of every request that arrived (lower-case names; gRPC: metadata).
        self.heads: list[list[tuple[str, str]]] = []

    def answer(self, fields: Iterable[tuple[str, str]]) -> bytes:
        """The pod's name and every `meshlet-client-id` value that arrived, joined: a forged
        header the proxy failed to strip shows even beside the proxy's own."""
        ids = [value for name, value in fields if name.lower() == wellknown.CLIENT_ID_HEADER]
        client_id = ", ".join(ids) if ids else None
        return json.dumps({"pod": self.pod, "client_id": client_id}).encode()

    async def start(self) -> None:
        self._servers = [
            await asyncio.start_server(self._tracked(self._http), self.ip, 8080),
            await asyncio.start_server(self._tracked(self._banner), self.ip, TCP_PORT),
            await asyncio.start_server(self._tracked(self._banner), self.ip, BANNER_PORT),
        ]
        server = self._grpc = grpc.aio.server()
        handlers = {
            "Unary": grpc.unary_unary_rpc_method_handler(self._unary),
            "Slow": grpc.unary_unary_rpc_method_handler(self._slow),
            "Chat": grpc.stream_stream_rpc_method_handler(self._chat),
        }
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("meshlet.test.Echo", handlers),)
        )
        server.add_insecure_port(f"{self.ip}:8081")
        await server.start()

    async def stop(self) -> None:
        for server in self._servers:
            server.close()
        for writer in list(self._writers):
            writer.transport.abort()
            await closed(writer)
        for server in self._servers:
            await server.wait_closed()
        if self._grpc is not None:
            await self._grpc.stop(grace=None)

    def _tracked(self, serve: Handler) -> Handler:
        async def tracked(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self._writers.add(writer)
            try:
                await serve(reader, writer)
            finally:
                self._writers.discard(writer)
                await closed(writer)

        return tracked

    async def _unary(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        metadata = [(str(k), str(v)) for k, v in context.invocation_metadata() or ()]
        self.heads.append(metadata)
        return self.answer(metadata) + b"|" + request

    async def _slow(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        await asyncio.sleep(30)  # until the caller's deadline cancels it
        return b""

    async def _chat(
        self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        async for message in requests:
            yield self.pod.encode() + b":" + message

    async def _banner(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Speaks first, echoes each line; once the client half-closes, a last word (1 MiB)."""
        writer.write(f"hello from {self.pod}\n".encode())  # the server speaks first
        with contextlib.suppress(ConnectionError):
            while line := await reader.readline():
                writer.write(b"echo:" + line)
            writer.write(LAST_WORD)
            await writer.drain()
        writer.close()

    async def _http(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            head = await reader.readuntil(b"\r\n\r\n")
            if head.startswith(b"PRI * HTTP/2.0"):
                await self._h2(head + await reader.readexactly(6), reader, writer)
                return
            while head:
                lines = head.decode().split("\r\n")
                pairs = [_field(line) for line in lines[1:] if line]
                self.heads.append(pairs)
                fields = dict(pairs)
                if lines[0].split()[1].startswith("/raw/"):
                    await self._raw(head, fields, reader, writer)
                    head = await reader.readuntil(b"\r\n\r\n")
                    continue
                if fields.get("upgrade", "").lower() == "websocket":
                    await self._websocket(head, reader, writer)
                    break
                await reader.readexactly(int(fields.get("content-length", "0")))
                await asyncio.sleep(self.delay)
                path = lines[0].split()[1]
                if path.startswith("/watch/"):  # a chunk, then quiet for that many seconds
                    await self._watch(float(path.split("/")[2]), writer)
                    head = await reader.readuntil(b"\r\n\r\n")
                    continue
                status = await self.faults.status(path, reader, self.pod)
                if status is None:  # the client went away before the answer
                    break
                body = self.answer(pairs)
                head = b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\n" % status
                if lines[0].split()[1].startswith("/forge/"):  # as if a proxy had failed
                    head += b"meshlet-proxy-error: forged\r\nl5d-proxy-error: forged\r\n"
                writer.write(head + b"content-length: %d\r\n\r\n%s" % (len(body), body))
                head = await reader.readuntil(b"\r\n\r\n")
        writer.close()

    async def _websocket(
        self, head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """Accepts the upgrade (wsproto), then answers each text message with the pod's name
        and the message."""
        ws = wsproto.WSConnection(wsproto.ConnectionType.SERVER)
        ws.receive_data(head)
        data = b""
        while True:
            for event in ws.events():
                if isinstance(event, wsproto.events.Request):
                    writer.write(ws.send(wsproto.events.AcceptConnection()))
                elif isinstance(event, wsproto.events.TextMessage):
                    text = f"{self.pod}:{event.data}"
                    writer.write(ws.send(wsproto.events.Message(data=text)))
                elif isinstance(event, wsproto.events.CloseConnection):
                    writer.write(ws.send(event.response()))
                    return
            data = await reader.read(65536)
            if not data:
                return
            ws.receive_data(data)

    async def _raw(
        self,
        head: bytes,
        fields: dict[str, str],
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        """Answers with the request exactly as it arrived (its head and its framed body), in a
        chunked response with a trailer, after `delay`."""
        request = head
        if fields.get("transfer-encoding") == "chunked":
            while True:
                size_line = await reader.readuntil(b"\r\n")
                request += size_line
                size = int(size_line.split(b";")[0], 16)
                if size == 0:
                    request += await reader.readuntil(b"\r\n\r\n")
                    break
                request += await reader.readexactly(size + 2)
        else:
            request += await reader.readexactly(int(fields.get("content-length", "0")))
        await asyncio.sleep(self.delay)
        writer.write(
            b"HTTP/1.1 200 OK\r\nX-Mixed-Case: Yes\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"%x\r\n%s\r\n0\r\nX-Trailer: t\r\n\r\n" % (len(request), request)
        )

    async def _watch(self, quiet: float, writer: asyncio.StreamWriter) -> None:
        """A watch's response: its head and a first event, nothing for `quiet` seconds, then a
        last event and the end (chunked)."""
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        writer.write(b"6\r\nfirst\n\r\n")
        await writer.drain()
        await asyncio.sleep(quiet)
        writer.write(b"5\r\nlast\n\r\n0\r\n\r\n")
        await writer.drain()

    async def _h2(
        self, preface: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """Answers at once, but requests under /hold/, held until their stream is reset (each
        counted in `Faults`: held, then cancelled)."""
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
        conn.initiate_connection()
        data = preface
        while data:
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.RequestReceived):
                    pairs = [(bytes(k).decode(), bytes(v).decode()) for k, v in event.headers or ()]
                    self.heads.append(pairs)
                    if dict(pairs).get(":path", "").startswith("/hold/"):
                        self.faults.held += 1
                        continue
                    body = self.answer(pairs)
                    conn.send_headers(event.stream_id, [(":status", "200")])
                    conn.send_data(event.stream_id, body, end_stream=True)
                elif isinstance(event, h2.events.StreamReset):
                    self.faults.cancelled += 1
            writer.write(conn.data_to_send())
            data = await reader.read(65536)
        writer.close()


# --- the clients -----------------------------------------------------------------------------


class H1Client:
    """Keep-alive HTTP/1.1 to the client pod's outbound listener."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def connect(cls, addr: tuple[str, int]) -> H1Client:
        return cls(*await asyncio.open_connection(*addr))

    async def get(
        self, authority: str, *extra: str, path: str = "/"
    ) -> tuple[int, dict[str, str], bytes]:
        head = "\r\n".join((f"GET {path} HTTP/1.1", f"Host: {authority}", *extra, "", ""))
        self.writer.write(head.encode())
        raw = await self.reader.readuntil(b"\r\n\r\n")
        lines = raw.decode().split("\r\n")
        fields = dict(line.lower().split(": ", 1) for line in lines[1:] if line)
        body = await self.reader.readexactly(int(fields.get("content-length", "0")))
        return int(lines[0].split()[1]), fields, body

    async def close(self) -> None:
        await closed(self.writer)


async def h2_get(addr: tuple[str, int], authority: str) -> tuple[int, bytes]:
    """One HTTP/2 request with prior knowledge."""
    reader, writer = await asyncio.open_connection(*addr)
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    conn.send_headers(
        1, [(":method", "GET"), (":scheme", "http"), (":authority", authority), (":path", "/")],
        end_stream=True,
    )  # fmt: skip
    writer.write(conn.data_to_send())
    status, body = 0, b""
    try:
        while True:
            data = await reader.read(65536)
            assert data, "the proxy closed the connection"
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.ResponseReceived):
                    status = int(dict(event.headers or ())[b":status"])
                elif isinstance(event, h2.events.DataReceived):
                    body += event.data or b""
                    conn.acknowledge_received_data(event.flow_controlled_length or 0, 1)
                elif isinstance(event, h2.events.StreamEnded):
                    return status, body
            writer.write(conn.data_to_send())
    finally:
        await closed(writer)


# --- the mesh --------------------------------------------------------------------------------


@dataclass
class Pod:
    name: str
    ip: str
    token: str
    proxy: Proxy | None = None
    app: App | None = None

    @property
    def outbound(self) -> tuple[str, int]:
        return self.ip, wellknown.PROXY_OUTBOUND_PORT

    def metric(self, name: str, **labels: str) -> float:
        """The sum of `name` over the series whose labels include `labels`."""
        assert self.proxy is not None
        total = 0.0
        for family in self.proxy.metrics.registry.collect():
            for sample in family.samples:
                if sample.name == name and labels.items() <= sample.labels.items():
                    total += sample.value
        return total

    def ready_status(self) -> int:
        """GET /ready on the proxy's admin port, as the kubelet would."""
        assert self.proxy is not None
        url = f"http://{self.ip}:{self.proxy.admin_port}/ready"
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                return int(response.status)
        except urllib.error.HTTPError as exc:
            return exc.code


@dataclass
class Mesh:
    root: Path
    test_ca: Any
    identity_port: int = field(default_factory=free_port)
    destination_port: int = field(default_factory=free_port)
    identity: IdentityServer | None = None
    destination: DestinationServer | None = None
    pods: dict[str, Pod] = field(default_factory=dict)
    faults: Faults = field(default_factory=Faults)

    @property
    def manifests(self) -> Path:
        return self.root / "manifests"

    def put(self, name: str, *objs: dict[str, Any]) -> None:
        ManifestsFolder(self.manifests).put(name, *objs)

    def remove(self, name: str) -> None:
        ManifestsFolder(self.manifests).remove(name)

    def replicas_metric(self, name: str, **labels: str) -> float:
        """`Pod.metric` summed over web's replicas."""
        return sum(self.pods[replica].metric(name, **labels) for replica in REPLICAS)

    async def start_identity(self) -> None:
        tokens = self.root / "tokens.yaml"
        tokens.write_text(yaml.safe_dump(
            {token: {"namespace": NS, "serviceaccount": sa} for token, sa in TOKENS.items()}
        ))  # fmt: skip
        self.identity = IdentityServer(
            IdentityConfig(
                addr=HostPort("127.0.0.1", self.identity_port), admin_addr=HostPort("127.0.0.1", 0),
                trust_anchors=self.test_ca.anchors_path, issuer_dir=self.test_ca.issuer_dir,
                tokens_file=tokens, kube_api=None, reload_interval=1.0,
            )
        )  # fmt: skip
        await self.identity.start()

    async def stop_identity(self) -> None:
        if self.identity is not None:
            await self.identity.stop(grace=0)
            self.identity = None

    async def start_destination(self) -> None:
        tls = self.test_ca.serving_cert(wellknown.DESTINATION_SERVICE_NAME, self.root / "tls")
        self.destination = DestinationServer(
            DestinationConfig(
                addr=HostPort("127.0.0.1", self.destination_port),
                admin_addr=HostPort("127.0.0.1", 0),
                source=ManifestsSource(self.manifests, poll_interval=0.02),
                derive_from_pods=True, tls=tls,
            )
        )  # fmt: skip
        await self.destination.start()
        await eventually(self.destination.ready)

    async def stop_destination(self) -> None:
        if self.destination is not None:
            await self.destination.stop(grace=0)
            self.destination = None

    def env(self, pod: Pod) -> dict[str, str]:
        token = self.root / f"{pod.name}.token"
        token.write_text(pod.token)
        p = wellknown.PROXY_ENV_PREFIX
        return {
            f"{p}INBOUND_LISTEN_ADDR": f"{pod.ip}:{wellknown.PROXY_INBOUND_PORT}",
            f"{p}OUTBOUND_LISTEN_ADDR": f"{pod.ip}:{wellknown.PROXY_OUTBOUND_PORT}",
            f"{p}ADMIN_LISTEN_ADDR": f"{pod.ip}:0",
            f"{p}CONTROL_LISTEN_ADDR": f"{pod.ip}:{wellknown.PROXY_CONTROL_PORT}",
            f"{p}DESTINATION_SVC_ADDR": f"127.0.0.1:{self.destination_port}",
            f"{p}DESTINATION_SVC_NAME": wellknown.DESTINATION_SERVICE_NAME,
            f"{p}DESTINATION_CONTEXT": json.dumps({"ns": NS, "nodeName": "node-1"}),
            f"{p}IDENTITY_SVC_ADDR": f"127.0.0.1:{self.identity_port}",
            f"{p}IDENTITY_SVC_NAME": wellknown.IDENTITY_SERVICE_NAME,
            f"{p}IDENTITY_LOCAL_NAME": wellknown.identity_name(TOKENS[pod.token], NS),
            f"{p}IDENTITY_TOKEN_FILE": str(token),
            f"{p}IDENTITY_TRUST_ANCHORS": self.test_ca.anchors_pem,
            f"{p}SHUTDOWN_GRACE_PERIOD": "1s",
            # Every HTTP/1.1 test of this module goes across the mesh as HTTP/2 streams.
            f"{p}OUTBOUND_HTTP1_OVER_H2": "true",
            f"{p}INBOUND_DETECT_TIMEOUT": f"{INBOUND_DETECT_TIMEOUT}s",
            # What the injector writes from the pod's opaque-ports annotation: the inbound
            # proxy relays these ports without detection, whatever the client proxy declares.
            f"{p}INBOUND_PORTS_DISABLE_PROTOCOL_DETECTION": ",".join(
                str(port) for port in sorted(wellknown.DEFAULT_OPAQUE_PORTS | {TCP_PORT})
            ),
        }

    async def start_pod(
        self, name: str, ip: str, token: str, *, app: bool, wait_ready: bool = True
    ) -> Pod:
        """Starts the pod's app and proxy, and waits for the proxy's certificate (as a readiness
        probe keeps a pod out of its service's endpoints until then)."""
        pod = self.pods[name] = Pod(name, ip, token)
        if app:
            pod.app = App(name, ip, self.faults)
            await pod.app.start()
        proxy = pod.proxy = Proxy(load(self.env(pod)))
        await proxy.start()
        if wait_ready:
            await eventually(proxy.ready)
        return pod

    async def kill(self, name: str) -> None:
        """The pod dies: its proxy and its app stop (the manifests still list it)."""
        pod = self.pods.pop(name)
        if pod.proxy is not None:
            await pod.proxy.shutdown()
        if pod.app is not None:
            await pod.app.stop()

    async def close(self) -> None:
        """Stops everything, even when one part fails to stop (then raises the first error).

        The control plane first: its servers close the proxies' TLS connections to it while
        the proxies still read them. A proxy that closed its end first waited for the server's
        answer to its close_notify, and on a busy machine that answer came as the test's loop
        closed (uvloop: EBUSY, and an unclosed transport)."""
        results = [
            await asyncio.gather(self.stop_destination(), return_exceptions=True),
            await asyncio.gather(self.stop_identity(), return_exceptions=True),
            *[
                await asyncio.gather(self.kill(name), return_exceptions=True)
                for name in list(self.pods)
            ],
        ]
        for (result,) in results:
            if isinstance(result, BaseException):
                raise result


def web_pod(name: str, ip: str) -> dict[str, Any]:
    return objects.pod(
        name, ip, NS, app="web", sa="web",
        annotations={wellknown.OPAQUE_PORTS_ANNOTATION: str(TCP_PORT)},
    )  # fmt: skip


@pytest.fixture
async def mesh(test_ca: Any, tmp_path: Path) -> AsyncIterator[Mesh]:
    sockets = open_sockets()
    mesh = Mesh(tmp_path, test_ca)
    mesh.manifests.mkdir()
    mesh.put(
        "svc",
        objects.service(
            "web", NS, cluster_ip=CLUSTER_IP,
            ports=[("http", HTTP_PORT, 8080), ("grpc", GRPC_PORT, 8081),
                   ("tcp", TCP_PORT, TCP_PORT)],
            annotations={wellknown.OPAQUE_PORTS_ANNOTATION: str(TCP_PORT)},
        ),
    )  # fmt: skip
    for name, ip in REPLICAS.items():
        mesh.put(name, web_pod(name, ip))
    mesh.put("vote-bot", objects.pod("vote-bot", CLIENT_IP, NS, app="vote-bot", sa="vote-bot"))
    try:
        await mesh.start_identity()
        await mesh.start_destination()
        for name, ip in REPLICAS.items():
            await mesh.start_pod(name, ip, "tok-web", app=True)
        await mesh.start_pod("vote-bot", CLIENT_IP, "tok-bot", app=False)
        yield mesh
    finally:
        await mesh.close()
        # the proxies' connections to each other and to the control plane
        control = [("127.0.0.1", mesh.identity_port), ("127.0.0.1", mesh.destination_port)]
        await sockets_closed(sockets, [*REPLICAS.values(), CLIENT_IP, *control])


def pod_of(body: bytes) -> str:
    return str(json.loads(body)["pod"])


# --- protocols across mTLS -------------------------------------------------------------------


async def test_http1_across_mtls_is_balanced_per_request_and_carries_the_callers_identity(
    mesh: Mesh,
) -> None:
    client = await H1Client.connect(mesh.pods["vote-bot"].outbound)
    seen: Counter[str] = Counter()
    try:
        for _ in range(30):
            # A client cannot claim an identity: the header it sends is replaced.
            status, _, body = await client.get(
                f"{FQN}:{HTTP_PORT}", f"{wellknown.CLIENT_ID_HEADER}: {WEB_ID}"
            )
            assert status == 200, body
            answer = json.loads(body)
            assert answer["client_id"] == BOT_ID
            seen[answer["pod"]] += 1
    finally:
        await client.close()
    # Balanced per request: one client connection, more than one replica. (Latency-aware: the
    # first replicas to answer keep the traffic of a sequential client; a replica with no RTT
    # sample yet counts as 30 ms.)
    assert len(seen) >= 2 and set(seen) <= set(REPLICAS), seen
    bot = mesh.pods["vote-bot"]
    assert bot.metric(
        "request_total", direction="outbound", tls="true", server_id=WEB_ID,
        authority=f"{FQN}:{HTTP_PORT}",
    ) == 30  # fmt: skip
    assert bot.metric("response_total", direction="outbound", tls="true", status_code="200") == 30
    # Each endpoint's labels from discovery, as dst_*: the replica that answered.
    for pod, answered in seen.items():
        dst = {"dst_namespace": NS, "dst_service": "web", "dst_serviceaccount": "web"}
        assert bot.metric("request_total", direction="outbound", dst_pod=pod, **dst) == answered
    # TCP on both sides of each proxy: the app's connection (src), the mTLS one (dst).
    assert bot.metric("tcp_open_total", peer="src", direction="outbound") >= 1
    assert bot.metric("tcp_open_total", peer="dst", tls="true", server_id=WEB_ID,
                      dst_service="web") >= 2  # fmt: skip
    assert bot.metric("tcp_read_bytes_total", peer="dst", tls="true") > 30 * len(b"HTTP/1.1 200")
    assert mesh.replicas_metric("tcp_open_total", peer="src", direction="inbound",
                                tls="true", client_id=BOT_ID) >= 2  # fmt: skip
    assert mesh.replicas_metric("tcp_open_total", peer="dst", direction="inbound",
                                no_tls_reason="loopback") >= 2  # fmt: skip
    # The server side labels requests by their authority too (not by the pod's address).
    assert mesh.replicas_metric("request_total", direction="inbound", tls="true",
                                client_id=BOT_ID, authority=f"{FQN}:{HTTP_PORT}") == 30  # fmt: skip


class _Parsed:
    """An HTTP/1.1 response as httptools reads it."""

    def __init__(self) -> None:
        self.fields: list[tuple[bytes, bytes]] = []
        self.body = b""
        self.done = False

    def on_header(self, name: bytes, value: bytes) -> None:
        self.fields.append((name, value))

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        self.done = True


async def raw_exchange(addr: tuple[str, int], request: bytes) -> tuple[int, _Parsed]:
    """Sends `request` as it is, reads one response (status, fields with trailers, body)."""
    reader, writer = await asyncio.open_connection(*addr)
    parsed = _Parsed()
    parser = httptools.HttpResponseParser(parsed)
    try:
        writer.write(request)
        async with asyncio.timeout(10):
            while not parsed.done:
                data = await reader.read(65536)
                assert data, "the proxy closed the connection"
                parser.feed_data(data)
        return parser.get_status_code(), parsed
    finally:
        await closed(writer)


async def test_http1_across_mtls_goes_as_streams_of_one_http2_connection_per_replica(
    mesh: Mesh,
) -> None:
    """Six HTTP/1.1 requests in flight at once, from six client connections: over the mesh
    they are streams of the client proxy's HTTP/2 connections (one per replica: a plain
    HTTP/1.1 hop needs a connection per request in flight), and each app gets them as the
    HTTP/1.1 requests they were."""
    bot = mesh.pods["vote-bot"]
    for replica in REPLICAS:
        app = mesh.pods[replica].app
        assert app is not None
        app.delay = 0.3
    opened = bot.metric("tcp_open_total", peer="dst", tls="true")
    authority = f"{FQN}:{HTTP_PORT}".encode()
    request = b"GET /raw/x HTTP/1.1\r\nHost: %s\r\nX-First: 1\r\nAccept: */*\r\n\r\n" % authority
    answers = await asyncio.gather(
        *(raw_exchange(bot.outbound, request) for _ in range(6))
    )  # fmt: skip
    assert bot.metric("tcp_open_total", peer="dst", tls="true") - opened <= len(REPLICAS)
    assert bot.metric("request_total", direction="outbound", tls="true", server_id=WEB_ID) >= 6
    for status, answer in answers:
        assert status == 200
        # The app's response: its fields (names in lower case across HTTP/2), chunked, with
        # its trailer.
        assert (b"x-mixed-case", b"Yes") in answer.fields
        assert (b"x-trailer", b"t") in answer.fields
        assert answer.body == (
            b"GET /raw/x HTTP/1.1\r\nHost: %s\r\nx-first: 1\r\naccept: */*\r\n"
            b"meshlet-client-id: %s\r\n\r\n" % (authority, BOT_ID.encode())
        )

    # A body with a length, and a chunked one with trailers: framed as the client framed them.
    for app in (mesh.pods[replica].app for replica in REPLICAS):
        assert app is not None
        app.delay = 0.0
    sized = b"POST /raw/sized HTTP/1.1\r\nHost: %s\r\nContent-Length: 5\r\n\r\nhello" % authority
    status, answer = await raw_exchange(bot.outbound, sized)
    assert status == 200
    assert answer.body == (
        b"POST /raw/sized HTTP/1.1\r\nHost: %s\r\nContent-Length: 5\r\n"
        b"meshlet-client-id: %s\r\n\r\nhello" % (authority, BOT_ID.encode())
    )
    chunked = (
        b"POST /raw/chunked HTTP/1.1\r\nHost: %s\r\nTransfer-Encoding: chunked\r\n"
        b"TE: trailers\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\nX-Sum: 11\r\n\r\n" % authority
    )
    status, answer = await raw_exchange(bot.outbound, chunked)
    assert status == 200
    assert answer.body == (
        b"POST /raw/chunked HTTP/1.1\r\nHost: %s\r\nTransfer-Encoding: chunked\r\n"
        b"TE: trailers\r\nmeshlet-client-id: %s\r\n\r\n"
        b"5\r\nhello\r\n6\r\n world\r\n0\r\nx-sum: 11\r\n\r\n" % (authority, BOT_ID.encode())
    )
    # HTTP/1.0 is not sent over HTTP/2: the app sees its fields as the client spelt them.
    reader, writer = await asyncio.open_connection(*bot.outbound)
    try:
        writer.write(b"GET /raw/old HTTP/1.0\r\nHost: %s\r\nX-Case: K\r\n\r\n" % authority)
        async with asyncio.timeout(10):
            reply = await reader.read()  # delimited by the close, for an HTTP/1.0 client
    finally:
        await closed(writer)
    assert reply.startswith(b"HTTP/1.1 200 OK\r\n")
    assert b"\r\nX-Case: K\r\n" in reply


async def test_a_websocket_across_mtls_stays_http1_beside_requests_sent_over_http2(
    mesh: Mesh,
) -> None:
    """An upgrade cannot go as an HTTP/2 stream: aiohttp's WebSocket gets its own HTTP/1.1
    mesh connection and talks to the app, while plain requests beside it go over HTTP/2."""
    bot = mesh.pods["vote-bot"]
    host, port = bot.outbound
    authority = f"{FQN}:{HTTP_PORT}"
    async with (
        asyncio.timeout(10),
        aiohttp.ClientSession() as session,
        session.ws_connect(f"http://{host}:{port}/chat", headers={"Host": authority}) as ws,
    ):
        for word in ("hello", "again"):
            await ws.send_str(word)
            answer = await ws.receive_str(timeout=5)
            pod, _, echoed = answer.partition(":")
            assert pod in REPLICAS and echoed == word
        async with session.get(f"http://{host}:{port}/", headers={"Host": authority}) as r:
            assert r.status == 200 and json.loads(await r.read())["client_id"] == BOT_ID


async def test_http2_across_mtls(mesh: Mesh) -> None:
    addr = mesh.pods["vote-bot"].outbound
    pods = set()
    for _ in range(6):
        status, body = await h2_get(addr, f"{FQN}:{HTTP_PORT}")
        assert status == 200, body
        assert json.loads(body)["client_id"] == BOT_ID
        pods.add(pod_of(body))
    assert pods <= set(REPLICAS)
    assert mesh.pods["vote-bot"].metric(
        "request_total", direction="outbound", tls="true", server_id=WEB_ID
    ) == 6  # fmt: skip


async def echo_calls(channel: grpc.aio.Channel, n: int) -> Counter[str]:
    """`n` unary calls of the echo method, each checked (its message echoed, the caller's
    identity as the replica's proxy vouched for it): how many each replica answered."""
    unary = channel.unary_unary(ECHO)
    pods: Counter[str] = Counter()
    for i in range(n):
        reply = await unary(b"call-%d" % i, timeout=5)
        answer, _, echoed = bytes(reply).partition(b"|")
        assert echoed == b"call-%d" % i
        assert json.loads(answer)["client_id"] == BOT_ID
        pods[pod_of(answer)] += 1
    return pods


async def test_grpc_calls_are_balanced_one_by_one_across_mtls(mesh: Mesh) -> None:
    host, port = mesh.pods["vote-bot"].outbound
    options = [("grpc.default_authority", f"{FQN}:{GRPC_PORT}")]
    async with grpc.aio.insecure_channel(f"{host}:{port}", options=options) as channel:
        pods = await echo_calls(channel, 30)
    # One HTTP/2 connection from the client, yet the calls spread over the replicas.
    assert len(pods) >= 2 and set(pods) <= set(REPLICAS), pods
    assert mesh.pods["vote-bot"].metric(
        "response_total", direction="outbound", tls="true", grpc_status="0"
    ) == 30  # fmt: skip


async def test_a_thousand_grpc_deadlines_leave_the_shared_mesh_connections_alone(
    mesh: Mesh,
) -> None:
    """1,000 calls whose deadline passes beside ordinary calls on one channel: the client
    proxy relays each cancel to a server proxy over the one mTLS connection it keeps to each
    replica. Every deadline stays DEADLINE_EXCEEDED, every ordinary call succeeds, and no
    proxy's guard closes a connection."""
    host, port = mesh.pods["vote-bot"].outbound
    options = [("grpc.default_authority", f"{FQN}:{GRPC_PORT}")]
    async with grpc.aio.insecure_channel(f"{host}:{port}", options=options) as channel:
        storm = await deadline_storm(channel.unary_unary(SLOW), channel.unary_unary(ECHO))
    assert storm.deadlines == {grpc.StatusCode.DEADLINE_EXCEEDED: 1000}
    assert [reply.partition(b"|")[2] for reply in storm.replies] == [b"%d" % i for i in range(100)]
    assert storm.seconds < 10.0
    for pod in mesh.pods.values():
        assert pod.metric("http_client_errors_total", status_code="enhance_your_calm") == 0
    # one mTLS connection from the client pod to each replica, all along
    assert mesh.replicas_metric("tcp_open_total", direction="inbound", tls="true",
                                client_id=BOT_ID) <= len(REPLICAS)  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(180)
async def test_streams_quiet_for_longer_than_every_default_timer_live(mesh: Mesh) -> None:
    """With every timer at its default, through the meshed pair: curl's chunked watch quiet
    for 65 s gets its whole body, and a grpcio bidi stream quiet for 65 s lives on."""
    quiet = 65
    host, port = mesh.pods["vote-bot"].outbound
    curl = await asyncio.create_subprocess_exec(
        "curl", "-sS", "--max-time", str(quiet + 30), "-x", f"http://{host}:{port}",
        f"http://{FQN}:{HTTP_PORT}/watch/{quiet}",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    options = [("grpc.default_authority", f"{FQN}:{GRPC_PORT}")]
    async with grpc.aio.insecure_channel(f"{host}:{port}", options=options) as channel:
        chat = channel.stream_stream(CHAT)(timeout=quiet + 30)
        await chat.write(b"hello")
        first = bytes(await chat.read())
        await asyncio.sleep(quiet)
        await chat.write(b"still here")
        second = bytes(await chat.read())
        await chat.done_writing()
        assert await chat.code() == grpc.StatusCode.OK
    assert first.endswith(b":hello") and second.endswith(b":still here")
    assert first.split(b":")[0] == second.split(b":")[0]  # the same replica: one stream
    out, err = await curl.communicate()
    assert curl.returncode == 0, err
    assert out == b"first\nlast\n"


async def test_a_thousand_cancellations_by_an_h2_client_leave_the_mesh_connections_alone(
    mesh: Mesh,
) -> None:
    """An `h2` client cancels 1,000 requests once the apps have them (a client giving up on
    long polls), crediting flow control as it goes: the cancels cross both proxies to the
    apps, and neither the client's connection nor the shared mTLS ones are closed."""
    reader, writer = await asyncio.open_connection(*mesh.pods["vote-bot"].outbound)
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    writer.write(conn.data_to_send())
    terminated: list[h2.events.ConnectionTerminated] = []
    answered: dict[int, int] = {}

    async def read() -> None:
        while data := await reader.read(65536):
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.ConnectionTerminated):
                    terminated.append(event)
                elif isinstance(event, h2.events.ResponseReceived):
                    answered[event.stream_id] = int(dict(event.headers or ())[b":status"])
                elif isinstance(event, h2.events.DataReceived):
                    conn.acknowledge_received_data(event.flow_controlled_length or 0,
                                                   event.stream_id)  # fmt: skip
            writer.write(conn.data_to_send())

    reading = asyncio.create_task(read())
    request = [(":method", "GET"), (":scheme", "http"), (":authority", f"{FQN}:{HTTP_PORT}")]
    try:
        for wave in range(1, 21):
            sids = []
            for i in range(50):
                sid = conn.get_next_available_stream_id()
                conn.send_headers(sid, [*request, (":path", f"/hold/{wave}/{i}")], end_stream=True)
                sids.append(sid)
            writer.write(conn.data_to_send())
            held = 50 * wave
            await eventually(lambda: mesh.faults.held == held)  # noqa: B023 - awaited at once
            await asyncio.sleep(0.005)
            for sid in sids:
                conn.reset_stream(sid, h2.errors.ErrorCodes.CANCEL)
            writer.write(conn.data_to_send())
        await eventually(lambda: mesh.faults.cancelled == 1000)
        sid = conn.get_next_available_stream_id()
        conn.send_headers(sid, [*request, (":path", "/")], end_stream=True)
        writer.write(conn.data_to_send())
        await eventually(lambda: sid in answered)
        assert answered[sid] == 200
        assert terminated == []
    finally:
        reading.cancel()
        await asyncio.gather(reading, return_exceptions=True)
        await closed(writer)
    for pod in mesh.pods.values():
        assert pod.metric("http_client_errors_total", status_code="enhance_your_calm") == 0


class RedirectedListener:
    """Accepts on the pod's address and hands each connection to its proxy's outbound handler
    (or the inbound one) with `original_dst` set, as iptables' REDIRECT and SO_ORIGINAL_DST
    would."""

    def __init__(self, pod: Pod, original_dst: tuple[str, int], *, inbound: bool = False) -> None:
        self._pod, self._original_dst = pod, HostPort(*original_dst)
        self._inbound = inbound
        self._sock = bind((pod.ip, 0))
        self.addr = HostPort.from_sockaddr(self._sock.getsockname())
        self._task = asyncio.create_task(self._accept())
        self._handlers: set[asyncio.Task[None]] = set()

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        proxy = self._pod.proxy
        assert proxy is not None
        while True:
            sock, client = await loop.sock_accept(self._sock)
            accepted = Accepted(sock, HostPort.from_sockaddr(client), self.addr, self._original_dst)
            stack = proxy.inbound if self._inbound else proxy.outbound
            task = asyncio.create_task(stack.handle(accepted))
            self._handlers.add(task)
            task.add_done_callback(self._handlers.discard)

    async def close(self) -> None:
        for task in (self._task, *self._handlers):
            task.cancel()
        await asyncio.gather(self._task, *self._handlers, return_exceptions=True)
        self._sock.close()


async def test_tls_for_the_pods_identity_on_its_port_is_terminated_by_its_proxy(
    mesh: Mesh, pki: Any
) -> None:
    """How a proxy calls a meshed controller in a cluster: gRPC over TLS straight to the
    controller's port, verifying the controller's identity (the SNI), which the controller's
    proxy holds. That proxy terminates it and the app gets plaintext, with the client's
    identity when it proved one; TLS for another name is the app's own, relayed untouched."""
    web = mesh.pods["web-1"]
    listener = RedirectedListener(web, (web.ip, 8081), inbound=True)
    override = [("grpc.ssl_target_name_override", WEB_ID)]
    anchors = mesh.test_ca.anchors_pem.encode()
    chain, key = pki.leaf(BOT_ID)
    try:
        for credentials, client_id in (
            (grpc.ssl_channel_credentials(root_certificates=anchors), None),  # no header
            (grpc.ssl_channel_credentials(anchors, key.read_bytes(), chain.read_bytes()), BOT_ID),
        ):
            async with grpc.aio.secure_channel(str(listener.addr), credentials,
                                               options=override) as channel:  # fmt: skip
                forged = [(wellknown.CLIENT_ID_HEADER, FORGED)]  # never reaches the app
                reply = await channel.unary_unary(ECHO)(b"hi", timeout=10, metadata=forged)
            answer = json.loads(reply.partition(b"|")[0])
            assert answer == {"pod": "web-1", "client_id": client_id}
        assert web.metric("tcp_open_total", direction="inbound", tls="true", client_id=BOT_ID,
                          target_addr=f"{web.ip}:8081") == 1  # fmt: skip
        # Another name: not ours to open. The app (plaintext gRPC) answers the hello with bytes
        # that are not TLS, so the handshake fails as it would without the proxy.
        context = ssl.create_default_context(cadata=mesh.test_ca.anchors_pem)
        with pytest.raises(ssl.SSLError):
            await asyncio.wait_for(
                asyncio.open_connection(*listener.addr, ssl=context,
                                        server_hostname="api.example.com"), 10)  # fmt: skip
    finally:
        await listener.close()


async def test_opaque_tcp_across_mtls_with_a_server_that_speaks_first(mesh: Mesh) -> None:
    bot = mesh.pods["vote-bot"]
    listener = RedirectedListener(bot, (CLUSTER_IP, TCP_PORT))
    try:
        pods = set()
        for i in range(6):
            reader, writer = await asyncio.open_connection(*listener.addr)
            async with asyncio.timeout(5):
                banner = await reader.readline()  # no detection wait: the port is opaque
                writer.write(b"ping %d\n" % i)
                assert await reader.readline() == b"echo:ping %d\n" % i
            await closed(writer)
            assert banner.startswith(b"hello from web-")
            pods.add(banner.decode().split()[-1])
        assert pods <= set(REPLICAS)
    finally:
        await listener.close()
    assert mesh.replicas_metric("tcp_open_total", direction="inbound", tls="true",
                                client_id=BOT_ID) == 6  # fmt: skip


async def test_a_client_that_half_closes_across_mtls_gets_the_whole_reply(mesh: Mesh) -> None:
    """`nc -N`: the client sends its lines, half-closes, and reads until the server closes.
    Across mTLS the FIN travels as close_notify: the app sees the end of the input and every
    byte of its reply, the echoes of what came before the FIN and a 1 MiB last word after it,
    arrives byte-exact."""
    bot = mesh.pods["vote-bot"]
    listener = RedirectedListener(bot, (CLUSTER_IP, TCP_PORT))
    lines = [b"line %d of the request\n" % i for i in range(1000)]
    try:
        for _ in range(3):
            reader, writer = await asyncio.open_connection(*listener.addr)
            async with asyncio.timeout(10):
                banner = await reader.readline()
                writer.writelines(lines)
                writer.write_eof()
                reply = await reader.read()  # until the server closes
            await closed(writer)
            assert banner.startswith(b"hello from web-")
            assert reply == b"".join(b"echo:" + line for line in lines) + LAST_WORD
    finally:
        await listener.close()
    assert mesh.replicas_metric("tcp_open_total", direction="inbound", tls="true",
                                client_id=BOT_ID) == 3  # fmt: skip


# --- balancing -------------------------------------------------------------------------------


async def test_a_replica_50ms_slower_gets_under_10_percent_after_warm_up(mesh: Mesh) -> None:
    slow = mesh.pods["web-3"].app
    assert slow is not None
    slow.delay = 0.050
    clients = [await H1Client.connect(mesh.pods["vote-bot"].outbound) for _ in range(2)]
    seen: Counter[str] = Counter()

    async def run(client: H1Client, requests: int, count: bool) -> None:
        for _ in range(requests):
            status, _, body = await client.get(f"{FQN}:{HTTP_PORT}")
            assert status == 200
            if count:
                seen[pod_of(body)] += 1

    try:
        await asyncio.gather(*(run(c, 20, count=False) for c in clients))  # warm-up
        await asyncio.gather(*(run(c, 150, count=True) for c in clients))
    finally:
        for client in clients:
            await client.close()
    assert sum(seen.values()) == 300
    assert seen["web-3"] / 300 < 0.10, seen


# --- faults ----------------------------------------------------------------------------------


class Traffic:
    """HTTP/1.1 requests in a loop from the client pod, recording who answered and every
    failure."""

    def __init__(self, mesh: Mesh) -> None:
        self._mesh = mesh
        self.answered: list[str] = []
        self.failures: list[str] = []
        self._stop = asyncio.Event()
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        client = await H1Client.connect(self._mesh.pods["vote-bot"].outbound)
        try:
            while not self._stop.is_set():
                try:
                    status, fields, body = await client.get(f"{FQN}:{HTTP_PORT}")
                except (ConnectionError, asyncio.IncompleteReadError) as exc:
                    self.failures.append(repr(exc))
                    await client.close()
                    client = await H1Client.connect(self._mesh.pods["vote-bot"].outbound)
                    continue
                if status == 200:
                    self.answered.append(pod_of(body))
                else:
                    self.failures.append(f"{status} {fields.get(wellknown.PROXY_ERROR_HEADER)}")
                await asyncio.sleep(0.002)
        finally:
            await client.close()

    async def more(self, count: int) -> list[str]:
        """The next `count` answers."""
        start = len(self.answered)
        await eventually(lambda: len(self.answered) >= start + count)
        return self.answered[start : start + count]

    async def stop(self) -> None:
        self._stop.set()
        await self._task


async def test_destination_killed_mid_traffic_keeps_the_last_endpoints_then_updates_resume(
    mesh: Mesh,
) -> None:
    traffic = Traffic(mesh)
    try:
        await traffic.more(20)
        await mesh.stop_destination()
        during = await traffic.more(60)
        assert set(during) <= set(REPLICAS)
        # The busiest replica leaves the manifests while the control plane is away: the proxy,
        # told nothing, keeps sending to it (the pod still runs).
        busiest = Counter(during).most_common(1)[0][0]
        mesh.remove(busiest)
        await asyncio.sleep(0.3)
        assert busiest in await traffic.more(60)
        await mesh.start_destination()  # on the same port: the proxy reconnects
        await eventually(lambda: busiest not in traffic.answered[-40:], within=15)
        assert busiest not in await traffic.more(60)
    finally:
        await traffic.stop()
    assert traffic.failures == []


async def test_a_replica_that_dies_costs_no_request(mesh: Mesh) -> None:
    traffic = Traffic(mesh)
    try:
        busiest = Counter(await traffic.more(40)).most_common(1)[0][0]
        # It dies; the manifests still list it, so the proxy's pooled connection to it breaks
        # and new connects are refused: each such request is routed to another replica.
        await mesh.kill(busiest)
        after = await traffic.more(100)
        assert busiest not in after[2:]  # at most what was in flight as it died
        mesh.remove(busiest)  # what the endpoints controller does next
        assert busiest not in await traffic.more(60)
    finally:
        await traffic.stop()
    assert traffic.failures == []  # one request at a time: none was lost
    bot = mesh.pods["vote-bot"]
    assert bot.metric("response_total", direction="outbound", status_code="200") == len(
        traffic.answered
    )


async def test_identity_down_at_start_keeps_ready_503_until_it_returns(mesh: Mesh) -> None:
    await mesh.stop_identity()
    pod = await mesh.start_pod("web-4", EXTRA_POD_IP, "tok-web", app=True, wait_ready=False)
    assert pod.proxy is not None
    # its first certification attempt fails (however long a busy machine takes to make it)
    await eventually(
        lambda: pod.metric("identity_cert_refresh_total", result="unavailable") >= 1, within=15
    )
    assert not pod.proxy.ready()
    assert await asyncio.to_thread(pod.ready_status) == 503
    await mesh.start_identity()
    await eventually(pod.proxy.ready, within=15)
    assert await asyncio.to_thread(pod.ready_status) == 200
    assert pod.metric("identity_cert_expiration_timestamp_seconds") > 0


async def test_a_pod_whose_proxy_holds_another_identity_gets_nothing(mesh: Mesh) -> None:
    """Service `api` has one pod, listed with service account `api`, whose proxy holds
    `impostor`'s certificate instead. Its inbound terminates TLS only for its own name, so it
    refuses the handshake for `api`'s; nothing is sent in plaintext and nothing reaches the app.
    (A peer that completes the handshake with another name's certificate is refused by the
    client side: proxy/tests/mesh/test_outbound.py.)"""
    pod = await mesh.start_pod("api-1", EXTRA_POD_IP, "tok-impostor", app=True)
    mesh.put("api", objects.service("api", NS, cluster_ip="10.96.0.21"),
             objects.pod("api-1", EXTRA_POD_IP, NS, app="api", sa="api"))  # fmt: skip
    client = await H1Client.connect(mesh.pods["vote-bot"].outbound)
    try:
        status, fields = await discovered(client, f"api.{NS}.svc.cluster.local:80")
        assert status == 502
        error = fields[wellknown.PROXY_ERROR_HEADER]
        assert "refused (handshake_failed)" in error, error
        status, _, body = await client.get(f"{FQN}:{HTTP_PORT}")  # the rest of the mesh works
        assert status == 200 and pod_of(body) in REPLICAS
    finally:
        await client.close()
    bot = mesh.pods["vote-bot"]
    assert bot.metric("fail_fast_total", direction="outbound", reason="handshake_failed") >= 1
    assert pod.metric("fail_fast_total", direction="inbound", reason="not_our_identity") >= 1
    assert pod.metric("request_total", direction="inbound") == 0


# --- what discovery says -----------------------------------------------------------------------


async def test_dst_overrides_split_traffic_between_services_by_weight(mesh: Mesh) -> None:
    # A canary: service web-v2 with one pod; web's ServiceProfile sends it a quarter of web's
    # traffic.
    await mesh.start_pod("web-v2-1", CANARY_IP, "tok-web", app=True)
    mesh.put("web-v2", objects.service("web-v2", NS, cluster_ip="10.96.0.22"),
             objects.pod("web-v2-1", CANARY_IP, NS, app="web-v2", sa="web"))  # fmt: skip
    mesh.put("profile", objects.profile("web", {"dstOverrides": [
        {"authority": f"{FQN}:{HTTP_PORT}", "weight": 3},
        {"authority": f"web-v2.{NS}.svc.cluster.local:80", "weight": 1},
    ]}))  # fmt: skip
    client = await H1Client.connect(mesh.pods["vote-bot"].outbound)
    try:
        async with asyncio.timeout(10):  # until the profile has reached the proxy
            while not await client_reaches(client, "web-v2-1"):
                pass
        seen: Counter[str] = Counter()
        for _ in range(400):
            status, _, body = await client.get(f"{FQN}:{HTTP_PORT}")
            assert status == 200
            seen["canary" if pod_of(body) == "web-v2-1" else "web"] += 1
    finally:
        await client.close()
    assert 0.15 < seen["canary"] / 400 < 0.35, seen  # 25 % expected; binomial sd 2.2 %


# --- the ServiceProfile's routes: retries, budget, timeouts -------------------------------------

WEB = f"{FQN}:{HTTP_PORT}"


def route(name: str, regex: str, **policy: Any) -> dict[str, Any]:
    return {"name": name, "condition": {"method": "GET", "pathRegex": regex}, **policy}


async def profiled(mesh: Mesh, client: H1Client, *routes: dict[str, Any], **spec: Any) -> None:
    """Puts web's ServiceProfile (its routes, plus `GET /probe`) and waits until the client's
    proxy matches requests to its routes."""
    probe = route("GET /probe", "/probe/.*")
    mesh.put("profile", objects.profile("web", {"routes": [probe, *routes], **spec}))
    bot = mesh.pods["vote-bot"]
    async with asyncio.timeout(10):
        while bot.metric("route_request_total", rt_route="GET /probe") == 0:
            await client.get(WEB, path="/probe/1")
            await asyncio.sleep(0.02)


async def test_a_retryable_route_succeeds_where_its_twin_fails_one_in_five(mesh: Mesh) -> None:
    """web fails 20 % of attempts under /flaky/: retried within the default budget, the
    client sees (almost) none of them; on a route that is not retryable, one in five."""
    client = await H1Client.connect(mesh.pods["vote-bot"].outbound)
    ok: Counter[str] = Counter()
    try:
        await profiled(mesh, client, route("GET /flaky/retried", "/flaky/retried/.*",
                                           isRetryable=True),
                       route("GET /flaky/once", "/flaky/once/.*"))  # fmt: skip
        for i in range(200):
            for name in ("retried", "once"):
                status, _, _ = await client.get(WEB, path=f"/flaky/{name}/{i}")
                ok[name] += status == 200
    finally:
        await client.close()
    assert ok["retried"] >= 0.97 * 200, ok
    assert 0.70 * 200 <= ok["once"] <= 0.90 * 200, ok  # 80 % expected; binomial sd 2.8 %
    bot = mesh.pods["vote-bot"]
    retried = {"direction": "outbound", "dst": WEB, "rt_route": "GET /flaky/retried"}
    assert bot.metric("route_request_total", **retried) == 200
    assert bot.metric("route_response_total", classification="success", **retried) == ok["retried"]
    attempts = bot.metric("route_actual_request_total", **retried)
    assert attempts > 200  # the retries, counted as Linkerd counts them
    assert attempts + 200 == mesh.faults.attempts["flaky"]  # what web's replicas saw
    assert bot.metric("route_actual_response_total", status_code="500", **retried) >= 20
    assert bot.metric("route_response_total", rt_route="GET /flaky/once",
                      status_code="500", classification="failure") == 200 - ok["once"]  # fmt: skip
    assert bot.metric("retry_skipped_total") == 0


async def test_a_retry_goes_to_another_replica(mesh: Mesh) -> None:
    """Under /sick/ one replica fails every attempt and the others answer. A retry is sent
    to another replica than the one its request failed on: every request succeeds and none
    is tried on the sick replica twice."""

    def on_sick() -> list[int]:
        return [n for (pod, _), n in mesh.faults.visits.items() if pod == mesh.faults.sick]

    client = await H1Client.connect(mesh.pods["vote-bot"].outbound)
    statuses: list[int] = []
    try:
        await profiled(mesh, client, route("GET /sick", "/sick/.*", isRetryable=True))
        # until the sick replica got first attempts (so retries were needed): the balancer
        # sends it fewer the more it fails, and how many fewer depends on the machine's pace
        # (10 in 150 requests on a quiet machine; fewer than 10 in 1,000 on a busy CI run)
        while len(on_sick()) < 3 and len(statuses) < 1000:
            first = len(statuses)
            statuses += [(await client.get(WEB, path=f"/sick/{i}"))[0]
                         for i in range(first, first + 50)]  # fmt: skip
    finally:
        await client.close()
    assert statuses == [200] * len(statuses)
    assert on_sick(), len(statuses)  # retries were needed: the test is not vacuous
    assert max(on_sick()) == 1
    bot = mesh.pods["vote-bot"]
    assert bot.metric("retry_skipped_total", rt_route="GET /sick") == 0


async def test_the_retry_budget_caps_retries_when_every_attempt_fails(mesh: Mesh) -> None:
    """Every attempt under /broken/ fails. The budget (20 % of requests, 1 a second, 10 s)
    allows 100 requests at most 20 + 10 retries, where unbounded retries would double or
    triple the load on a failing service."""
    client = await H1Client.connect(mesh.pods["vote-bot"].outbound)
    budget = {"retryRatio": 0.2, "minRetriesPerSecond": 1, "ttl": "10s"}
    try:
        await profiled(mesh, client, route("GET /broken", "/broken/.*", isRetryable=True),
                       retryBudget=budget)  # fmt: skip
        for i in range(100):
            status, fields, _ = await client.get(WEB, path=f"/broken/{i}")
            assert status == 503, fields  # web's own answer
    finally:
        await client.close()
    retries = mesh.faults.attempts["broken"] - 100
    assert 20 <= retries <= 30, mesh.faults.attempts
    bot = mesh.pods["vote-bot"]
    assert bot.metric("route_actual_request_total", rt_route="GET /broken") == 100 + retries
    assert bot.metric("retry_skipped_total", rt_route="GET /broken") >= 100 - retries


async def test_a_route_timeout_answers_504_and_cancels_the_upstream_request(mesh: Mesh) -> None:
    client = await H1Client.connect(mesh.pods["vote-bot"].outbound)
    loop = asyncio.get_running_loop()
    try:
        await profiled(mesh, client, route("GET /slow", "/slow/.*", timeout="200ms"))
        started = loop.time()
        status, fields, _ = await client.get(WEB, path="/slow/1")
        elapsed = loop.time() - started
        # The connection stays usable after a timeout.
        assert (await client.get(WEB, path="/probe/2"))[0] == 200
    finally:
        await client.close()
    assert status == 504, fields
    assert fields[wellknown.PROXY_ERROR_HEADER] == "the route's timeout of 0.2s passed"
    # The route's 200 ms, not the app's 1.5 s (the loop's clock counts whole milliseconds;
    # the rest is slack for a busy machine).
    assert 0.199 <= elapsed < 1.0, elapsed
    # The app counts a cancel only if the client left before its 1.5 s answer.
    await eventually(lambda: mesh.faults.cancelled == 1)
    bot = mesh.pods["vote-bot"]
    assert bot.metric("route_response_total", rt_route="GET /slow", status_code="504",
                      classification="failure") == 1  # fmt: skip
    assert bot.metric("route_response_latency_ms_count", rt_route="GET /slow") == 1


async def discovered(client: H1Client, authority: str) -> tuple[int, dict[str, str]]:
    """The first answer for `authority` once the destination service has read the manifest
    naming it (until then the name is unknown and does not resolve)."""
    async with asyncio.timeout(5):
        while True:
            status, fields, _ = await client.get(authority)
            if "does not resolve" not in fields.get(wellknown.PROXY_ERROR_HEADER, ""):
                return status, fields
            await asyncio.sleep(0.05)


async def client_reaches(client: H1Client, pod: str) -> bool:
    for _ in range(20):
        _, _, body = await client.get(f"{FQN}:{HTTP_PORT}")
        if pod_of(body) == pod:
            return True
    return False


async def test_a_service_without_endpoints_fails_fast_with_503(mesh: Mesh) -> None:
    mesh.put("empty", objects.service("empty", NS, cluster_ip="10.96.0.23"))  # selects no pod
    client = await H1Client.connect(mesh.pods["vote-bot"].outbound)
    authority = f"empty.{NS}.svc.cluster.local:80"

    try:
        assert (await discovered(client, authority))[0] == 503
        loop = asyncio.get_running_loop()
        for _ in range(3):
            started = loop.time()
            status, fields, _ = await client.get(authority)
            assert status == 503, fields
            assert "no endpoints" in fields[wellknown.PROXY_ERROR_HEADER]
            assert loop.time() - started < 1.0
    finally:
        await client.close()
    assert mesh.pods["vote-bot"].metric("fail_fast_total", reason="no_endpoints") >= 4


async def test_what_discovery_does_not_know_is_forwarded_as_is_unmeshed(mesh: Mesh) -> None:
    """An address that is no service and no pod (`no_endpoints{exists: false}`) goes where the
    client sent it, in plaintext."""
    outside = App("outside", OUTSIDE_IP, mesh.faults)
    await outside.start()
    client = await H1Client.connect(mesh.pods["vote-bot"].outbound)
    try:
        status, _, body = await client.get(f"{OUTSIDE_IP}:8080")
        assert status == 200
        assert json.loads(body) == {"pod": "outside", "client_id": None}  # no mTLS: no identity
    finally:
        await client.close()
        await outside.stop()
    assert mesh.pods["vote-bot"].metric(
        "request_total", direction="outbound", authority=f"{OUTSIDE_IP}:8080", tls="no_identity"
    ) == 1  # fmt: skip


async def test_opaque_tcp_to_a_service_without_endpoints_is_reset(mesh: Mesh) -> None:
    opaque = {wellknown.OPAQUE_PORTS_ANNOTATION: str(TCP_PORT)}
    mesh.put("empty-tcp", objects.service("empty-tcp", NS, cluster_ip="10.96.0.24",
             ports=[("tcp", TCP_PORT, TCP_PORT)], annotations=opaque))  # fmt: skip
    listener = RedirectedListener(mesh.pods["vote-bot"], ("10.96.0.24", TCP_PORT))
    try:
        async with asyncio.timeout(5):
            # Until the destination service has read the new manifest (before, the address is
            # unknown, the port not opaque, and the proxy waits for the client to speak).
            while True:
                reader, writer = await asyncio.open_connection(*listener.addr)
                try:
                    async with asyncio.timeout(0.3):
                        await reader.read(100)
                except ConnectionResetError:
                    break
                except TimeoutError:
                    pass
                finally:
                    await closed(writer)
    finally:
        await listener.close()
    assert mesh.pods["vote-bot"].metric("fail_fast_total", reason="no_endpoints") >= 1


# --- what a meshed client may declare ---------------------------------------------------------


class Conversation(asyncio.Protocol):
    """The client end of a raw mesh connection: what came back, and whether it ended."""

    def __init__(self) -> None:
        self.received = bytearray()
        self.ended = asyncio.Event()
        self.arrived = asyncio.Event()
        self.lost = asyncio.Event()

    def data_received(self, data: bytes) -> None:
        self.received += data
        self.arrived.set()

    def eof_received(self) -> bool:
        self.ended.set()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.ended.set()
        self.lost.set()

    async def until(self, text: bytes) -> None:
        async with asyncio.timeout(5):
            while text not in self.received and not self.ended.is_set():
                self.arrived.clear()
                await self.arrived.wait()

    async def close(self, transport: asyncio.BaseTransport) -> None:
        """Closes the connection, and waits until TLS has said goodbye and let go of the
        socket."""
        transport.close()
        async with asyncio.timeout(10):
            await self.lost.wait()


async def declared(
    mesh: Mesh, pki: Any, port: int, session: SessionProtocol
) -> tuple[asyncio.Transport, Conversation]:
    """A mesh connection to web-1's inbound proxy, with a valid certificate of vote-bot's, whose
    transport header asks for `port` with the session protocol `session`."""
    context = contexts.client_context(*pki.leaf(BOT_ID), mesh.test_ca.anchors_pem)
    connect = mesh_connect(context, WEB_ID, port, session)
    conversation = Conversation()
    transport, _ = await connect(HostPort(REPLICAS["web-1"], wellknown.PROXY_INBOUND_PORT),
                                 lambda: conversation)  # fmt: skip
    return transport, conversation


FORGED = "admin.kube-system.serviceaccount.identity.meshlet.cluster.local"


async def test_only_proxies_say_a_failure_was_theirs(mesh: Mesh) -> None:
    """An app's `meshlet-proxy-error` (or Linkerd's `l5d-proxy-error`) never reaches the
    caller; the server proxy's own, for an app it cannot reach, does, through both proxies."""
    client = await H1Client.connect(mesh.pods["vote-bot"].outbound)
    try:
        status, fields, _ = await client.get(f"{FQN}:{HTTP_PORT}", path="/forge/x")
        assert status == 200
        assert "meshlet-proxy-error" not in fields and "l5d-proxy-error" not in fields
        for name in REPLICAS:
            app = mesh.pods[name].app
            assert app is not None
            await app.stop()
        status, fields, _ = await client.get(f"{FQN}:{HTTP_PORT}", path="/")
        assert status == 502
        assert "8080" in fields["meshlet-proxy-error"], fields
    finally:
        await client.close()


@pytest.mark.parametrize("session", [SessionProtocol.OPAQUE, SessionProtocol.HTTP1])
async def test_a_meshed_client_cannot_forge_the_identity_header(
    mesh: Mesh, pki: Any, session: SessionProtocol
) -> None:
    """Whatever the transport header declares, HTTP to a port that is not opaque is served as
    HTTP: the app sees the identity the proxy verified, never the client's own header."""
    transport, conversation = await declared(mesh, pki, 8080, session)
    transport.write(
        f"GET / HTTP/1.1\r\nHost: web\r\n{wellknown.CLIENT_ID_HEADER}: {FORGED}\r\n"
        f"Content-Length: 0\r\n\r\n".encode()
    )
    await conversation.until(b"}")
    await conversation.close(transport)
    head, _, body = bytes(conversation.received).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    assert json.loads(body) == {"pod": "web-1", "client_id": BOT_ID}


async def test_http2_declared_opaque_is_served_as_http2_with_the_verified_identity(
    mesh: Mesh, pki: Any
) -> None:
    transport, conversation = await declared(mesh, pki, 8080, SessionProtocol.OPAQUE)
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    conn.send_headers(
        1, [(":method", "GET"), (":scheme", "http"), (":authority", "web"), (":path", "/"),
            (wellknown.CLIENT_ID_HEADER, FORGED)],
        end_stream=True,
    )  # fmt: skip
    transport.write(conn.data_to_send())
    body = b""
    async with asyncio.timeout(5):
        while not body.endswith(b"}"):
            conversation.arrived.clear()
            await conversation.arrived.wait()
            for event in conn.receive_data(bytes(conversation.received)):
                if isinstance(event, h2.events.DataReceived):
                    body += event.data or b""
            conversation.received.clear()
    await conversation.close(transport)
    assert json.loads(body) == {"pod": "web-1", "client_id": BOT_ID}


async def test_a_server_speaks_first_app_on_a_port_not_declared_opaque_works_after_detection(
    mesh: Mesh, pki: Any
) -> None:
    started = asyncio.get_running_loop().time()
    transport, conversation = await declared(mesh, pki, BANNER_PORT, SessionProtocol.OPAQUE)
    await conversation.until(b"\n")
    waited = asyncio.get_running_loop().time() - started
    assert bytes(conversation.received) == b"hello from web-1\n"
    assert INBOUND_DETECT_TIMEOUT - 0.1 < waited < INBOUND_DETECT_TIMEOUT + 2
    transport.write(b"EHLO vote-bot\n")
    await conversation.until(b"echo:")
    await conversation.until(b"vote-bot\n")
    await conversation.close(transport)
    assert bytes(conversation.received).endswith(b"echo:EHLO vote-bot\n")
    assert mesh.pods["web-1"].metric("protocol_detect_timeout_total", direction="inbound",
                                      port=str(BANNER_PORT)) == 1  # fmt: skip


async def test_http_sent_after_the_detection_timeout_is_refused_not_relayed(
    mesh: Mesh, pki: Any
) -> None:
    """A client silent through detection is relayed as a server-speaks-first protocol; if it
    then sends HTTP, the connection is closed and the app gets none of it."""
    transport, conversation = await declared(mesh, pki, BANNER_PORT, SessionProtocol.OPAQUE)
    await conversation.until(b"\n")  # the banner: detection gave up on the client
    transport.write(f"GET / HTTP/1.1\r\n{wellknown.CLIENT_ID_HEADER}: {FORGED}\r\n\r\n".encode())
    async with asyncio.timeout(5):
        await conversation.ended.wait()
    await conversation.close(transport)
    assert b"echo:" not in conversation.received  # the app never saw the request
    assert mesh.pods["web-1"].metric("fail_fast_total", direction="inbound",
                                      reason="late_http") == 1  # fmt: skip


# --- the proxy as the app's HTTP proxy (HTTP_PROXY, grpc_proxy) --------------------------------


async def curl(*argv: str) -> tuple[int, bytes, bytes]:
    proc = await asyncio.create_subprocess_exec(
        "curl", "-sS", "--max-time", "10", *argv,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await proc.communicate()
    assert proc.returncode is not None
    return proc.returncode, out, err


@pytest.mark.parametrize("name", ["web", f"web.{NS}", f"web.{NS}.svc", FQN])
async def test_an_app_using_its_proxy_as_http_proxy_reaches_a_service_by_any_of_its_names(
    mesh: Mesh, name: str
) -> None:
    """Absolute-form requests (what an HTTP client with HTTP_PROXY sends) name the Service as
    a pod's DNS search list completes it: in the pod's namespace, `web.ns`, `web.ns.svc`."""
    host, port = mesh.pods["vote-bot"].outbound
    code, body, err = await curl("-x", f"http://{host}:{port}", f"http://{name}:{HTTP_PORT}/")
    assert code == 0, err
    assert json.loads(body)["client_id"] == BOT_ID  # across mTLS, from the replica's proxy
    assert pod_of(body) in REPLICAS
    assert mesh.pods["vote-bot"].metric(
        "request_total", direction="outbound", tls="true", server_id=WEB_ID,
        authority=f"{FQN}:{HTTP_PORT}",
    ) == 1  # fmt: skip


async def test_grpcio_with_the_proxy_as_its_grpc_proxy_tunnels_by_connect_across_mtls(
    mesh: Mesh,
) -> None:
    """grpcio's proxy support (`grpc_proxy`, here its channel option) opens a CONNECT tunnel to
    the short name; the tunnel is an outbound connection to the Service: each call balanced
    across the replicas over mTLS, with the caller's identity."""
    host, port = mesh.pods["vote-bot"].outbound
    options = [("grpc.http_proxy", f"http://{host}:{port}")]
    async with grpc.aio.insecure_channel(f"web:{GRPC_PORT}", options=options) as channel:
        pods = await echo_calls(channel, 30)
    assert len(pods) >= 2 and set(pods) <= set(REPLICAS), pods
    bot = mesh.pods["vote-bot"]
    assert bot.metric("response_total", direction="outbound", tls="true",
                      grpc_status="0") == 30  # fmt: skip
    # one tunnel, labelled with the authority it named
    assert bot.metric("tcp_open_total", direction="outbound", peer="src",
                      target_addr=f"web:{GRPC_PORT}") == 1  # fmt: skip


async def test_curl_tunnels_http_through_connect_and_to_an_address_outside_the_mesh(
    mesh: Mesh,
) -> None:
    """`curl -p` (a CONNECT tunnel, then its request inside): to a Service by name across
    mTLS; to a server discovery does not know, where its name resolves, as is."""
    host, port = mesh.pods["vote-bot"].outbound
    proxy = f"http://{host}:{port}"
    code, body, err = await curl("-p", "-x", proxy, f"http://web.{NS}:{HTTP_PORT}/")
    assert code == 0, err
    assert json.loads(body)["client_id"] == BOT_ID and pod_of(body) in REPLICAS

    async def outside(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 7\r\nconnection: close\r\n\r\noutside")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(outside, "localhost", 0)
    try:
        there = server.sockets[0].getsockname()[1]
        code, body, err = await curl("-p", "-x", proxy, f"http://localhost:{there}/")
        assert (code, body) == (0, b"outside"), err
    finally:
        server.close()
        await server.wait_closed()


async def connect_answer(addr: tuple[str, int], head: bytes) -> tuple[int, bytes]:
    """What the proxy answers to `head` sent as a connection's first bytes: the status and the
    `meshlet-proxy-error` value; (0, b"") when it closes without an answer."""
    reader, writer = await asyncio.open_connection(*addr)
    try:
        writer.write(head)
        async with asyncio.timeout(10):
            answer = await reader.read()  # until the proxy closes the connection
    finally:
        writer.close()
    if not answer:
        return 0, b""
    status = int(answer.split(b" ", 2)[1])
    fields = dict(_field(line.decode()) for line in answer.split(b"\r\n\r\n")[0].split(b"\r\n")[1:])
    return status, fields.get(wellknown.PROXY_ERROR_HEADER, "").encode()


@pytest.mark.parametrize(
    ("head", "status", "error"),
    [
        (b"CONNECT web\r\n\r\n", 400, b"malformed CONNECT request line"),
        (b"CONNECT web HTTP/1.1\r\n\r\n", 400, b"the CONNECT target must be host:port"),
        (b"CONNECT /x:80 HTTP/1.1\r\n\r\n", 400, b"the CONNECT target must be host:port"),
        (b"CONNECT nowhere.invalid:80 HTTP/1.1\r\n\r\n", 502,
         b"the request's authority does not resolve"),
        (b"CONNECT 127.0.0.1:4140 HTTP/1.1\r\n\r\n", 403,
         b"the request targets the proxy itself (a routing loop)"),
        # the pod's own address, which discovery knows, and its IPv4-mapped spelling (once a
        # tunnel into the proxy itself, opened again and again without end)
        # (ids of their own: the pods' addresses differ between xdist workers)
        pytest.param(f"CONNECT {CLIENT_IP}:4143 HTTP/1.1\r\n\r\n".encode(), 403,
                     b"the request targets the proxy itself (a routing loop)",
                     id="the-pods-own-inbound-port"),
        pytest.param(f"CONNECT [::ffff:{CLIENT_IP}]:4140 HTTP/1.1\r\n\r\n".encode(), 403,
                     b"the request targets the proxy itself (a routing loop)",
                     id="the-pods-own-outbound-port-ipv4-mapped"),
        (b"CONNECT web:80 HTTP/1.1\r\nHost web\r\n\r\n", 400,
         b"malformed CONNECT header field"),
        (b"CONNECT web:80 HTTP/1.1\r\nx: a\x00b\r\n\r\n", 400,
         b"malformed CONNECT header field"),
        (b"CONNECT web:80 HTTP/1.1\r\nx: " + b"a" * 17000 + b"\r\n\r\n", 431,
         b"the CONNECT request's head is too large"),
    ],
)  # fmt: skip
async def test_a_bad_connect_is_answered_with_its_error_and_closed(
    mesh: Mesh, head: bytes, status: int, error: bytes
) -> None:
    bot = mesh.pods["vote-bot"]
    assert await connect_answer(bot.outbound, head) == (status, error)
    assert bot.metric("fail_fast_total", direction="outbound", reason="connect") == 1


async def test_a_tunnel_carries_what_came_with_its_head_after_empty_lines(mesh: Mesh) -> None:
    """Empty lines before the request line are skipped (as for any request); a request sent
    in the same packet as the CONNECT head goes through the tunnel."""
    reader, writer = await asyncio.open_connection(*mesh.pods["vote-bot"].outbound)
    writer.write(b"\r\n\r\nCONNECT web:80 HTTP/1.1\r\nHost: web:80\r\n\r\n"
                 b"GET / HTTP/1.1\r\nHost: web\r\nConnection: close\r\n\r\n")  # fmt: skip
    async with asyncio.timeout(10):
        answer = await reader.read()
    writer.close()
    established, _, inner = answer.partition(b"\r\n\r\n")
    assert established == b"HTTP/1.1 200 Connection established"
    assert inner.startswith(b"HTTP/1.1 200 ")
    assert pod_of(inner.partition(b"\r\n\r\n")[2]) in REPLICAS


async def test_a_connect_head_cut_short_is_closed_without_an_answer(mesh: Mesh) -> None:
    reader, writer = await asyncio.open_connection(*mesh.pods["vote-bot"].outbound)
    writer.write(b"CONNECT web:80 HTTP/1.1\r\nHost: web")
    writer.write_eof()
    async with asyncio.timeout(10):
        assert await reader.read() == b""
    writer.close()
