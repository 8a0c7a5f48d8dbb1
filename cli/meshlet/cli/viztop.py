"""`meshlet viz top`: a live table of a resource's busiest paths, built from its tap (as
`linkerd viz top`). The tap is read on a thread; the table is redrawn every second on a terminal,
and printed once at the end (--duration, Ctrl-C, or the tap's end) elsewhere."""

from __future__ import annotations

import json
import queue
import sys
import threading
import time
from typing import Any, Final

import click

from meshlet.cli.viztap import source_options, tap_events

REFRESH: Final = 1.0  # seconds between redraws on a terminal
_END: Final = object()


def table(top: Any, limit: int, path_width: int | None = None, gap: str = "   ") -> str:
    """The busiest `limit` rows, and the notes; paths cut to `path_width` characters (with
    an ellipsis) when given, `gap` between columns."""
    from meshlet.cli import tables

    def cut(path: str) -> str:
        if path_width is None or len(path) <= path_width:
            return path
        return path[: max(1, path_width - 1)] + "…"

    header = ["SOURCE", "DESTINATION", "METHOD", "PATH", "COUNT", "BEST", "WORST", "LAST",
              "SUCCESS"]  # fmt: skip
    if top.hide_sources:
        header.remove("SOURCE")

    def ms(seconds: float | None) -> str:
        return tables.ms(None if seconds is None else seconds * 1000)

    rows = []
    for e in top.rows(limit):
        cells = [e.source, e.destination, e.method, cut(e.path), str(e.count), ms(e.best),
                 ms(e.worst), ms(e.last), tables.pct(e.success)]  # fmt: skip
        rows.append(cells[1:] if top.hide_sources else cells)
    out = tables.render(header, rows, {"SOURCE", "DESTINATION", "METHOD", "PATH"}, gap)
    notes = [f"error {e}" for e in top.errors]
    if top.dropped:
        notes.append(f"{top.dropped} requests not shown (past --max-rps)")
    if top.overflow:
        notes.append(f"{top.overflow} requests of paths past the first {len(top.entries)}")
    return out + "".join(f"({n})\n" for n in notes)


def screenful(top: Any, limit: int, width: int, height: int) -> Any:
    """The live table for a terminal of `width` x `height`: as many of the busiest rows as fit
    below the header and above the notes (the last line left for the cursor), and then a note
    of how many more there are; each line cut at `width`, never wrapped."""
    from rich.text import Text

    notes = len(top.errors) + bool(top.dropped) + bool(top.overflow)
    room = max(1, height - 1 - 1 - notes - 1)  # header, notes, the "more" note, the cursor
    rows = min(limit, len(top.rows(limit)))
    # the paths take what the other columns leave (the numbers stay whole): measured with every
    # path cut to nothing, its column as wide as its header
    shown = min(rows, room)
    others = max(len(line) for line in table(top, shown, 0, "  ").splitlines()[: 1 + shown])
    text = table(top, shown, max(8, width - others + len("PATH")), "  ")
    if rows > room:
        text += f"({rows - room} more rows: a taller terminal shows them)\n"
    out = Text()
    for i, line in enumerate(text.splitlines()[: max(1, height - 1)]):
        cut = Text(line)
        cut.truncate(width, overflow="ellipsis")
        out.append(("\n" if i else "") + cut.plain)
    return out


@click.command("top")
@click.argument("resource", metavar="RESOURCE")
@source_options
@click.option("--hide-sources", is_flag=True, help="Group by destination, method and path only.")
@click.option("--duration", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="Seconds to watch; 0: until Ctrl-C.")  # fmt: skip
@click.option("--limit", type=click.IntRange(min=1, max=10_000), default=20, show_default=True,
              help="Rows shown, the busiest first.")  # fmt: skip
@click.option("-o", "--output", type=click.Choice(["table", "json"]), default="table",
              show_default=True, help="table (redrawn live), or json at the end.")  # fmt: skip
def top(resource: str, hide_sources: bool, duration: float, limit: int, output: str,
        **source: Any) -> None:  # fmt: skip
    """The busiest paths of RESOURCE's requests, live (deploy/NAME, pod/NAME, ns/NAME).

    Its proxies' requests come from a tap (as `meshlet viz tap`; the same options choose which
    and where the tap controller is), grouped by source, destination, method and path: count,
    best, worst and last latency (to the response's headers), and success (not 5xx, gRPC OK,
    not reset).

    \b
    meshlet viz top deploy/web -n emojivoto
    meshlet viz top deploy/web --duration 10 -o json
    """
    from meshlet.cli.top import Top

    counts = Top(hide_sources)
    events: queue.Queue[Any] = queue.Queue(maxsize=10_000)
    failure: list[BaseException] = []
    with tap_events(resource, **source) as stream:

        def read() -> None:
            try:
                for event in stream:
                    events.put(event)
            except BaseException as exc:  # the main thread raises it
                failure.append(exc)
            finally:
                events.put(_END)

        threading.Thread(target=read, daemon=True, name="tap").start()
        live = _live() if output == "table" and sys.stdout.isatty() else None
        deadline = time.monotonic() + duration if duration else None
        try:
            with live or _nothing():
                _follow(counts, events, deadline, live, limit)
        except KeyboardInterrupt:
            pass
    if failure:
        raise failure[0]
    if output == "json":
        sys.stdout.write(json.dumps([e.as_dict() for e in counts.rows(limit)], indent=2) + "\n")
    else:
        sys.stdout.write(table(counts, limit))


def _follow(counts: Any, events: queue.Queue[Any], deadline: float | None, live: Any,
            limit: int) -> None:  # fmt: skip
    next_draw = time.monotonic()
    while deadline is None or time.monotonic() < deadline:
        wait = REFRESH if deadline is None else min(REFRESH, deadline - time.monotonic())
        try:
            event = events.get(timeout=max(0.0, wait))
        except queue.Empty:
            event = None
        if event is _END:
            return
        if event is not None:
            counts.add(event)
        if live is not None and time.monotonic() >= next_draw:
            width, height = live.console.size
            live.update(screenful(counts, limit, width, height), refresh=True)
            next_draw = time.monotonic() + REFRESH


def _live() -> Any:
    from rich.console import Console
    from rich.live import Live

    return Live(console=Console(), transient=True, auto_refresh=False)


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
