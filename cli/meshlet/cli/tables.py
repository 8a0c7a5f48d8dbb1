"""Plain-text tables as kubectl and linkerd print them: a header row, columns three spaces
apart, names left-aligned and numbers right-aligned (pure)."""

from __future__ import annotations

from collections.abc import Collection, Sequence

GAP = "   "


def render(
    header: Sequence[str], rows: Sequence[Sequence[str]], left: Collection[str], gap: str = GAP
) -> str:
    """The table; columns whose header is in `left` are left-aligned, the others right-aligned,
    `gap` between them. Lines carry no trailing spaces."""
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows, strict=True)]
    lines = []
    for cells in (header, *rows):
        parts = [
            cell.ljust(width) if name in left else cell.rjust(width)
            for name, cell, width in zip(header, cells, widths, strict=True)
        ]
        lines.append(gap.join(parts).rstrip())
    return "\n".join(lines) + "\n"


def pct(value: float | None) -> str:
    """A share as a percentage with two decimals; `-` when unknown."""
    return "-" if value is None else f"{value * 100:.2f}%"


def ms(value: float | None) -> str:
    """Milliseconds, whole from 10 ms up; `-` when unknown."""
    if value is None:
        return "-"
    return f"{value:.0f}ms" if value >= 10 else f"{value:.1f}ms"


def num(value: float | None, unit: str = "") -> str:
    """A number with one decimal and its unit; `-` when unknown."""
    return "-" if value is None else f"{value:.1f}{unit}"
