"""Trace context: reading W3C `traceparent` and B3 (`x-b3-*`, `b3`) headers, and continuing a
sampled trace with a span of the proxy's own (sans-IO; the export is in `export.py`).

Headers pass through every engine unchanged. Only when the workload has a collector and a
request is sampled does the proxy join the trace, as linkerd2-proxy does with tracing on: its
span's parent is the incoming span id, and the request goes on with the proxy's span id in
place of the caller's (`traceparent`'s parent-id; for B3, `x-b3-spanid` with the caller's as
`x-b3-parentspanid`, or the single `b3` header rewritten the same way).
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Iterable
from typing import Final, NamedTuple

from meshlet.proxy.core.header_modifier import HeaderModifier

Header = tuple[bytes, bytes]

TRACEPARENT: Final = b"traceparent"
B3: Final = b"b3"
B3_TRACE_ID: Final = b"x-b3-traceid"
B3_SPAN_ID: Final = b"x-b3-spanid"
B3_PARENT_ID: Final = b"x-b3-parentspanid"
B3_SAMPLED: Final = b"x-b3-sampled"
B3_FLAGS: Final = b"x-b3-flags"

_TRACEPARENT: Final = re.compile(rb"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
_HEX_ID: Final = re.compile(rb"[0-9a-f]{16}|[0-9a-f]{32}")
_ZERO: Final = frozenset({b"0" * 16, b"0" * 32})


class Kind:
    W3C: Final = "w3c"
    B3_MULTI: Final = "b3-multi"
    B3_SINGLE: Final = "b3-single"


class TraceContext(NamedTuple):
    """The caller's place in a trace: ids in lowercase hex (a 64-bit B3 trace id is padded to
    128 bits on export)."""

    kind: str
    trace_id: str
    span_id: str
    sampled: bool
    rest: bytes = b""  # traceparent: its version; b3 single: its parent-id part, dropped


def _find(headers: Iterable[Header]) -> dict[bytes, bytes]:
    wanted = (TRACEPARENT, B3, B3_TRACE_ID, B3_SPAN_ID, B3_SAMPLED, B3_FLAGS)
    found: dict[bytes, bytes] = {}
    for name, value in headers:
        lower = name.lower()
        if lower in wanted and lower not in found:
            found[lower] = value.strip()
    return found


def parse(headers: Iterable[Header]) -> TraceContext | None:
    """The incoming trace context (W3C first, then B3 multi, then B3 single); None when there
    is none or it is malformed (then nothing is exported and the headers pass as they are)."""
    found = _find(headers)
    parent = found.get(TRACEPARENT)
    if parent is not None:
        match = _TRACEPARENT.fullmatch(parent.lower())
        if match is None or match[1] == b"ff" or match[2] in _ZERO or match[3] in _ZERO:
            return None
        sampled = bool(int(match[4], 16) & 1)
        return TraceContext(Kind.W3C, match[2].decode(), match[3].decode(), sampled, match[1])
    trace_id, span_id = found.get(B3_TRACE_ID), found.get(B3_SPAN_ID)
    if trace_id is not None and span_id is not None:
        trace_id, span_id = trace_id.lower(), span_id.lower()
        if not (_HEX_ID.fullmatch(trace_id) and _HEX_ID.fullmatch(span_id)) or len(span_id) != 16:
            return None
        sampled = found.get(B3_SAMPLED) in (b"1", b"true") or found.get(B3_FLAGS) == b"1"
        return TraceContext(Kind.B3_MULTI, trace_id.decode(), span_id.decode(), sampled)
    single = found.get(B3)
    if single is not None:
        parts = single.lower().split(b"-")
        if len(parts) < 2 or not _HEX_ID.fullmatch(parts[0]) or len(parts[1]) != 16:
            return None
        if not _HEX_ID.fullmatch(parts[1]):
            return None
        sampled = len(parts) > 2 and parts[2] in (b"1", b"d")
        return TraceContext(Kind.B3_SINGLE, parts[0].decode(), parts[1].decode(), sampled)
    return None


def trace_id_of(headers: Iterable[Header]) -> str:
    """The trace id an access log shows: the trace context's, else `x-request-id`, else
    `x-amzn-trace-id` (Linkerd's order after B3); "" when none."""
    context = parse(headers)
    if context is not None:
        return context.trace_id
    for name, value in headers:
        if name.lower() in (b"x-request-id", b"x-amzn-trace-id"):
            return value.decode("latin-1")
    return ""


def new_span_id() -> str:
    return secrets.token_hex(8)


def continued(context: TraceContext, span_id: str) -> HeaderModifier:
    """The change that makes the forwarded request a child of the proxy's span `span_id`."""
    if context.kind == Kind.W3C:
        value = b"%s-%s-%s-01" % (context.rest, context.trace_id.encode(), span_id.encode())
        return HeaderModifier(frozenset({TRACEPARENT}), ((TRACEPARENT, value),))
    if context.kind == Kind.B3_MULTI:
        return HeaderModifier(
            frozenset({B3_SPAN_ID, B3_PARENT_ID}),
            ((B3_SPAN_ID, span_id.encode()), (B3_PARENT_ID, context.span_id.encode())),
        )
    value = b"%s-%s-1-%s" % (context.trace_id.encode(), span_id.encode(), context.span_id.encode())
    return HeaderModifier(frozenset({B3}), ((B3, value),))
