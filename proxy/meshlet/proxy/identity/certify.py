"""A `Certify` client on grpclib (DESIGN §5: grpcio costs the proxy 10 MB, grpclib 1 MB)."""

from __future__ import annotations

import ssl
from dataclasses import dataclass

from grpclib.client import Channel
from grpclib.config import Configuration
from grpclib.exceptions import GRPCError, StreamTerminatedError

from meshlet.api import identity_grpc, identity_pb2
from meshlet.api.cancellation import isolated
from meshlet.proxy.tls.contexts import control_client_context


@dataclass(frozen=True, slots=True)
class Certificate:
    leaf_der: bytes
    intermediates_der: tuple[bytes, ...]
    valid_until: float  # Unix time


class CertifyFailed(Exception):
    """The identity service refused or could not be reached; `status` names the gRPC code."""

    def __init__(self, status: str, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message


class CertifyClient:
    """Talks to the identity service over TLS, verifying it by name against the anchors."""

    def __init__(
        self,
        host: str,
        port: int,
        server_name: str,
        trust_anchors_pem: str,
        *,
        timeout: float = 10.0,
    ) -> None:
        context = control_client_context(trust_anchors_pem)
        self._channel = Channel(
            host, port, ssl=context, config=Configuration(ssl_target_name_override=server_name)
        )
        self._stub = identity_grpc.IdentityStub(self._channel)
        self._timeout = timeout

    async def certify(self, identity: str, token: bytes, csr_der: bytes) -> Certificate:
        request = identity_pb2.CertifyRequest(
            identity=identity, token=token, certificate_signing_request=csr_der
        )
        try:
            # In a task of its own: grpclib cancels the task it runs in to wake it, and raises
            # its own error in place of a cancellation of ours (meshlet.api.cancellation).
            response = await isolated(self._stub.Certify(request, timeout=self._timeout))
        except GRPCError as exc:
            raise CertifyFailed(exc.status.name, exc.message or "") from exc
        except (OSError, ssl.SSLError, StreamTerminatedError, TimeoutError) as exc:
            raise CertifyFailed("UNAVAILABLE", f"identity service unreachable: {exc}") from exc
        return Certificate(
            leaf_der=response.leaf_certificate,
            intermediates_der=tuple(response.intermediate_certificates),
            valid_until=response.valid_until.seconds + response.valid_until.nanos / 1e9,
        )

    def close(self) -> None:
        self._channel.close()
