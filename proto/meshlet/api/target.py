"""One request, one meaning: the request target the proxy routes, authorizes and forwards (pure).

An HTTP server does not see `/%61dmin`, `/./admin`, `//admin` or `admin.store.` as the bytes
on the wire: it decodes, resolves and folds them into `/admin` and `admin.store`. A proxy that
routes and authorizes on the raw spelling while the app serves the folded one can be walked
past a private route (Envoy's CVE-2019-9901 and CVE-2021-32779). So both engines pass every
request target through here once, before anything reads it, and forward what comes out:
routes, authorization, metrics, tap and the app all see the same path and host. A route's
Exact or PathPrefix value is held to the same form (`normal_path_match`): the policy controller
and the webhook refuse one that is not, and a proxy normalizes what a controller sends, so a
route always names the paths requests are routed on.

The path (RFC 3986 §6.2.2, as Envoy's `normalize_path` and `merge_slashes`):
  - a percent-encoded unreserved character (`ALPHA DIGIT - . _ ~`) is decoded: `%61` → `a`;
    any other percent-encoding keeps its meaning and gets upper-case hex: `%3a` → `%3A`;
    a `%` not followed by two hex digits is refused;
  - an encoded slash or backslash (`%2F`, `%5C`) is refused, kept or decoded as the proxy is
    configured (`EscapedSlashes`, Envoy's `path_with_escaped_slashes_action`): decoding one
    makes a separator of it before the next two steps;
  - dot segments are resolved (`/a/./b/../c` → `/a/c`; never above the root) and empty
    segments merged (`//admin` → `/admin`), a trailing slash kept;
  - a fragment (`#...`) is refused: a request target never carries one (RFC 9112 §3.2, RFC
    9113 §8.3.1), and servers differ on whether they cut it.
The query is left as it is. Paths stay case-sensitive, as Gateway API's matches are.

The host (RFC 3986 §6.2.2.1, §3.2.2): lower-cased, one trailing dot removed (`admin.store.`
names the same host as `admin.store` to DNS, and to nginx's server names); anything that is not
a DNS-style name, an IPv4 address or a bracketed IPv6 address, with an optional port, is
refused: no percent-encoding, brackets around a name, empty labels or control bytes.
"""

from __future__ import annotations

import enum
import ipaddress
import re
from dataclasses import dataclass
from typing import Final

from meshlet.api import wellknown


class EscapedSlashes(enum.Enum):
    """What a path's `%2F` and `%5C` become. Requests to a pod follow its proxy's
    MESHLET_PROXY_INBOUND_HTTP_ESCAPED_SLASHES (REJECT by default: nginx and many frameworks
    decode `%2F` before they route, so `/admin%2Fx` or `/x/..%2Fadmin` would be one path to the
    proxy and `/admin/x` or `/admin` to the app); outbound requests KEEP theirs for the server's
    proxy to judge."""

    KEEP = "keep"  # left encoded: the app decides (Envoy's KEEP_UNCHANGED)
    REJECT = "reject"  # the request is refused 400 (REJECT_REQUEST)
    DECODE = "decode"  # decoded to `/` and `\` before dot segments and routing


@dataclass(frozen=True, slots=True)
class Refused:
    """A target the proxy will not forward: answered 400 with `reason`."""

    reason: str


# What a target needs `normalize_target` for: a fragment, a percent-encoding, a dot or empty
# segment. A target in which this finds nothing is in its normal form (the engines test it
# inline: the common request pays one search).
MAY_CHANGE: Final = re.compile(rb"[#%]|/\.|//")
_UNRESERVED: Final = frozenset(
    b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~"
)
_HEX: Final = frozenset(b"0123456789ABCDEFabcdef")
_SLASHES: Final = frozenset(b"/\\")
FRAGMENT: Final = "a request target must not carry a fragment (#)"
_ENCODED_SLASH: Final = (
    "an encoded slash (%2F or %5C) in the path, which this workload's proxy refuses"
    f" (annotate it {wellknown.ESCAPED_SLASHES_ANNOTATION}: keep or decode to allow them)"
)

