"""A bundle of trust anchors (PEM certificates), as the proxy, the injector and the identity
service read it: one check of whether a text is one, with the `ssl` module alone (the proxy
never imports `cryptography`)."""

from __future__ import annotations

import ssl
from typing import Final

PEM_BEGIN: Final = "-----BEGIN CERTIFICATE-----"


def problem(pem: str) -> str | None:
    """Why `pem` is not a bundle of trust anchors; None when it is."""
    if PEM_BEGIN not in pem:
        return "no PEM certificate in it"
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cadata=pem)
    except (ssl.SSLError, ValueError) as exc:
        return f"not a bundle of PEM certificates ({exc})"
    return None


def count(pem: str) -> int:
    """How many certificates the bundle holds."""
    return pem.count(PEM_BEGIN)
