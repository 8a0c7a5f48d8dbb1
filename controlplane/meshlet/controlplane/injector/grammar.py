"""The value grammars of the injector's settings: port lists, quantities, durations, images.

Each parser returns the value as it is written into the pod (normalized) or raises ValueError
saying what was expected. Port lists use the one port-list grammar (`meshlet.api.ports`), which
meshlet-init and the proxy read too, so a list the injector accepts is one they accept.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Final

from meshlet.api import wellknown
from meshlet.api.durations import parse_duration
from meshlet.api.ports import parse_ports

_QUANTITY: Final = re.compile(r"(\d+(\.\d+)?|\.\d+)(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?")
# registry/path[:tag][@digest]: no spaces or control characters, bounded length
_IMAGE: Final = re.compile(r"[a-z0-9][a-zA-Z0-9._/:@+-]{0,511}")
_TRUE: Final = frozenset({"true", "enabled", "1", "yes"})
_FALSE: Final = frozenset({"false", "disabled", "0", "no"})


def ports(text: str) -> str:
    """`" 25, 587,4000-4010"` → `"25,587,4000-4010"`; empty stays empty; ValueError names every
    bad item."""
    return str(parse_ports(text))


def quantity(text: str) -> str:
    """A Kubernetes resource quantity such as `100m`, `0.5`, `64Mi`."""
    value = text.strip()
    if not _QUANTITY.fullmatch(value):
        raise ValueError("expected a quantity such as 100m, 1, 64Mi or 1Gi")
    return value


def duration(text: str) -> str:
    """A proxy duration: `500ms`, `10s`, `2m`, `1h` (the proxy's own grammar)."""
    value = text.strip()
    parse_duration(value)
    return value


def log_level(text: str) -> str:
    value = text.strip().lower()
    if value not in wellknown.PROXY_LOG_LEVELS:
        raise ValueError("expected one of " + ", ".join(wellknown.PROXY_LOG_LEVELS))
    return value


def image(text: str) -> str:
    value = text.strip()
    if not _IMAGE.fullmatch(value):
        raise ValueError("expected an image reference such as ghcr.io/meshlet/proxy:0.1.0")
    return value


def inbound_policy(text: str) -> str:
    """One of Linkerd's default inbound policies (`wellknown.DEFAULT_INBOUND_POLICIES`)."""
    value = text.strip()
    if value not in wellknown.DEFAULT_INBOUND_POLICIES:
        raise ValueError("expected one of " + ", ".join(wellknown.DEFAULT_INBOUND_POLICIES))
    return value


def networks(text: str) -> str:
    """`"10.0.0.0/8, fd00::/8"` → `"10.0.0.0/8,fd00::/8"`: at least one CIDR, no host bits set;
    ValueError names every bad item."""
    items = [item.strip() for item in text.split(",")]
    bad = []
    for item in items:
        try:
            ipaddress.ip_network(item)
        except ValueError:
            bad.append(item[:40])
    if bad:
        raise ValueError("expected CIDRs such as 10.0.0.0/8,fd00::/8; not " + ", ".join(
            repr(b) for b in bad))  # fmt: skip
    return ",".join(items)


def flag(text: str) -> bool:
    value = text.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError("expected true or false")


DNS_LABEL: Final = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


def keyword(text: str) -> str:
    """A keyword (`apache`, `reject`), stripped and lower-cased: the proxy's loader checks it."""
    return text.strip().lower()


def url(text: str) -> str:
    """A URL, stripped (the proxy's loader checks it)."""
    return text.strip()
