"""A handler for the proxy's HTTP/2 codec (`meshlet.proxy.http.h2codec.Handler`) that records
every call, in order, for tests that feed the codec a peer's bytes."""

from __future__ import annotations

from typing import Any


class RecordingHandler:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.closed = False

    def on_head(self, sid: int, headers: Any, end: bool) -> None:
        self.calls.append(("head", sid, list(headers), end))

    def on_informational(self, sid: int, headers: Any) -> None:
        self.calls.append(("informational", sid, list(headers)))

    def on_trailers(self, sid: int, headers: Any) -> None:
        self.calls.append(("trailers", sid, list(headers)))

    def on_data(self, sid: int, data: bytes, flow_len: int, end: bool) -> None:
        self.calls.append(("data", sid, data, flow_len, end))

    def on_reset(self, sid: int, code: int) -> None:
        self.calls.append(("reset", sid, code))

    def on_window(self, sid: int) -> None:
        self.calls.append(("window", sid))

    def on_settings(self) -> None:
        self.calls.append(("settings",))

    def on_goaway(self, code: int, last_sid: int, debug: bytes) -> None:
        self.calls.append(("goaway", code, last_sid, debug))

    def on_control(self) -> None:
        self.calls.append(("control",))

    def kinds(self) -> list[str]:
        return [call[0] for call in self.calls]
