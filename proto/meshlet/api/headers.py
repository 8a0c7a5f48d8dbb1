"""Which headers a route's header modifier (RequestHeaderModifier; ResponseHeaderModifier likewise)
may change, and what a valid header name and value are.

One definition for both ends: the policy controller's validation refuses a route that breaks
these rules, so a user learns at `kubectl apply`; the proxy's policy decoder refuses a message
that carries one anyway, so no policy can make a proxy apply it.

Refused names, whatever their case:
- pseudo-headers (`:authority`, `:path`, …): the request's target, which routing already read;
- `meshlet-*` and `l5d-*`: the proxy's own (`meshlet-client-id`, the identity it vouches for
  after verifying the client's certificate; `meshlet-proxy-error`; Linkerd's names for them),
  and any it may use later;
- `host`, `content-length`, `transfer-encoding` and the hop-by-hop headers: they frame or route
  the message, and the proxy writes them itself.
"""

from __future__ import annotations

import re
from typing import Final

MAX_NAME_LENGTH: Final = 256
MAX_VALUE_LENGTH: Final = 4096

RESERVED_PREFIXES: Final = ("meshlet-", "l5d-")
RESERVED_NAMES: Final = frozenset(
    {
        "host",
        "content-length",
        "transfer-encoding",
        "connection",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "upgrade",
        "http2-settings",
    }
)

# RFC 9110 §5.6.2: a field name is a token.
_TOKEN: Final = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
# RFC 9110 §5.5: visible characters, spaces and tabs inside, obs-text; no CR, LF, NUL or other
# control character, and no whitespace at either end (HTTP/2 refuses it, RFC 9113 §8.2.1).
_BAD_VALUE: Final = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]|\A[ \t]|[ \t]\Z")


def name_problem(name: str) -> str | None:
    """Why a header modifier may not use `name`; None when it may."""
    if not name:
        return "an empty header name"
    if len(name) > MAX_NAME_LENGTH:
        return f"a header name longer than {MAX_NAME_LENGTH} characters"
    shown = repr(name[:64])
    if name.startswith(":"):
        return f"{shown} is a pseudo-header: the request's target is not a header to modify"
    if _TOKEN.fullmatch(name) is None:
        return f"{shown} is not a valid header name (letters, digits and !#$%&'*+-.^_`|~ only)"
    lower = name.lower()
    if lower.startswith(RESERVED_PREFIXES):
        return (
            f"{shown} is reserved for the proxy (meshlet-* and l5d-* carry the client identity "
            "it verified and its own errors)"
        )
    if lower in RESERVED_NAMES:
        return f"{shown} frames or routes the message: only the proxy writes it"
    return None


def value_problem(value: bytes) -> str | None:
    """Why `value` is not a header value a modifier may write; None when it is."""
    if len(value) > MAX_VALUE_LENGTH:
        return f"a header value longer than {MAX_VALUE_LENGTH} bytes"
    if _BAD_VALUE.search(value) is not None:
        return (
            "a header value with a control character (CR, LF, NUL, …) or leading or trailing "
            "whitespace"
        )
    return None
