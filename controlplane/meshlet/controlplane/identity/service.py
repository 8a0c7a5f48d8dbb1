"""The Identity gRPC service: checks a certification request, then signs it."""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from collections.abc import Callable

import grpc
from google.protobuf.timestamp_pb2 import Timestamp
from prometheus_client import CollectorRegistry, Gauge

from meshlet.api import identity_pb2, identity_pb2_grpc, wellknown
from meshlet.controlplane.grpcmetrics import HandledCounter
from meshlet.controlplane.identity import csr
from meshlet.controlplane.identity.ca import Issuer
from meshlet.controlplane.identity.errors import CertifyError
from meshlet.controlplane.identity.signer import LEAF_LIFETIME, issue_leaf
from meshlet.controlplane.identity.source import IssuerHolder
from meshlet.controlplane.identity.tokens import TokenValidator

log = logging.getLogger(__name__)

Clock = Callable[[], dt.datetime]


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


class IdentityMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.handled = HandledCounter(registry, "io.linkerd.proxy.identity.Identity")
        self.issuer_expiry = Gauge(
            "identity_cert_expiration_timestamp_seconds",
            "When the issuer certificate chain stops being valid (Unix time).",
            registry=registry,
        )

    def issuer_loaded(self, issuer: Issuer) -> None:
        self.issuer_expiry.set(issuer.not_after.timestamp())


class IdentityService(identity_pb2_grpc.IdentityServicer):
    def __init__(
        self,
        holder: IssuerHolder,
        validator: TokenValidator,
        metrics: IdentityMetrics,
        *,
        control_ns: str = wellknown.CONTROL_PLANE_NAMESPACE,
        trust_domain: str = wellknown.TRUST_DOMAIN,
        clock: Clock = utcnow,
        concurrency: int = 32,
        lifetime: dt.timedelta = LEAF_LIFETIME,
    ) -> None:
        self._holder = holder
        self._validator = validator
        self._metrics = metrics
        self._control_ns = control_ns
        self._trust_domain = trust_domain
        self._clock = clock
        self._lifetime = lifetime
        # Signing is CPU work on the event loop: bound how much of it is in flight.
        self._slots = asyncio.Semaphore(concurrency)

    async def Certify(
        self,
        request: identity_pb2.CertifyRequest,
        context: grpc.aio.ServicerContext[
            identity_pb2.CertifyRequest, identity_pb2.CertifyResponse
        ],
    ) -> identity_pb2.CertifyResponse:
        try:
            async with self._slots:
                response = await self._certify(request)
            self._metrics.handled.observe("unary", "Certify", grpc.StatusCode.OK)
            return response
        except CertifyError as exc:
            self._metrics.handled.observe("unary", "Certify", exc.code)
            log.info("refused certification of %.300r: %s", request.identity, exc.message)
            await context.abort(exc.code, exc.message)
            raise  # abort() raises; this keeps the control flow explicit

    async def _certify(self, request: identity_pb2.CertifyRequest) -> identity_pb2.CertifyResponse:
        issuer = self._holder.issuer
        if issuer is None:
            raise CertifyError(grpc.StatusCode.UNAVAILABLE, "issuer not loaded yet")
        identity = request.identity
        csr.check_fields(identity, request.token, request.certificate_signing_request)
        try:
            token = request.token.decode("ascii")
        except UnicodeDecodeError:
            raise CertifyError(
                grpc.StatusCode.INVALID_ARGUMENT, "token is not an ASCII JWT"
            ) from None
        public_key = csr.check_csr(identity, request.certificate_signing_request)
        account = await self._validator.validate(token)
        proven = wellknown.identity_name(
            account.name, account.namespace, self._control_ns, self._trust_domain
        )
        if proven != identity:
            raise CertifyError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"token proves {proven}, not the requested identity",
            )
        leaf = issue_leaf(issuer, public_key, identity, self._clock(), self._lifetime)
        valid_until = Timestamp()
        valid_until.FromDatetime(leaf.not_after)
        return identity_pb2.CertifyResponse(
            leaf_certificate=leaf.der,
            intermediate_certificates=issuer.chain_der,
            valid_until=valid_until,
        )
