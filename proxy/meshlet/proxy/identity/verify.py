"""Checks a certificate returned by the identity service before the proxy uses it, with `ssl` only.

The check is the proxy's own mesh handshake, run in memory: a server context holding the new
chain and our key, and a client context holding the same chain as its client certificate, both
built by `meshlet.proxy.tls.contexts` exactly as the proxy builds them, complete a TLS 1.3
handshake over `ssl.MemoryBIO`s (no sockets) with `server_hostname` = our identity. OpenSSL thereby
checks, in both directions (server and client purposes):

- that the chain matches our private key,
- that it chains to the trust anchors,
- that it is valid now (expired or not yet valid certificates are refused),
- that it is for our name (hostname check against the DNS SAN).

Then the leaf's DNS SANs must be exactly our name (no wildcard, no extra names) and its validity
must contain `now` as the caller's clock sees it. Anything else raises `Rejected` with a reason a
person can act on; the caller keeps its current certificate.
"""

from __future__ import annotations

import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from meshlet.proxy.tls import contexts

_MAX_ROUNDS: Final = 16  # a TLS 1.3 handshake with client certificates takes 3 flights


class Rejected(Exception):
    """A certificate that must not be used; `reason` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Validity:
    """The verified leaf's validity period (Unix times)."""

    not_before: float
    not_after: float


def verify(chain: Path, key: Path, trust_anchors_pem: str, name: str, now: float) -> Validity:
    """Checks the PEM chain file `chain` (leaf first) for the identity `name` against the
    anchors, with `key`; returns the leaf's validity or raises `Rejected`."""
    try:
        server = contexts.server_context(chain, key, trust_anchors_pem, require_client_cert=True)
        client = contexts.client_context(chain, key, trust_anchors_pem)
    except ssl.SSLError as exc:
        if "KEY_VALUES_MISMATCH" in str(exc):
            raise Rejected("the certificate is not for our private key") from exc
        raise Rejected(f"the chain cannot be loaded: {exc}") from exc
    peer = _handshake(client, server, name)
    dns_names = tuple(str(value) for kind, value in peer.get("subjectAltName", ()) if kind == "DNS")
    if dns_names != (name,):
        raise Rejected(f"the certificate names {list(dns_names)}, not exactly {name!r}")
    validity = Validity(
        not_before=float(ssl.cert_time_to_seconds(str(peer["notBefore"]))),
        not_after=float(ssl.cert_time_to_seconds(str(peer["notAfter"]))),
    )
    check_validity(validity, now)
    return validity


def check_validity(validity: Validity, now: float) -> None:
    """Raises `Rejected` unless not_before <= now < not_after."""
    if now >= validity.not_after:
        raise Rejected(f"the certificate expired at {validity.not_after:.0f} (now {now:.0f})")
    if now < validity.not_before:
        raise Rejected(
            f"the certificate is not valid before {validity.not_before:.0f} (now {now:.0f});"
            " check the clocks of this node and of the identity service"
        )


def _handshake(
    client_context: ssl.SSLContext, server_context: ssl.SSLContext, name: str
) -> Mapping[str, Any]:
    """Runs a handshake between the two contexts in memory; the client's view of the server's
    (verified) certificate."""
    to_server, from_client = ssl.MemoryBIO(), ssl.MemoryBIO()
    to_client, from_server = ssl.MemoryBIO(), ssl.MemoryBIO()
    client = client_context.wrap_bio(to_client, from_client, server_hostname=name)
    server = server_context.wrap_bio(to_server, from_server, server_side=True)
    pending = [("as a server certificate", client), ("as a client certificate", server)]
    for _ in range(_MAX_ROUNDS):
        for role, side in list(pending):
            try:
                side.do_handshake()
            except ssl.SSLWantReadError:
                continue
            except ssl.SSLCertVerificationError as exc:
                raise Rejected(f"{exc.verify_message} (checked {role})") from exc
            except ssl.SSLError as exc:
                raise Rejected(f"the handshake failed {role}: {exc}") from exc
            pending.remove((role, side))
        to_server.write(from_client.read())
        to_client.write(from_server.read())
        if not pending:
            peer = client.getpeercert()
            if not peer:
                raise Rejected("the server side presented no certificate")
            return peer
    raise Rejected("the handshake did not complete")
