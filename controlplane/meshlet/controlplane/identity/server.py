"""Runs the identity service: issuer reloads, the TLS gRPC server and the admin server."""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, generate_latest

from meshlet.api import identity_pb2_grpc, wellknown
from meshlet.api.admin import AdminServer
from meshlet.api.hostport import HostPort
from meshlet.controlplane.cli import serve_until_signalled
from meshlet.controlplane.identity.ca import Issuer
from meshlet.controlplane.identity.service import (
    Clock,
    IdentityMetrics,
    IdentityService,
    utcnow,
)
from meshlet.controlplane.identity.serving import ServingCertificate
from meshlet.controlplane.identity.signer import LEAF_LIFETIME
from meshlet.controlplane.identity.source import (
    FileIssuerSource,
    IssuerHolder,
    IssuerSource,
    KubernetesIssuerSource,
)
from meshlet.controlplane.identity.tokens import TokenReviewer, TokensFile, TokenValidator
from meshlet.controlplane.listen import ListenError, add_grpc_port, check_free, start_admin
from meshlet.controlplane.supervise import Supervisor

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 * 1024  # a CertifyRequest is a few KiB; larger ones are refused by grpc


@dataclass(frozen=True, slots=True)
class IdentityConfig:
    addr: HostPort
    admin_addr: HostPort
    trust_anchors: Path | None
    issuer_dir: Path | None
    tokens_file: Path | None
    kube_api: Any | None  # a kubernetes ApiClient when Kubernetes is used
    control_ns: str = wellknown.CONTROL_PLANE_NAMESPACE
    trust_domain: str = wellknown.TRUST_DOMAIN
    reload_interval: float = 5.0
    issuance_lifetime: dt.timedelta = LEAF_LIFETIME  # of the leaves it signs (plus clock skew)
    issuer_scheme: str = wellknown.ISSUER_SCHEME_MESHLET  # which keys hold the issuer


class IdentityServer:
    """The running service; `start()` binds, `stop()` drains."""

    def __init__(
        self,
        config: IdentityConfig,
        registry: CollectorRegistry | None = None,
        clock: Clock = utcnow,
    ) -> None:
        self.config = config
        self._clock = clock
        self.registry = registry or CollectorRegistry()
        self.metrics = IdentityMetrics(self.registry)
        self.serving = ServingCertificate(
            wellknown.identity_name(
                "meshlet-identity", config.control_ns, config.control_ns, config.trust_domain
            )
        )
        self.holder = IssuerHolder(_issuer_source(config), self._issuer_changed)
        self.grpc_port = 0
        self.admin_port = 0
        self._grpc: grpc.aio.Server | None = None
        self._admin = AdminServer(partial(generate_latest, self.registry), ready=self.ready)
        self.supervisor = Supervisor("identity")
        self.supervisor.add("the issuer watch", partial(self.holder.watch, config.reload_interval))
        self.supervisor.add("the serving certificate renewal", self._renew_serving)
        self._supervising: asyncio.Task[None] | None = None

    def ready(self) -> bool:
        """Serving gRPC with a loaded issuer, its issuer watch and renewal running."""
        return self.grpc_port != 0 and self.holder.issuer is not None and self.supervisor.healthy

    def _issuer_changed(self, issuer: Issuer) -> None:
        self.metrics.issuer_loaded(issuer)
        self.serving.issue(issuer, utcnow())

    async def start(self) -> None:
        """Serves admin at once; gRPC once an issuer is loaded (TLS needs it)."""
        cfg = self.config
        check_free(cfg.addr, "gRPC")  # before waiting for an issuer: it may take a while
        self.admin_port = await start_admin(self._admin, cfg.admin_addr)
        while not await asyncio.to_thread(self.holder.reload):
            log.warning("waiting for a usable issuer: %s", self.holder.last_error)
            await asyncio.sleep(cfg.reload_interval)
        service = IdentityService(
            self.holder,
            _token_validator(cfg),
            self.metrics,
            control_ns=cfg.control_ns,
            trust_domain=cfg.trust_domain,
            clock=self._clock,
            lifetime=cfg.issuance_lifetime,
        )
        self._grpc = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_concurrent_streams", 100),
                ("grpc.so_reuseport", 0),  # a port in use is an error, not a shared port
            ],
            maximum_concurrent_rpcs=1000,
        )
        identity_pb2_grpc.add_IdentityServicer_to_server(service, self._grpc)
        try:
            self.grpc_port = add_grpc_port(self._grpc, cfg.addr, self.serving.credentials())
        except ListenError:
            await self.stop(grace=0)
            raise
        await self._grpc.start()
        self._supervising = asyncio.create_task(self.supervisor.run())
        log.info("identity serving on :%d (admin :%d)", self.grpc_port, self.admin_port)

    async def _renew_serving(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            issuer = self.holder.issuer
            if issuer is not None and self.serving.due(utcnow()):
                self.serving.issue(issuer, utcnow())

    async def stop(self, grace: float = 5.0) -> None:
        self.supervisor.stop()
        if self._supervising is not None:
            self._supervising.cancel()
            await asyncio.gather(self._supervising, return_exceptions=True)
        if self._grpc is not None:
            await self._grpc.stop(grace)
        await self._admin.close()


def _issuer_source(cfg: IdentityConfig) -> IssuerSource:
    if cfg.issuer_dir is not None:
        if cfg.trust_anchors is None:
            raise ValueError("--issuer-dir needs --trust-anchors")
        return FileIssuerSource(cfg.issuer_dir, cfg.trust_anchors, cfg.issuer_scheme)
    if cfg.kube_api is None:
        raise ValueError("give --issuer-dir, or Kubernetes access to read the issuer Secret")
    return KubernetesIssuerSource(cfg.kube_api, cfg.control_ns, cfg.trust_anchors,
                                  cfg.issuer_scheme)  # fmt: skip


def _token_validator(cfg: IdentityConfig) -> TokenValidator:
    if cfg.tokens_file is not None:
        return TokensFile(cfg.tokens_file)
    if cfg.kube_api is None:
        raise ValueError("give --tokens-file, or Kubernetes access for TokenReview")
    return TokenReviewer(cfg.kube_api)


async def serve(config: IdentityConfig) -> int:
    """Serves until SIGTERM or SIGINT (0), or until a background task fails for good (1)."""
    return await serve_until_signalled(IdentityServer(config), "identity")
