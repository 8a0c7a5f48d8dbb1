"""The dashboard (`meshlet-controller web`, a process) in a real browser (headless chromium,
through selenium), over stand-ins for Prometheus and the tap controller on real sockets: what
the topology draws for the local mesh's edges (the opaque web → store edge included) and
that no label lies on an arrow, a node or another label; and that the tap page shows the tap
controller's own error when a tap ends after one. With a real mesh and Prometheus:
cli/tests/test_viz.py."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from meshlet.api import wellknown
from meshlet_testing import browser as chromium
from meshlet_testing.sockets import free_port as _free_port

NS = "demo"


def _id(sa: str) -> str:
    return wellknown.identity_name(sa, NS)


def _out(src: str, dst: str) -> dict[str, str]:
    return {"namespace": NS, "deployment": src, "serviceaccount": src, "dst_namespace": NS,
            "dst_deployment": dst, "server_id": _id(dst), "tls": "true"}  # fmt: skip


def _in(dst: str, client: str) -> dict[str, str]:
    return {"namespace": NS, "deployment": dst, "client_id": _id(client), "tls": "true"}


# The local mesh's traffic as its proxies count it: HTTP requests load → web → api, api-v2;
# opaque TCP web → store (connections, no requests); and, to draw an edge that skips a column
# and one to itself, TCP load → store and HTTP web → web.
ANSWERS: dict[str, list[tuple[dict[str, str], float]]] = {
    'request_total{direction="outbound"}': [
        (_out("load", "web"), 120), (_out("web", "api"), 110), (_out("web", "api-v2"), 12),
        (_out("web", "web"), 3),
    ],
    'tcp_open_total{direction="outbound", peer="dst"}': [
        (_out("web", "store"), 40), (_out("load", "store"), 2), (_out("load", "web"), 4),
    ],
    'response_total{direction="inbound"}': [
        (_in("web", "load"), 120), (_in("api", "web"), 110), (_in("api-v2", "web"), 12),
        (_in("web", "web"), 3),
    ],
    'tcp_open_total{direction="inbound", peer="src"}': [
        (_in("store", "web"), 40), (_in("store", "load"), 2),
    ],
}  # fmt: skip
DENIED = {"type": "error", "proxy": "demo/web-1",
          "message": "PERMISSION_DENIED: meshlet-tap.meshlet is not authorized"}  # fmt: skip


class StandIns(BaseHTTPRequestHandler):
    """Prometheus' `/api/v1/query` (ANSWERS by the series a query reads, else nothing) and the
    tap controller's `/api/v1/tap` (one proxy's error, then the end of the stream)."""

    def do_GET(self) -> None:
        url = urllib.parse.urlsplit(self.path)
        if url.path == "/api/v1/tap":
            self.send_response(200)
            self.send_header("Content-Type", "application/x-ndjson")
            self.end_headers()
            self.wfile.write(json.dumps(DENIED).encode() + b"\n")
            return  # HTTP/1.0: the stream ends with the connection
        promql = dict(urllib.parse.parse_qsl(url.query))["query"]
        found = next((v for k, v in ANSWERS.items() if k in promql), [])
        result = [{"metric": labels, "value": [0, str(value)]} for labels, value in found]
        data = {"resultType": "vector", "result": result}
        body = json.dumps({"status": "success", "data": data}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def dashboard(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    stand_in = ThreadingHTTPServer(("127.0.0.1", 0), StandIns)
    threading.Thread(target=stand_in.serve_forever, daemon=True).start()
    upstream = f"127.0.0.1:{stand_in.server_address[1]}"
    web, admin = f"127.0.0.1:{_free_port()}", f"127.0.0.1:{_free_port()}"
    log = tmp_path_factory.mktemp("web") / "web.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "meshlet.controlplane.main", "web", "--addr", web,
             "--admin-addr", admin, "--prometheus-url", f"http://{upstream}",
             "--tap-addr", upstream],
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 20
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                with urllib.request.urlopen(f"http://{admin}/ready", timeout=1) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        yield f"http://{web}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        stand_in.shutdown()
        stand_in.server_close()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with chromium.chromium() as driver:
        yield driver


def test_the_topology_draws_the_opaque_edge_and_no_label_on_a_line(
    dashboard: str, browser: Any, tmp_path: Path
) -> None:
    from selenium.webdriver.common.by import By

    browser.get(f"{dashboard}/topology?namespace={NS}&kind=deploy")
    edges = {
        (g.get_attribute("data-src"), g.get_attribute("data-dst")): g
        for g in browser.find_elements(By.CSS_SELECTOR, "#topology g.edge")
    }
    assert set(edges) == {("load", "web"), ("web", "api"), ("web", "api-v2"), ("web", "store"),
                          ("load", "store"), ("web", "web")}  # fmt: skip
    store = edges[("web", "store")]
    assert store.get_attribute("data-mtls") == "true"
    assert "40 TCP conn" in store.text
    assert _id("web") in store.text and _id("store") in store.text
    chromium.screenshot(browser, "topology-demo", tmp_path)
    geometry = browser.execute_script(chromium.TOPOLOGY_GEOMETRY)
    assert len(geometry["labels"]) == 6 and len(geometry["nodes"]) == 5
    assert chromium.topology_overlaps(geometry) == []


def test_the_tap_page_shows_the_tap_controller_s_error_after_the_tap_ends(
    dashboard: str, browser: Any
) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(f"{dashboard}/tap?resource=deploy/web&namespace={NS}")
    browser.find_element(By.ID, "tap-start").click()
    wait = WebDriverWait(browser, 10)
    wait.until(lambda d: "Tap ended" in d.find_element(By.ID, "tap-status").text)
    status = browser.find_element(By.ID, "tap-status")
    assert "PERMISSION_DENIED: meshlet-tap.meshlet is not authorized" in status.text
    assert "error" in (status.get_attribute("class") or "").split()
