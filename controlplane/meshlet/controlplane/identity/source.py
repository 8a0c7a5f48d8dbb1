"""Where issuer material comes from (files or Kubernetes objects) and how it is hot-reloaded."""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from meshlet.api import wellknown
from meshlet.controlplane.identity.ca import Issuer, IssuerError, load_issuer

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class IssuerMaterial:
    cert_pem: bytes
    key_pem: bytes
    anchors_pem: bytes


class IssuerSource(Protocol):
    def read(self) -> IssuerMaterial:
        """The current material; OSError/IssuerError when it cannot be read."""
        ...


@dataclass(frozen=True, slots=True)
class FileIssuerSource:
    """`<issuer_dir>/crt.pem` and `key.pem` (or `tls.crt` and `tls.key`: the scheme
    `kubernetes.io/tls`, a mounted cert-manager Secret) and a trust anchors PEM file."""

    issuer_dir: Path
    anchors_file: Path
    scheme: str = wellknown.ISSUER_SCHEME_MESHLET

    def read(self) -> IssuerMaterial:
        cert, key = wellknown.ISSUER_KEYS[self.scheme]
        return IssuerMaterial(
            cert_pem=(self.issuer_dir / cert).read_bytes(),
            key_pem=(self.issuer_dir / key).read_bytes(),
            anchors_pem=self.anchors_file.read_bytes(),
        )


class KubernetesIssuerSource:
    """Secret `meshlet-identity-issuer` (its keys by the scheme: `crt.pem` and `key.pem`, or
    `tls.crt` and `tls.key` of a cert-manager Certificate's Secret) and ConfigMap
    `meshlet-identity-trust-roots`; a trust anchors file, when given, replaces the ConfigMap."""

    def __init__(
        self,
        api_client: Any,
        namespace: str,
        anchors_file: Path | None = None,
        scheme: str = wellknown.ISSUER_SCHEME_MESHLET,
    ) -> None:
        from kubernetes import client

        self._core = client.CoreV1Api(api_client)
        self._namespace = namespace
        self._anchors_file = anchors_file
        self._keys = wellknown.ISSUER_KEYS[scheme]

    def read(self) -> IssuerMaterial:
        import urllib3
        from kubernetes.client.exceptions import ApiException

        try:
            secret = self._core.read_namespaced_secret(
                wellknown.ISSUER_SECRET, self._namespace, _request_timeout=5
            )
            if self._anchors_file is not None:
                anchors = self._anchors_file.read_bytes()
            else:
                roots = self._core.read_namespaced_config_map(
                    wellknown.TRUST_ROOTS_CONFIGMAP, self._namespace, _request_timeout=5
                )
                anchors = (roots.data or {}).get(wellknown.TRUST_ROOTS_KEY, "").encode()
        except ApiException as exc:
            raise IssuerError(f"cannot read issuer objects: {exc.status} {exc.reason}") from exc
        except urllib3.exceptions.HTTPError as exc:  # unreachable: keep the issuer in force
            raise IssuerError(f"cannot reach the Kubernetes API server: {exc}") from exc
        data = secret.data or {}
        cert, key = self._keys
        try:
            return IssuerMaterial(
                cert_pem=base64.b64decode(data[cert]),
                key_pem=base64.b64decode(data[key]),
                anchors_pem=anchors,
            )
        except KeyError as exc:
            raise IssuerError(f"secret {wellknown.ISSUER_SECRET} lacks key {exc.args[0]}") from exc


class IssuerHolder:
    """The issuer in force. A reload that fails keeps the previous issuer."""

    def __init__(
        self, source: IssuerSource, on_change: Callable[[Issuer], None] | None = None
    ) -> None:
        self._source = source
        self._material: IssuerMaterial | None = None
        self._on_change = on_change
        self.issuer: Issuer | None = None
        self.last_error: str | None = None

    def reload(self) -> bool:
        """Reads the source; True when a new issuer came into force."""
        try:
            material = self._source.read()
            if material == self._material:
                return False
            issuer = load_issuer(material.cert_pem, material.key_pem, material.anchors_pem)
            now = dt.datetime.now(dt.UTC)
            if issuer.not_after <= now:
                raise IssuerError(
                    f"issuer chain expired at {issuer.not_after.isoformat()}; rotate the issuer"
                )
        except (OSError, IssuerError) as exc:
            if str(exc) != self.last_error:
                log.error("issuer not (re)loaded: %s", exc)
            self.last_error = str(exc)
            return False
        self._material = material
        self.issuer = issuer
        self.last_error = None
        log.info(
            "issuer %s loaded, valid until %s",
            issuer.cert.subject.rfc4514_string(),
            issuer.not_after.isoformat(),
        )
        if self._on_change is not None:
            self._on_change(issuer)
        return True

    async def watch(self, interval: float) -> None:
        """Re-reads the source every `interval` seconds, forever."""
        while True:
            await asyncio.sleep(interval)
            await asyncio.to_thread(self.reload)
