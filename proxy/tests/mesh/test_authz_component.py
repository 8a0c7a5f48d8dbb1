"""Inbound authorization end to end: the mesh of test_component.py (identity, destination, web's
three replicas and the vote-bot client, each with a real proxy over mTLS), whose proxies watch
their inbound ports' policies from `PolicyFixture`.

`PolicyFixture` is a test fixture, not the policy controller: a grpclib server of
`InboundServerPolicies.WatchPort` that sends, for every workload, the `Server` the test sets
for a port, again whenever the test changes it; the test can stop it to play a lost controller.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import duration_pb2
from grpclib.server import Server as GrpcServer

from meshlet.api import inbound_grpc, inbound_pb2, meta_pb2, net_pb2, wellknown
from meshlet.controlplane.k8s import objects
from meshlet_testing.polling import eventually

# The mesh of test_component.py, to which this module adds policies (its tests are not run here).
_spec = importlib.util.spec_from_file_location(
    "mesh_component", Path(__file__).with_name("test_component.py")
)
assert _spec is not None and _spec.loader is not None
_component = sys.modules["mesh_component"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_component)
CLIENT_IP = _component.CLIENT_IP
ECHO = _component.ECHO
FQN = _component.FQN
GRPC_PORT = _component.GRPC_PORT
HTTP_PORT = _component.HTTP_PORT
NS = _component.NS
REPLICAS = _component.REPLICAS
TCP_PORT = _component.TCP_PORT
WEB_ID = _component.WEB_ID
H1Client = _component.H1Client
Mesh = _component.Mesh
Pod = _component.Pod
free_port = _component.free_port
h2_get = _component.h2_get
web_pod = _component.web_pod

BOT_ID = wellknown.identity_name("vote-bot", NS)
GROUP = wellknown.POLICY_API_GROUP


def server(*authzs: inbound_pb2.Authz, name: str = "web", rate: int = 0) -> inbound_pb2.Server:
    detect = inbound_pb2.ProxyProtocol.Detect(timeout=duration_pb2.Duration(seconds=1))
    if rate:
        detect.http_local_rate_limit.identity.requestsPerSecond = rate
    return inbound_pb2.Server(
        protocol=inbound_pb2.ProxyProtocol(detect=detect),
        authorizations=list(authzs),
        labels={"group": GROUP, "kind": "server", "name": name},
    )


def identities(name: str, *ids: str) -> inbound_pb2.Authz:
    authn = inbound_pb2.Authn(meshTLS=inbound_pb2.Authn.PermitMeshTLS(
        identities=inbound_pb2.Authn.PermitMeshTLS.PermitClientIdentities(
            identities=[inbound_pb2.Identity(name=i) for i in ids])))  # fmt: skip
    every = inbound_pb2.Network(net=net_pb2.IPNetwork(ip=net_pb2.IPAddress(ipv4=0), prefix_len=0))
    meta = meta_pb2.Metadata(resource=meta_pb2.Resource(group=GROUP, kind="authorizationpolicy",
                                                         name=name))  # fmt: skip
    return inbound_pb2.Authz(networks=[every], authentication=authn, metadata=meta)


class PolicyFixture(inbound_grpc.InboundServerPoliciesBase):
    """A test fixture serving WatchPort from `policies` (port → Server); see the docstring."""

    def __init__(self) -> None:
        self.policies: dict[int, inbound_pb2.Server] = {}
        self.changed = asyncio.Condition()
        self.port = free_port()
        self._server: GrpcServer | None = None

    async def start(self) -> None:
        self._server = GrpcServer([self])
        await self._server.start("127.0.0.1", self.port)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def set(self, port: int, policy: inbound_pb2.Server) -> None:
        async with self.changed:
            self.policies[port] = policy
            self.changed.notify_all()

    async def GetPort(self, stream: Any) -> None:
        spec = await stream.recv_message()
        await stream.send_message(self.policies[spec.port])

    async def WatchPort(self, stream: Any) -> None:
        spec = await stream.recv_message()
        sent: list[inbound_pb2.Server | None] = [None]

        def news() -> bool:
            return self.policies.get(spec.port) is not sent[0]

        while True:
            async with self.changed:
                await self.changed.wait_for(news)
                sent[0] = self.policies[spec.port]
            await stream.send_message(sent[0])


class PolicedMesh(Mesh):  # type: ignore[misc,valid-type]
    policy: PolicyFixture
    default_policy: str = "all-unauthenticated"

    def env(self, pod: Pod) -> dict[str, str]:
        env = super().env(pod)
        env[wellknown.ProxyEnv.POLICY_SVC_ADDR] = f"127.0.0.1:{self.policy.port}"
        env[wellknown.ProxyEnv.POLICY_WORKLOAD] = json.dumps({"ns": NS, "pod": pod.name})
        env[wellknown.ProxyEnv.INBOUND_PORTS] = "8080,8081,9000"
        env[wellknown.ProxyEnv.INBOUND_DEFAULT_POLICY] = self.default_policy
        return env


async def start_mesh(mesh: PolicedMesh) -> None:
    mesh.manifests.mkdir()
    mesh.put("svc", objects.service(
        "web", NS, cluster_ip="10.96.0.20",
        ports=[("http", HTTP_PORT, 8080), ("grpc", GRPC_PORT, 8081), ("tcp", TCP_PORT, TCP_PORT)],
        annotations={wellknown.OPAQUE_PORTS_ANNOTATION: str(TCP_PORT)},
    ))  # fmt: skip
    for name, ip in REPLICAS.items():
        mesh.put(name, web_pod(name, ip))
    mesh.put("vote-bot", objects.pod("vote-bot", CLIENT_IP, NS, app="vote-bot", sa="vote-bot"))
    await mesh.start_identity()
    await mesh.start_destination()
    for name, ip in REPLICAS.items():
        await mesh.start_pod(name, ip, "tok-web", app=True)
    await mesh.start_pod("vote-bot", CLIENT_IP, "tok-bot", app=False)


@pytest.fixture
async def policed(test_ca: Any, tmp_path: Path) -> AsyncIterator[PolicedMesh]:
    mesh = PolicedMesh(tmp_path, test_ca)
    mesh.policy = PolicyFixture()
    await mesh.policy.start()
    try:
        await start_mesh(mesh)
        yield mesh
    finally:
        await mesh.policy.stop()
        await mesh.close()


async def get(mesh: Mesh, *extra: str) -> tuple[int, dict[str, str]]:
    client = await H1Client.connect(mesh.pods["vote-bot"].outbound)
    try:
        status, fields, _ = await client.get(f"{FQN}:{HTTP_PORT}", *extra)
        return status, fields
    finally:
        await client.close()


async def test_default_then_the_controllers_policy_and_a_loopback_client_as_linkerd(
    policed: PolicedMesh,
) -> None:
    """Without iptables the client proxy's connections come from 127.0.0.1, which every policy
    from a controller allows (as linkerd2-proxy adds it): vote-bot's requests are allowed by
    `localhost`, not by its identity, and counted so. Denials of other clients are covered
    where the client's address can be chosen (the deny test below, the core's tables)."""
    assert (await get(policed))[0] == 200  # the default policy before any answer
    await policed.policy.set(8080, server(identities("web-only", WEB_ID), rate=2))
    await eventually(lambda: all(p.proxy is not None and p.proxy.policy.policies(8080).meta.name
                                 == "web" for p in policed.pods.values()), within=2)  # fmt: skip
    # A forged identity header changes nothing; the rate limit is per (TLS) identity.
    statuses = [(await get(policed, f"{wellknown.LINKERD_CLIENT_ID_HEADER}: {WEB_ID}"))[0]
                for _ in range(20)]  # fmt: skip
    assert set(statuses) == {200, 429} and statuses[:2] == [200, 200], statuses
    assert policed.replicas_metric(
        "inbound_http_authz_allow_total", authz_kind="default", authz_name="localhost",
        srv_name="web", client_id=BOT_ID, tls="true",
    ) == 20  # fmt: skip
    assert policed.replicas_metric(
        "inbound_http_local_ratelimit_total", ratelimit_scope="identity", client_id=BOT_ID
    ) == statuses.count(429)  # fmt: skip
    # The controller goes away: the last policy stands.
    await policed.policy.stop()
    await asyncio.sleep(1.1)
    assert (await get(policed))[0] == 200
    assert all(p.proxy is not None and p.proxy.policy.policies(8080).meta.name == "web"
               for p in policed.pods.values())  # fmt: skip


@pytest.fixture
async def denying(test_ca: Any, tmp_path: Path) -> AsyncIterator[PolicedMesh]:
    """The policy controller never answers (its address is closed), the default is deny."""
    mesh = PolicedMesh(tmp_path, test_ca)
    mesh.policy = PolicyFixture()  # never started
    mesh.default_policy = "deny"
    try:
        await start_mesh(mesh)
        yield mesh
    finally:
        await mesh.close()


async def test_deny_fails_closed_without_a_controller(denying: PolicedMesh) -> None:
    client = await H1Client.connect(denying.pods["vote-bot"].outbound)
    try:
        status, fields, _ = await client.get(f"{FQN}:{HTTP_PORT}")
    except (ConnectionError, asyncio.IncompleteReadError):
        status, fields = 0, {}
    finally:
        await client.close()
    assert status != 200, fields
    assert denying.replicas_metric("inbound_tcp_authz_deny_total", srv_name="deny") >= 1
