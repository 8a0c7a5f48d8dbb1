"""The mesh transport between proxies: mutual TLS 1.3 and the transport header, both sides."""

from meshlet.proxy.mesh.inbound import MeshInbound, PassThrough, Refused, Terminated, relay
from meshlet.proxy.mesh.outbound import MeshConnectError, mesh_connect
from meshlet.proxy.mesh.refusal import Refusal

__all__ = [
    "MeshConnectError",
    "MeshInbound",
    "PassThrough",
    "Refusal",
    "Refused",
    "Terminated",
    "mesh_connect",
    "relay",
]
