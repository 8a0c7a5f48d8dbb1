"""`meshlet viz tap`'s two halves: the tap controller's stream read line by line over HTTP
(the controller's API: `GET /api/v1/tap?…`, JSON lines), and each event written as
`linkerd viz tap` writes it (`req id=7:1 proxy=in src=… dst=… tls=true :method=GET …`)."""

from __future__ import annotations

import http.client
import json
import urllib.parse
from collections.abc import Iterator
from typing import Any, Final

PATH: Final = "/api/v1/tap"
MAX_LINE: Final = 1 << 20


class TapError(Exception):
    """The controller refused the tap or could not be reached; the message says why."""


def query(params: dict[str, str | None]) -> str:
    return PATH + "?" + urllib.parse.urlencode({k: v for k, v in params.items() if v})


def stream(
    host: str,
    port: int,
    path: str,
    timeout: float = 10.0,
    connection: http.client.HTTPConnection | None = None,
) -> Iterator[dict[str, Any]]:
    """The controller's objects, one a line, until it ends the stream (or `connection`, when
    the caller gives one, is shut down from another thread)."""
    if connection is None:
        connection = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        try:
            connection.request("GET", path, headers={"Accept": "application/x-ndjson"})
            sock = connection.sock
            response = connection.getresponse()
        except (OSError, http.client.HTTPException) as exc:
            raise TapError(f"cannot reach the tap controller at {host}:{port}: {exc}") from None
        if response.status != 200:
            body = response.read(MAX_LINE)
            try:
                message = json.loads(body)["message"]
            except (ValueError, KeyError, TypeError):
                message = body.decode(errors="replace").strip() or response.reason
            raise TapError(f"the tap controller refused the tap ({response.status}): {message}")
        if sock is not None:
            sock.settimeout(None)  # a quiet tap is not a dead one: Ctrl-C ends it
        while True:
            try:
                line = response.readline(MAX_LINE)
            except (OSError, http.client.HTTPException) as exc:
                raise TapError(f"the tap stream broke: {exc}") from None
            if not line:
                return
            try:
                yield json.loads(line)
            except ValueError:
                shown = line[:80]
                raise TapError(
                    f"the tap controller sent a line that is not JSON: {shown!r}"
                ) from None
    finally:
        connection.close()


def _micros(seconds: float) -> str:
    return f"{round(seconds * 1e6)}µs"


def _resource(labels: dict[str, str], side: str) -> list[str]:
    for key, short in (("deployment", "deploy"), ("pod", "pod")):
        if labels.get(key):
            return [f"{side}_res={short}/{labels[key]}", f"{side}_ns={labels.get('namespace', '')}"]
    return []


def render(event: dict[str, Any], *, wide: bool = False) -> str:
    """One line per event, as `linkerd viz tap` prints it; `error` and `dropped` lines say
    what happened to a proxy's stream or to requests past the rate."""
    kind = event.get("type")
    if kind == "error":
        return f"error proxy={event.get('proxy', '')} {event.get('message', '')}"
    direction = {"inbound": "in", "outbound": "out"}.get(str(event.get("direction")), "?")
    head = (
        f"{kind} id={event.get('id')} proxy={direction:<3} src={event.get('src')}"
        f" dst={event.get('dst')} tls={event.get('tls') or 'no'}"
    )
    if kind == "req":
        tail = (f":method={event.get('method')} :authority={event.get('authority')}"
                f" :path={event.get('path')}")  # fmt: skip
    elif kind == "rsp":
        tail = f":status={event.get('status')} latency={_micros(float(event.get('latency', 0)))}"
    else:
        tail = (f"duration={_micros(float(event.get('duration', 0)))}"
                f" response-length={event.get('bytes', 0)}B")  # fmt: skip
        if "grpc_status_code" in event:
            tail += f" grpc-status={event['grpc_status_code']}"
        if "reset_error_code" in event:
            tail += f" reset-error={event['reset_error_code']}"
    line = f"{head} {tail}"
    if wide:
        extra = _resource(event.get("src_labels") or {}, "src")
        extra += _resource(event.get("dst_labels") or {}, "dst")
        line += "".join(" " + e for e in extra)
    if event.get("dropped_before"):
        line = f"({event['dropped_before']} requests dropped past --max-rps)\n{line}"
    return line