# A host already in its normal form: lower-case labels (RFC 1123, with `_` as many internal
# names have), an optional port below 10000. Anything else takes `normalize_host`'s slow path.
NORMAL_HOST: Final = re.compile(rb"[a-z0-9_\-]+(?:\.[a-z0-9_\-]+)*(?::[0-9]{1,4})?")
_NAME: Final = re.compile(rb"[A-Za-z0-9_\-]+(?:\.[A-Za-z0-9_\-]+)*\.?")
_PORT: Final = re.compile(rb"[0-9]{1,5}")
_MAX_PORT: Final = 65535


def normalize_target(target: bytes, slashes: EscapedSlashes) -> bytes | Refused:
    """The origin-form target (`/path?query`) the proxy forwards, or why it refuses it."""
    if target.find(b"#") >= 0:  # (`in` on bytes raises and clears a TypeError in CPython)
        return Refused(FRAGMENT)
    cut = target.find(b"?")
    path = target if cut < 0 else target[:cut]
    if MAY_CHANGE.search(path) is None:
        return target
    normal = normalize_path(path, slashes)
    if isinstance(normal, Refused) or cut < 0:
        return normal
    return normal + target[cut:]


def normalize_path(path: bytes, slashes: EscapedSlashes) -> bytes | Refused:
    """A path (`/` first, no query) in the normal form above."""
    if path.find(b"%") >= 0:
        decoded = _decode(path, slashes)
        if isinstance(decoded, Refused):
            return decoded
        path = decoded
    segments: list[bytes] = []
    trailing = False  # the path ends with a slash
    for segment in path.split(b"/")[1:]:
        if segment == b"..":
            if segments:
                segments.pop()
            trailing = True
        elif segment in (b".", b""):
            trailing = True
        else:
            segments.append(segment)
            trailing = False
    if not segments:
        return b"/"
    return b"/" + b"/".join(segments) + (b"/" if trailing else b"")


def _decode(path: bytes, slashes: EscapedSlashes) -> bytes | Refused:
    pieces = path.split(b"%")
    out = [pieces[0]]
    for piece in pieces[1:]:
        if len(piece) < 2 or piece[0] not in _HEX or piece[1] not in _HEX:
            return Refused("a path with a % that is not a percent-encoding (%XX)")
        code = int(piece[:2], 16)
        if code in _UNRESERVED:
            out.append(bytes((code,)))
        elif code in _SLASHES and slashes is not EscapedSlashes.KEEP:
            if slashes is EscapedSlashes.REJECT:
                return Refused(_ENCODED_SLASH)
            out.append(bytes((code,)))
        else:
            out.append(b"%%%02X" % code)
        out.append(piece[2:])
    return b"".join(out)


def normalize_host(authority: bytes) -> bytes | None:
    """`host[:port]` lower-cased, one trailing dot removed; None when it is not a host."""
    if NORMAL_HOST.fullmatch(authority) is not None:
        return authority
    if authority[:1] == b"[":
        end = authority.find(b"]")
        if end < 0:
            return None
        host, rest = authority[1:end], authority[end + 1 :]
        if b"%" in host:  # a zone: meaningless to any other host
            return None
        try:
            address = ipaddress.IPv6Address(host.decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            return None
        host = b"[" + address.compressed.encode() + b"]"
    else:
        host, colon, port = authority.partition(b":")
        rest = colon + port
        if _NAME.fullmatch(host) is None:
            return None
        host = host.lower()
        if host.endswith(b"."):
            host = host[:-1]
    if rest:
        port = rest[1:]
        if rest[:1] != b":" or _PORT.fullmatch(port) is None or int(port) > _MAX_PORT:
            return None
    normal = host + rest
    return authority if normal == authority else normal  # the same object: nothing changed


def normal_path_match(value: str) -> str | Refused:
    """A route's Exact or PathPrefix value in the form requests are routed on (encoded slashes
    kept, as a route names them), or why it can never match a request."""
    try:
        raw = value.encode("ascii")
    except UnicodeEncodeError:
        return Refused("not ASCII: percent-encode it (as UTF-8), as requests carry it")
    if not raw.startswith(b"/"):
        return Refused("not an absolute path; start it with '/'")
    if b"?" in raw:
        return Refused("a path match carries no query (?); match queryParams instead")
    normal = normalize_target(raw, EscapedSlashes.KEEP)
    return normal if isinstance(normal, Refused) else normal.decode("ascii")
