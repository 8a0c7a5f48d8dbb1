"""`meshlet viz top`'s table from tap events (pure): grouping, latency, success, bounds."""

from __future__ import annotations

from typing import Any

from meshlet.cli import top as topmod
from meshlet.cli.top import Top
from meshlet.cli.viztop import table

Events = list[dict[str, Any]]


def request(n: int, path: str, *, status: int = 200, latency: float | None = 0.002,
            duration: float = 0.003, src_pod: str = "vote-bot-1",
            **end: Any) -> Events:  # fmt: skip
    common = {"proxy": "emojivoto/web-1", "id": f"1:{n}", "src": f"10.1.0.9:{41000 + n}",
              "dst": "10.1.0.5:8080", "src_labels": {"pod": src_pod} if src_pod else {},
              "dst_labels": {"pod": "web-1"}}  # fmt: skip
    events = [{"type": "req", "method": "GET", "path": path, **common}]
    if latency is not None:
        events.append({"type": "rsp", "status": status, "latency": latency, **common})
    events.append({"type": "end", "duration": duration, "bytes": 0, **common, **end})
    return events


def fed(top: Top, *requests: list[dict[str, Any]]) -> Top:
    for events in requests:
        for event in events:
            top.add(event)
    return top


def test_requests_are_grouped_by_source_destination_method_and_path() -> None:
    top = fed(Top(), request(1, "/a", latency=0.004), request(2, "/a", latency=0.001),
              request(3, "/a", latency=0.002), request(4, "/b"),
              request(5, "/a", src_pod=""))  # fmt: skip
    busiest, *others = top.rows()
    assert (busiest.source, busiest.destination, busiest.method, busiest.path) == (
        "vote-bot-1",
        "web-1",
        "GET",
        "/a",
    )
    assert (busiest.count, busiest.best, busiest.worst, busiest.last) == (3, 0.001, 0.004, 0.002)
    assert {(o.source, o.path) for o in others} == {("vote-bot-1", "/b"), ("10.1.0.9", "/a")}
    hidden = fed(Top(hide_sources=True), request(1, "/a"), request(5, "/a", src_pod=""))
    assert [(r.source, r.count) for r in hidden.rows()] == [("", 2)]
    # the tapped proxy's own pod names its side when the labels do not
    inbound = fed(
        Top(), [{**e, "direction": "inbound", "dst_labels": {}} for e in request(1, "/a")]
    )
    assert [(r.source, r.destination) for r in inbound.rows()] == [("vote-bot-1", "web-1")]
    outbound = fed(Top(), [{**e, "direction": "outbound", "src_labels": {}}
                           for e in request(1, "/a")])  # fmt: skip
    assert [(r.source, r.destination) for r in outbound.rows()] == [("web-1", "web-1")]
    assert "SOURCE" not in table(hidden, 20).splitlines()[0]


def test_5xx_grpc_failures_and_resets_fail_and_a_request_without_headers_times_to_its_end() -> None:
    top = fed(Top(), request(1, "/x"), request(2, "/x", status=503),
              request(3, "/x", grpc_status_code=14), request(4, "/x", reset_error_code=2),
              request(5, "/x", grpc_status_code=0), request(6, "/x", status=404),
              request(7, "/x", latency=None, duration=0.25))  # fmt: skip
    [row] = top.rows()
    assert row.count == 7 and row.ok == 4 and row.success == 4 / 7
    assert row.worst == 0.25 and row.last == 0.25


def test_what_is_held_is_bounded() -> None:
    top = Top()
    for n in range(topmod.MAX_PENDING + 5):
        top.add(request(n, "/p")[0])  # begun, never ended
    assert len(top.pending) == topmod.MAX_PENDING
    top.add(request(0, "/p")[-1])  # the oldest was forgotten: its end counts nothing
    assert top.rows() == []
    many = Top()
    for n in range(topmod.MAX_ROWS + 3):
        fed(many, request(n, f"/p{n}"))
    assert len(many.entries) == topmod.MAX_ROWS and many.overflow == 3
    assert "(3 requests of paths past the first" in table(many, 5)
    assert len(table(many, 5).splitlines()) == 1 + 5 + 1


def test_errors_and_drops_are_said_under_the_table() -> None:
    top = fed(Top(), request(1, "/a"))
    top.add({"type": "error", "proxy": "emojivoto/web-2", "message": "UNAVAILABLE: refused"})
    top.add({**request(2, "/a")[0], "dropped_before": 4})
    text = table(top, 20)
    assert "(error emojivoto/web-2: UNAVAILABLE: refused)" in text
    assert "(4 requests not shown (past --max-rps))" in text


def test_the_live_table_fits_its_terminal() -> None:
    """On 80x24 (and shorter), with long paths and requests dropped: the header, the busiest
    rows that fit with their numbers whole, how many more, the notes; no line wraps."""
    from rich.console import Console

    from meshlet.cli.viztop import screenful

    top = Top()
    for n in range(40):
        fed(top, *(request(n * 100 + i, f"/api/v1/items/{n}/" + "x" * (n * 3))
                   for i in range(40 - n)))  # fmt: skip
    top.dropped = 7
    console = Console(width=80, height=24, record=True, color_system=None)
    console.print(screenful(top, 20, 80, 24))
    lines = console.export_text().splitlines()
    assert len(lines) <= 23 and max(len(line) for line in lines) <= 80, lines
    assert lines[0].split()[:4] == ["SOURCE", "DESTINATION", "METHOD", "PATH"]
    # the busiest first, its numbers whole: the path gives way
    assert lines[1].split()[3].startswith("/api/v1/") and lines[1].split()[3].endswith("…")
    assert lines[1].split()[4:] == ["40", "2.0ms", "2.0ms", "2.0ms", "100.00%"]
    assert len(lines) == 1 + 20 + 1  # header, --limit rows, the note
    assert "(7 requests not shown (past --max-rps))" in lines
    short = Console(width=80, height=16, record=True, color_system=None)
    short.print(screenful(top, 20, 80, 16))
    lines = short.export_text().splitlines()
    assert len(lines) <= 15 and "(8 more rows: a taller terminal shows them)" in lines
    tall = Console(width=200, height=60, record=True, color_system=None)
    tall.print(screenful(top, 20, 200, 60))
    assert len(tall.export_text().splitlines()) == 1 + 20 + 1  # header, --limit rows, the note
