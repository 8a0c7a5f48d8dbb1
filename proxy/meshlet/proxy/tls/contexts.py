"""`ssl.SSLContext` factories: TLS 1.3 only, the issued chain, the trust anchors.

Python's `ssl` loads keys and certificates only from files, so the chain is written next to the
key in the proxy's private, memory-backed identity directory.
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from meshlet.api import wellknown

CHAIN_FILE: Final = "chain.pem"
MESH_ALPN: Final = (wellknown.TRANSPORT_ALPN,)


def write_chain(directory: Path, leaf_der: bytes, intermediates_der: Sequence[bytes]) -> Path:
    """Writes leaf + intermediates as PEM (atomically, mode 0600) and returns the path."""
    pem = "".join(ssl.DER_cert_to_PEM_cert(der) for der in (leaf_der, *intermediates_der))
    path = directory / CHAIN_FILE
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(pem)
    os.replace(tmp, path)
    return path


def _tls13(purpose: ssl.Purpose) -> ssl.SSLContext:
    context = ssl.SSLContext(
        ssl.PROTOCOL_TLS_SERVER if purpose is ssl.Purpose.CLIENT_AUTH else ssl.PROTOCOL_TLS_CLIENT
    )
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    return context


def server_context(
    chain: Path,
    key: Path,
    trust_anchors_pem: str,
    *,
    require_client_cert: bool,
    alpn: Sequence[str] = MESH_ALPN,
) -> ssl.SSLContext:
    """Serves our identity; verifies a client certificate against the anchors when one is sent
    (and demands one when `require_client_cert`)."""
    context = _tls13(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(chain, key)
    context.load_verify_locations(cadata=trust_anchors_pem)
    context.verify_mode = ssl.CERT_REQUIRED if require_client_cert else ssl.CERT_OPTIONAL
    if alpn:
        context.set_alpn_protocols(list(alpn))
    return context


def control_server_context(chain: Path, key: Path, trust_anchors_pem: str) -> ssl.SSLContext:
    """For the control port (tap), which any pod can reach: our identity, ALPN h2, and a
    client certificate required and verified against the anchors (a client without one
    fails the handshake)."""
    return server_context(chain, key, trust_anchors_pem, require_client_cert=True, alpn=("h2",))


def direct_server_context(chain: Path, key: Path, trust_anchors_pem: str) -> ssl.SSLContext:
    """For TLS addressed to our identity on one of the pod's ports, as a proxy sends to a meshed
    controller (gRPC, server-verified): our identity, ALPN h2 or http/1.1, a client certificate
    verified against the anchors when one is sent."""
    return server_context(chain, key, trust_anchors_pem, require_client_cert=False,
                          alpn=("h2", "http/1.1"))  # fmt: skip


def client_context(
    chain: Path | None,
    key: Path | None,
    trust_anchors_pem: str,
    *,
    alpn: Sequence[str] = MESH_ALPN,
) -> ssl.SSLContext:
    """Verifies the server against the anchors and by name (the SNI, our peer's identity);
    presents our certificate when we have one."""
    context = _tls13(ssl.Purpose.SERVER_AUTH)
    context.load_verify_locations(cadata=trust_anchors_pem)
    context.check_hostname = True
    context.verify_mode = ssl.CERT_REQUIRED
    if chain is not None and key is not None:
        context.load_cert_chain(chain, key)
    if alpn:
        context.set_alpn_protocols(list(alpn))
    return context


def control_client_context(trust_anchors_pem: str) -> ssl.SSLContext:
    """For gRPC to the control plane: anchors only, ALPN h2."""
    return client_context(None, None, trust_anchors_pem, alpn=("h2",))


def peer_identity(sock: ssl.SSLObject | ssl.SSLSocket) -> str | None:
    """The DNS SAN of a verified peer certificate, or None."""
    return cert_identity(sock.getpeercert())


def cert_identity(cert: Mapping[str, Any] | None) -> str | None:
    """The DNS SAN of a verified certificate as `getpeercert()` gives it, or None."""
    if not cert:
        return None
    for entry in cert.get("subjectAltName", ()):
        if isinstance(entry, tuple) and entry[0] == "DNS":
            return str(entry[1])
    return None
