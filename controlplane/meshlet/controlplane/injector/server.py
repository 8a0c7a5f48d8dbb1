"""Runs the injector: the HTTPS webhook, its certificate reloads and the admin server."""

from __future__ import annotations

import asyncio
import logging
import ssl
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest

from meshlet.api import bundle
from meshlet.api.admin import AdminServer
from meshlet.api.hostport import HostPort
from meshlet.controlplane.cli import serve_until_signalled
from meshlet.controlplane.injector.config import InjectConfig
from meshlet.controlplane.injector.namespaces import Namespaces
from meshlet.controlplane.injector.trustroots import CopyError, TrustRootsCopies
from meshlet.controlplane.injector.webhook import InjectorMetrics, Webhook
from meshlet.controlplane.listen import ListenError, bind, start_admin
from meshlet.controlplane.supervise import Supervisor

log = logging.getLogger(__name__)

CERT_CHECK_SECONDS = 10.0


@dataclass(frozen=True, slots=True)
class InjectorConfig:
    addr: HostPort
    admin_addr: HostPort
    tls_cert: Path
    tls_key: Path
    inject: InjectConfig
    kube_api: Any | None  # a kubernetes ApiClient: namespace annotations are read with it
    answer_within: float = 8.0
    trust_anchors: Path | None = None  # re-read: pods admitted after a change get the new bundle
    reload_interval: float = CERT_CHECK_SECONDS


def server_context(cert: Path, key: Path) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2  # the API server speaks 1.2 and 1.3
    context.load_cert_chain(cert, key)
    return context


class InjectorServer:
    def __init__(self, config: InjectorConfig, registry: CollectorRegistry | None = None) -> None:
        self.config = config
        self.registry = registry or CollectorRegistry()
        namespaces = Namespaces(config.kube_api) if config.kube_api is not None else None
        self.copies = TrustRootsCopies(config.kube_api) if config.kube_api is not None else None
        self.webhook = Webhook(
            config.inject,
            namespaces.annotations if namespaces is not None else None,
            InjectorMetrics(self.registry),
            config.answer_within,
            copies=self.copies,
        )
        self._context = server_context(config.tls_cert, config.tls_key)
        self._stamp = self._cert_stamp()
        self._runner: web.AppRunner | None = None
        self._admin = AdminServer(partial(generate_latest, self.registry), ready=self.ready)
        self.supervisor = Supervisor("injector")
        self.supervisor.add("the webhook certificate watch", self._watch_certificate)
        if config.trust_anchors is not None:
            self.supervisor.add("the trust anchors watch", self._watch_anchors)
        self._supervising: asyncio.Task[None] | None = None
        self.port = 0
        self.admin_port = 0

    def ready(self) -> bool:
        """Serving HTTPS, its certificate watch running."""
        return self.port != 0 and self.supervisor.healthy

    def _cert_stamp(self) -> tuple[float, float]:
        return self.config.tls_cert.stat().st_mtime, self.config.tls_key.stat().st_mtime

    async def start(self) -> None:
        cfg = self.config
        self.admin_port = await start_admin(self._admin, cfg.admin_addr)
        try:
            sock = bind(cfg.addr, "webhook")
        except ListenError:
            await self._admin.close()
            raise
        self._runner = web.AppRunner(self.webhook.app(), access_log=None, handle_signals=False)
        await self._runner.setup()
        await web.SockSite(self._runner, sock, ssl_context=self._context).start()
        self.port = int(sock.getsockname()[1])
        self._supervising = asyncio.create_task(self.supervisor.run())
        log.info("injector serving HTTPS on :%d (admin :%d)", self.port, self.admin_port)

    async def _watch_certificate(self) -> None:
        """A rotated Secret shows up as new files; new connections get the new certificate."""
        while True:
            await asyncio.sleep(self.config.reload_interval)
            try:
                stamp = self._cert_stamp()
                if stamp != self._stamp:
                    self._context.load_cert_chain(self.config.tls_cert, self.config.tls_key)
                    self._stamp = stamp
                    log.info("webhook certificate reloaded")
            except (OSError, ssl.SSLError) as exc:
                log.error("webhook certificate not reloaded: %s", exc)

    async def _watch_anchors(self) -> None:
        """The trust-roots ConfigMap changed (a step of a rotation, docs/identity.md): pods
        admitted from now on get the new bundle. One that is not a bundle keeps the anchors in
        force."""
        path = self.config.trust_anchors
        assert path is not None
        refused = None
        await self._refresh_copies()  # what changed while no injector ran
        while True:
            await asyncio.sleep(self.config.reload_interval)
            try:
                text = path.read_text()
            except (OSError, UnicodeDecodeError) as exc:
                log.error("trust anchors not re-read from %s: %s", path, exc)
                continue
            if text in (self.webhook.config.trust_anchors_pem, refused):
                continue
            why = bundle.problem(text)
            if why is not None:
                refused = text
                log.error("trust anchors in %s not taken: %s; pods get the anchors in force",
                          path, why)  # fmt: skip
                continue
            self.webhook.config = replace(self.webhook.config, trust_anchors_pem=text)
            log.info("trust anchors reloaded from %s: pods admitted from now on get %d anchor(s)",
                     path, bundle.count(text))  # fmt: skip
            await self._refresh_copies()

    async def _refresh_copies(self) -> None:
        """Every namespace's copy of the bundle brought up to date (proxies there follow it)."""
        if self.copies is None:
            return
        try:
            rewritten = await asyncio.to_thread(self.copies.refresh,
                                                self.webhook.config.trust_anchors_pem)  # fmt: skip
        except CopyError as exc:
            log.error("trust roots' copies not brought up to date: %s", exc)
            return
        if rewritten:
            log.info("trust roots brought up to date in %d namespace(s)", rewritten)

    async def stop(self) -> None:
        self.supervisor.stop()
        if self._supervising is not None:
            self._supervising.cancel()
            await asyncio.gather(self._supervising, return_exceptions=True)
        if self._runner is not None:
            await self._runner.cleanup()
        await self._admin.close()


async def serve(config: InjectorConfig) -> int:
    """Serves until SIGTERM or SIGINT (0), or until its certificate watch fails for good (1)."""
    return await serve_until_signalled(InjectorServer(config), "injector")
