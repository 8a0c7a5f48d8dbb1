"""A real browser for the dashboard's tests: Debian's chromium, headless, driven through its
chromedriver by selenium. Without them a test skips, or fails when `MESHLET_REQUIRE_NETNS=1`
or `CI` is set (scripts/system-packages and make setup install them)."""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import pytest

CHROMIUM: Final = "/usr/bin/chromium"
CHROMEDRIVER: Final = "/usr/bin/chromedriver"


def need(what: str) -> None:
    """Skips the test for want of `what`, or fails it where everything must run."""
    if os.environ.get("MESHLET_REQUIRE_NETNS") == "1" or os.environ.get("CI"):
        pytest.fail(f"{what} (scripts/system-packages and make setup install it)")
    pytest.skip(f"{what} (scripts/system-packages and make setup install it)")


@contextlib.contextmanager
def chromium(width: int = 1400, height: int = 1000) -> Iterator[Any]:
    """A headless chromium's webdriver, quit after the block."""
    if not (os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK)):
        need("chromium and chromium-driver are not installed")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        need("selenium is not installed")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 f"--window-size={width},{height}", "--no-first-run",
                 "--disable-extensions"):  # fmt: skip
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    driver.set_page_load_timeout(20)
    try:
        yield driver
    finally:
        driver.quit()


def screenshot(driver: Any, name: str, out: Path) -> None:
    """The page as `out/NAME.png`, and in `$MESHLET_TEST_ARTIFACTS/dashboard/` when set."""
    out.mkdir(parents=True, exist_ok=True)
    png = driver.get_screenshot_as_png()
    (out / f"{name}.png").write_bytes(png)
    artifacts = os.environ.get("MESHLET_TEST_ARTIFACTS")
    if artifacts:
        Path(artifacts, "dashboard").mkdir(parents=True, exist_ok=True)
        Path(artifacts, "dashboard", f"{name}.png").write_bytes(png)


# Every edge label's box, every edge's line segments and every node's box, in the SVG's own
# coordinates (the page draws it at scale 1), as the browser laid them out.
TOPOLOGY_GEOMETRY: Final = """
const svg = document.getElementById("topology");
const box = (b) => [b.x, b.y, b.x + b.width, b.y + b.height];
return {
  labels: [...svg.querySelectorAll("g.edge")].map((g) => ({
    src: g.dataset.src, dst: g.dataset.dst, box: box(g.querySelector("text").getBBox()),
  })),
  lines: [...svg.querySelectorAll("g.edge polyline, g.edge line")].map((p) =>
    p.points ? [...p.points].map((pt) => [pt.x, pt.y])
      : [[p.x1.baseVal.value, p.y1.baseVal.value], [p.x2.baseVal.value, p.y2.baseVal.value]]),
  nodes: [...svg.querySelectorAll("g.node rect")].map((r) => box(r.getBBox())),
};
"""


def _overlap(a: list[float], b: list[float]) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def _crosses(box: list[float], p: list[float], q: list[float], width: float = 2.0) -> bool:
    """Whether the segment p→q, drawn `width` wide, touches `box` (sampled every pixel)."""
    steps = max(1, int(max(abs(q[0] - p[0]), abs(q[1] - p[1]))))
    grown = [box[0] - width / 2, box[1] - width / 2, box[2] + width / 2, box[3] + width / 2]
    for i in range(steps + 1):
        x = p[0] + (q[0] - p[0]) * i / steps
        y = p[1] + (q[1] - p[1]) * i / steps
        if grown[0] < x < grown[2] and grown[1] < y < grown[3]:
            return True
    return False


def topology_overlaps(geometry: dict[str, Any]) -> list[str]:
    """What overlaps in a topology drawn by the browser: a label on a line, on a node, or on
    another label."""
    found = []
    labels = geometry["labels"]
    for i, label in enumerate(labels):
        name = f"{label['src']} → {label['dst']}'s label {[round(v) for v in label['box']]}"
        for line in geometry["lines"]:
            for p, q in itertools.pairwise(line):
                if _crosses(label["box"], p, q):
                    found.append(f"{name} lies on the segment {p} → {q}")
        found += [f"{name} lies on a node {n}" for n in geometry["nodes"]
                  if _overlap(label["box"], n)]  # fmt: skip
        found += [f"{name} lies on {other['src']} → {other['dst']}'s label"
                  for other in labels[i + 1:] if _overlap(label["box"], other["box"])]  # fmt: skip
    return found
