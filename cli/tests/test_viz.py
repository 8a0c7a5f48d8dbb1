"""`meshlet viz` against a real Prometheus scraping real proxies: the local test mesh
(`meshlet_testing.podmesh`: pods in network namespaces, each meshed one with its
`meshlet-proxy`, the real control plane) and Debian's `prometheus`, scraping every proxy's
admin port each second with the labels Kubernetes service discovery would give.

The control plane's admin ports are scraped too, as job `meshlet-controller` with the
`component` label the chart's scrape config gives them (the proxy injector, which the test mesh
does not run, is started beside it and answers three reviews), so that every query of the Grafana
dashboards (charts/meshlet-control-plane/dashboards) is run here and must return data.

`alpha-1` (Deployment alpha) calls `server-1`'s app on 8080 (200s); `beta-1` calls port 8089 of
`server-1`, where nothing listens (the server's proxy answers 502s); `gamma-1` opens TCP
connections to `server-1`'s opaque port 7000 (a server-speaks-first protocol, over mTLS: no
requests, only connections). One call of each is made
before Prometheus starts, so that every series exists at its first scrape and `increase()`
counts the traffic that follows. Every query of the metrics API is run and must return data;
the commands' output is checked against the requests sent.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from meshlet.api import wellknown
from meshlet.cli import charts, vizmetrics
from meshlet.cli.demo import prometheus as promconf
from meshlet.cli.demo.topology import Layout, Mode, Pod
from meshlet_testing import browser as chromium
from meshlet_testing import grafana, injectorproc, workloads
from meshlet_testing.podapp import TCP_PORT
from meshlet_testing.podmesh import CONTROL_PLANE, NS, PodMesh, PodSpec, running
from meshlet_testing.processes import stop
from meshlet_testing.sockets import free_port as _free_port

pytestmark = pytest.mark.netns

INJECTOR = "proxy-injector"  # the component, as the chart labels its pod
SERVER, ALPHA, BETA, GAMMA = "server-1", "alpha-1", "beta-1", "gamma-1"
IPS = {SERVER: "10.78.0.10", ALPHA: "10.78.0.21", BETA: "10.78.0.22", GAMMA: "10.78.0.23"}
WORKLOAD = {SERVER: "server", ALPHA: "alpha", BETA: "beta", GAMMA: "gamma"}
OK_CALLS, FAILED_CALLS, TCP_CONNECTIONS = 12, 6, 5
GOOD = f"http://{IPS[SERVER]}:8080/"
BAD = f"http://{IPS[SERVER]}:8089/"
WINDOW = "1m"
SCRAPE = "500ms"
# increase() extrapolates a series' growth to the window's edges by up to half a scrape interval
# each side: over the seconds Prometheus sampled, that stays within a tenth.
SETTLE = 2.5  # seconds of scrapes before and after the traffic


def identity(pod: str) -> str:
    return wellknown.identity_name(WORKLOAD[pod], NS)


@pytest.fixture(scope="module")
def prometheus_binary() -> str:
    found = promconf.binary()
    if found is None:
        if os.environ.get("MESHLET_REQUIRE_NETNS") == "1" or os.environ.get("CI"):
            pytest.fail("prometheus is not installed (scripts/system-packages installs it)")
        pytest.skip("prometheus is not installed (scripts/system-packages installs it)")
    return found


class Recorder:
    """Runs queries on the Prometheus and remembers what each returned."""

    def __init__(self, prom: vizmetrics.Prometheus) -> None:
        self.prom = prom
        self.answers: dict[str, int] = {}

    def __call__(self, promql: str) -> list[vizmetrics.Sample]:
        samples = self.prom.query(promql)
        self.answers[promql] = len(samples)
        return samples


@pytest.fixture(scope="module")
def world(
    netns_available: None, prometheus_binary: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[PodMesh, str]]:
    pods = [
        PodSpec(Pod(SERVER, WORKLOAD[SERVER], IPS[SERVER], "server"), app=True,
                opaque_ports=(TCP_PORT,)),
        PodSpec(Pod(ALPHA, WORKLOAD[ALPHA], IPS[ALPHA], "client")),
        PodSpec(Pod(BETA, WORKLOAD[BETA], IPS[BETA], "client")),
        PodSpec(Pod(GAMMA, WORKLOAD[GAMMA], IPS[GAMMA], "client")),
    ]  # fmt: skip
    layout = Layout(Mode.NETNS, tuple(s.pod for s in pods), control_ip="10.78.0.2",
                    host_ip="10.78.0.1", prefix=24)  # fmt: skip
    root = tmp_path_factory.mktemp("viz")
    with (
        injectorproc.started(root / "injector") as injector,
        running(PodMesh(root, layout, pods, cluster_networks="10.78.0.0/25")) as mesh,
    ):
        injector.wait_ready()
        controllers = [(name, f"{layout.control_ip}:{admin}") for name, admin in CONTROL_PLANE]
        controllers.append((INJECTOR, injector.admin_address))
        assert mesh.curl_codes(ALPHA, GOOD, 1) == [200]
        assert mesh.curl_codes(BETA, BAD, 1) == [502]
        _opaque(mesh)
        _admission_reviews(injector)
        targets = [
            promconf.Target(f"{ip}:{wellknown.PROXY_ADMIN_PORT}", NS, pod, WORKLOAD[pod],
                            WORKLOAD[pod])
            for pod, ip in IPS.items()
        ] + [
            promconf.Target(address, wellknown.CONTROL_PLANE_NAMESPACE, name, name, name,
                            promconf.CONTROLLER_JOB, component=name)
            for name, address in controllers
        ]  # fmt: skip
        (root / "prometheus.yml").write_text(promconf.config(targets, SCRAPE))
        url = f"http://127.0.0.1:{_free_port()}"
        argv = promconf.command(prometheus_binary, root / "prometheus.yml", root / "tsdb",
                                url.removeprefix("http://"))  # fmt: skip
        with (root / "prometheus.log").open("w") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        try:
            promconf.wait_ready(url)
            prom = vizmetrics.Prometheus(url)
            _until(prom, 'count(up{job="meshlet-proxy"} == 1)', len(IPS))
            _until(prom, f'count(up{{job="{promconf.CONTROLLER_JOB}"}} == 1)', len(controllers))
            time.sleep(SETTLE)
            _admission_reviews(injector)
            mesh.annotate(SERVER, {"example.com/scraped": "yes"})  # an event for the controllers
            assert mesh.curl_codes(ALPHA, GOOD, OK_CALLS) == [200] * OK_CALLS
            assert mesh.curl_codes(BETA, BAD, FAILED_CALLS) == [502] * FAILED_CALLS
            for _ in range(TCP_CONNECTIONS):
                _opaque(mesh)
            total = 2 + OK_CALLS + FAILED_CALLS
            _until(prom, 'sum(response_total{direction="inbound"})', total)
            events = '{__name__=~"(destination|policy)_event_processing_seconds_count"}'
            _until(prom, f"count(increase({events}[1m]) > 0)", 2)  # each controller's
            time.sleep(SETTLE)
            yield mesh, url
        finally:
            stop(proc)


def _opaque(mesh: PodMesh) -> None:
    """One connection from gamma-1 to the server's opaque port, answered by its app."""
    done = mesh.tcp(GAMMA, IPS[SERVER], TCP_PORT, "hi\n")
    assert done["error"] is None and done["received"].startswith(f"hello from {SERVER}"), done


def _admission_reviews(injector: injectorproc.Injector) -> None:
    """What the injector counts: a pod meshed, a malformed review, a ServiceProfile judged."""
    meshed = injector.review(
        workloads.review(workloads.pod({wellknown.INJECT_ANNOTATION: "enabled"}))
    )
    assert meshed["allowed"] is True and "patch" in meshed
    assert injector.post(b"not json")[0] == 400
    profile = {"apiVersion": "meshlet.io/v1alpha1", "kind": "ServiceProfile",
               "metadata": {"name": "web.emojivoto.svc.cluster.local", "namespace": "emojivoto"},
               "spec": {"routes": [{"name": "GET /", "condition": {"method": "GET"}}]}}  # fmt: skip
    assert injector.review(workloads.review(profile), "/validate")["allowed"] is True


def _until(prom: vizmetrics.Prometheus, promql: str, want: float, within: float = 15.0) -> None:
    deadline = time.monotonic() + within
    got: float | None = None
    while time.monotonic() < deadline:
        samples = prom.query(promql)
        got = samples[0].value if samples else None
        if got is not None and got >= want:
            return
        time.sleep(0.25)
    raise AssertionError(f"{promql} was {got}, not {want}, after {within:g}s")


def _close(got: float, sent: int) -> bool:
    return sent * 0.9 <= got <= sent * 1.3


def test_every_query_returns_data(world: tuple[PodMesh, str]) -> None:
    _, url = world
    run = Recorder(vizmetrics.Prometheus(url))
    pod = vizmetrics.Target("pod", SERVER, NS)
    rows = vizmetrics.stat(run.prom, vizmetrics.stat_query(pod), WINDOW, run=run)
    assert [r.name for r in rows] == [SERVER]
    outbound = vizmetrics.stat_query(vizmetrics.Target("pod", ALPHA, NS),
                                     to=vizmetrics.Target("pod", SERVER, None))  # fmt: skip
    vizmetrics.stat(run.prom, outbound, WINDOW, run=run)
    vizmetrics.edges(run.prom, "pod", WINDOW, NS, run=run)
    vizmetrics.routes(run.prom, pod, WINDOW, run=run)
    to = vizmetrics.Target("authority", f"{IPS[SERVER]}:8080", NS)
    vizmetrics.routes(run.prom, vizmetrics.Target("pod", ALPHA, NS), WINDOW, to=to, run=run)
    empty = [q for q, n in run.answers.items() if n == 0]
    assert not empty, f"queries that returned nothing: {empty}"
    assert len(run.answers) >= 20


DASHBOARDS = charts.chart_dir(charts.CONTROL_PLANE) / "dashboards"


def test_every_dashboard_query_returns_data(world: tuple[PodMesh, str]) -> None:
    """Each panel's query returns data for one of the values its variables offer here (Grafana
    shows a Deployment at a time; the world's ones either serve or send), and each variable
    offers values."""
    _, url = world
    prom = vizmetrics.Prometheus(url)

    def run(promql: str) -> list[Mapping[str, str]]:  # NaN: Grafana draws no value
        return [s.labels for s in prom.query(promql) if not math.isnan(s.value)]

    failures: list[str] = []
    ran = 0
    for path in sorted(DASHBOARDS.glob("*.json")):
        board = json.loads(path.read_text())
        choices, problems = grafana.assignments(grafana.variables(board), run)
        failures += [f"{path.name}: {p}" for p in problems]
        for query in grafana.queries(board, path.name):
            ran += 1
            failure = grafana.first_answering(query, choices, run)
            if failure is not None:
                failures.append(failure)
    assert not failures, "dashboard queries that failed:\n" + "\n".join(failures)
    assert ran >= 50


def viz(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "meshlet.cli.main", "viz", *args, "--prometheus-url", url],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip


def _json(done: subprocess.CompletedProcess[str]) -> list[dict[str, object]]:
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def test_stat_counts_what_was_sent(world: tuple[PodMesh, str]) -> None:
    _, url = world
    [server] = _json(viz(url, "stat", "deploy/server", "-n", NS, "-o", "json"))
    assert server["name"] == "server" and server["namespace"] == NS
    assert _close(float(server["requests"]), OK_CALLS + FAILED_CALLS)  # type: ignore[arg-type]
    assert 0.5 < float(server["success"]) < 0.8  # type: ignore[arg-type]
    assert server["mtls"] == 1.0
    assert server["latency_ms_p50"] is not None and float(server["rps"]) > 0  # type: ignore[arg-type]
    [alpha] = _json(viz(url, "stat", "po/server-1", "--from", "po/alpha-1", "-n", NS, "-o", "json"))
    assert alpha["name"] == SERVER and alpha["success"] == 1.0
    assert _close(float(alpha["requests"]), OK_CALLS)  # type: ignore[arg-type]
    [beta] = _json(viz(url, "stat", "deploy/beta", "--to", "po/server-1", "-n", NS, "-o", "json"))
    assert beta["name"] == "beta" and beta["success"] == 0.0
    table = viz(url, "stat", "deploy", "-n", NS)
    assert table.returncode == 0, table.stderr
    [header, *lines] = table.stdout.splitlines()
    assert header.split()[:4] == ["NAMESPACE", "NAME", "SUCCESS", "RPS"]
    assert [line.split()[1] for line in lines] == ["server"]


def test_edges_name_both_identities(world: tuple[PodMesh, str]) -> None:
    _, url = world
    got = _json(viz(url, "edges", "po", "-n", NS, "-o", "json"))
    by_src = {e["src"]: e for e in got}
    assert set(by_src) == {ALPHA, BETA, GAMMA}
    alpha = by_src[ALPHA]
    assert alpha["dst"] == SERVER and alpha["dst_namespace"] == NS and alpha["mtls"] is True
    assert alpha["client_id"] == identity(ALPHA) and alpha["server_id"] == identity(SERVER)
    assert _close(float(alpha["requests"]), OK_CALLS)  # type: ignore[arg-type]
    assert by_src[BETA]["client_id"] == identity(BETA)
    # opaque TCP: connections, no requests, over mTLS with both identities
    gamma = by_src[GAMMA]
    assert gamma["dst"] == SERVER and gamma["mtls"] is True and gamma["requests"] == 0
    assert gamma["client_id"] == identity(GAMMA) and gamma["server_id"] == identity(SERVER)
    assert _close(float(gamma["connections"]), TCP_CONNECTIONS)  # type: ignore[arg-type]
    table = viz(url, "edges", "po", "-n", NS)
    assert table.returncode == 0, table.stderr
    assert any(line.split()[:2] == [GAMMA, SERVER] for line in table.stdout.splitlines())


def test_routes(world: tuple[PodMesh, str]) -> None:
    _, url = world
    routes = _json(viz(url, "routes", "po/server-1", "-n", NS, "-o", "json"))
    by_dst = {r["dst"]: r for r in routes}
    assert by_dst[f"{IPS[SERVER]}:8080"]["route"] == vizmetrics.DEFAULT_ROUTE
    assert by_dst[f"{IPS[SERVER]}:8080"]["success"] == 1.0
    assert by_dst[f"{IPS[SERVER]}:8089"]["success"] == 0.0
    out = _json(viz(url, "routes", "deploy/alpha", "--to", f"authority/{IPS[SERVER]}:8080",
                    "-n", NS, "-o", "json"))  # fmt: skip
    assert [r["dst"] for r in out] == [f"{IPS[SERVER]}:8080"]
    assert _close(float(out[0]["actual_requests"]), OK_CALLS)  # type: ignore[arg-type]


def test_errors_are_clear(world: tuple[PodMesh, str], tmp_path: Path) -> None:
    _, url = world
    down = viz(f"http://127.0.0.1:{_free_port()}", "stat", "deploy", "-n", NS)
    assert down.returncode == 1 and "cannot reach Prometheus" in down.stderr
    assert "Traceback" not in down.stderr
    bad = viz(url, "stat", "widgets")
    assert bad.returncode == 64 and "unknown resource type" in bad.stderr
    window = viz(url, "stat", "deploy", "-t", "forever")
    assert window.returncode == 64 and "not a window" in window.stderr
    with pytest.raises(vizmetrics.MetricsError, match="refused"):
        vizmetrics.Prometheus(url).query("sum(")
    assert shutil.which("prometheus") is not None


# -- the web dashboard in a real browser ---------------------------------------------------
# `meshlet-controller tap` and `meshlet-controller web` (processes) beside the world's
# Prometheus, the dashboard read by Debian's chromium (headless, driven through its
# chromedriver by selenium). What a page shows is checked through its elements; screenshots
# go to the test's output (and $MESHLET_TEST_ARTIFACTS) for a person to look at.


def _controller(name: str, root: Path, *args: str) -> subprocess.Popen[bytes]:
    log = (root / f"{name}.log").open("wb")
    with log:
        return subprocess.Popen([sys.executable, "-m", "meshlet.controlplane.main", name, *args],
                                stdout=log, stderr=subprocess.STDOUT)  # fmt: skip


def _ready(admin: str, proc: subprocess.Popen[bytes], within: float = 20.0) -> None:
    import urllib.request

    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"exited {proc.returncode}"
        try:
            with urllib.request.urlopen(f"http://{admin}/ready", timeout=1) as answer:
                if answer.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{admin} was not ready within {within:g}s")


@pytest.fixture(scope="module")
def dashboard(
    world: tuple[PodMesh, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """The dashboard's URL, its tap view reading a tap controller that taps the world's proxies
    with a certificate of the tap identity from the world's issuer."""
    import datetime as dt

    from meshlet.controlplane.identity import ca, signer

    mesh, prometheus_url = world
    root = tmp_path_factory.mktemp("dashboard")
    folder = mesh.root / "ca"
    issuer = ca.load_issuer((folder / "issuer" / wellknown.ISSUER_CERT_KEY).read_bytes(),
                            (folder / "issuer" / wellknown.ISSUER_KEY_KEY).read_bytes(),
                            (folder / "trust-anchors.pem").read_bytes())  # fmt: skip
    now = dt.datetime.now(dt.UTC)
    signer.write_serving_files(issuer, wellknown.TAP_SERVICE_NAME, root, now, dt.timedelta(hours=1))
    cert = root / wellknown.TAP_SERVICE_NAME
    tap, web = f"127.0.0.1:{_free_port()}", f"127.0.0.1:{_free_port()}"
    tap_admin, web_admin = f"127.0.0.1:{_free_port()}", f"127.0.0.1:{_free_port()}"
    procs = [
        _controller("tap", root, "--addr", tap, "--admin-addr", tap_admin,
                    "--manifests", str(mesh.manifests.root), "--tls-cert", f"{cert}.crt",
                    "--tls-key", f"{cert}.key",
                    "--trust-anchors", str(folder / "trust-anchors.pem")),
        _controller("web", root, "--addr", web, "--admin-addr", web_admin,
                    "--prometheus-url", prometheus_url, "--tap-addr", tap),
    ]  # fmt: skip
    try:
        _ready(tap_admin, procs[0])
        _ready(web_admin, procs[1])
        yield f"http://{web}"
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            assert proc.wait(timeout=10) == 0, (root / "web.log").read_text()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with chromium.chromium() as driver:
        yield driver


def _cells(driver: Any, table: str) -> dict[str, list[str]]:
    from selenium.webdriver.common.by import By

    rows = driver.find_elements(By.CSS_SELECTOR, f"#{table} tbody tr")
    out = {}
    for row in rows:
        cells = [td.text for td in row.find_elements(By.TAG_NAME, "td")]
        out[cells[0]] = cells
    return out


def _percent(text: str) -> float:
    return float(text.rstrip("%")) / 100


def test_the_dashboard_in_a_browser(
    world: tuple[PodMesh, str], browser: Any, dashboard: str, tmp_path: Path
) -> None:
    """Runs last in this module: the tap step sends a few more requests."""
    import urllib.error
    import urllib.request

    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    mesh, _ = world
    out = tmp_path / "screenshots"
    browser.get(f"{dashboard}/")
    assert browser.find_element(By.ID, "title").text == "Namespaces"
    namespaces = _cells(browser, "namespaces")
    assert namespaces[NS][1] == str(len(IPS))  # meshed pods, as Prometheus scrapes them
    assert 0.5 < _percent(namespaces[NS][2]) < 0.8
    chromium.screenshot(browser, "namespaces", out)

    browser.find_element(By.LINK_TEXT, NS).click()
    deployments = _cells(browser, "deployments")
    assert set(deployments) == {"alpha", "beta", "gamma", "server"}
    assert [deployments[d][1] for d in sorted(deployments)] == ["1", "1", "1", "1"]
    assert 0.5 < _percent(deployments["server"][2]) < 0.8 and deployments["server"][4] != "-"
    assert set(_cells(browser, "pods")) == {ALPHA, BETA, GAMMA, SERVER}
    chromium.screenshot(browser, "namespace", out)

    # the world's pods carry no pod-template-hash: their destinations are labelled by pod and
    # ReplicaSet, not Deployment (as `meshlet viz edges po` reads them)
    browser.get(f"{dashboard}/topology?namespace={NS}&kind=po")
    edges = {
        (g.get_attribute("data-src"), g.get_attribute("data-dst")): g
        for g in browser.find_elements(By.CSS_SELECTOR, "#topology g.edge")
    }
    assert set(edges) == {(ALPHA, SERVER), (BETA, SERVER), (GAMMA, SERVER)}
    alpha = edges[(ALPHA, SERVER)]
    assert alpha.get_attribute("data-mtls") == "true"
    assert identity(ALPHA) in alpha.text and identity(SERVER) in alpha.text
    gamma = edges[(GAMMA, SERVER)]  # the opaque edge
    assert gamma.get_attribute("data-mtls") == "true" and "TCP conn" in gamma.text
    assert identity(GAMMA) in gamma.text
    nodes = browser.find_elements(By.CSS_SELECTOR, "#topology g.node")
    assert sorted(n.get_attribute("data-name") for n in nodes) == [ALPHA, BETA, GAMMA, SERVER]
    assert chromium.topology_overlaps(browser.execute_script(chromium.TOPOLOGY_GEOMETRY)) == []
    chromium.screenshot(browser, "topology", out)

    browser.get(f"{dashboard}/routes?resource=po/{SERVER}&namespace={NS}")
    rows = browser.find_elements(By.CSS_SELECTOR, "#routes tbody tr")
    routes = {r.find_elements(By.TAG_NAME, "td")[1].text: r.text for r in rows}
    assert set(routes) == {f"{IPS[SERVER]}:8080", f"{IPS[SERVER]}:8089"}
    assert "100.00%" in routes[f"{IPS[SERVER]}:8080"] and "0.00%" in routes[f"{IPS[SERVER]}:8089"]
    chromium.screenshot(browser, "routes", out)

    browser.get(f"{dashboard}/tap?resource=po/{ALPHA}&namespace={NS}&path=/dashboard")
    browser.find_element(By.ID, "tap-start").click()
    wait = WebDriverWait(browser, 10)
    wait.until(lambda d: "live" in d.find_element(By.ID, "tap-status").text)
    wait.until(lambda _: _tap_open(mesh) >= 1)
    assert mesh.curl_codes(ALPHA, f"{GOOD}dashboard-tapped", 2) == [200, 200]
    assert mesh.curl_codes(ALPHA, f"{GOOD}not-this-path", 1) == [200]
    wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#tap-events tr.tap-row")) >= 2)
    wait.until(lambda d: all(
        td.text == "200" for td in d.find_elements(By.CSS_SELECTOR, "#tap-events .tap-status")
    ))  # fmt: skip
    paths = [td.text for td in browser.find_elements(By.CSS_SELECTOR, "#tap-events .tap-path")]
    assert paths == ["/dashboard-tapped", "/dashboard-tapped"]
    chromium.screenshot(browser, "tap", out)
    browser.find_element(By.ID, "tap-stop").click()
    wait.until(lambda d: d.find_element(By.ID, "tap-status").text == "Stopped.")

    assert [e for e in browser.get_log("browser") if e["level"] == "SEVERE"] == []
    forged = urllib.request.Request(f"{dashboard}/", headers={"Host": "dashboard.evil.example"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(forged, timeout=5)
    refused.value.close()
    assert refused.value.code == 403
    assert sorted(p.name for p in out.iterdir()) == [
        "namespace.png", "namespaces.png", "routes.png", "tap.png", "topology.png",
    ]  # fmt: skip


def _tap_open(mesh: PodMesh) -> float:
    from meshlet_testing.podmesh import metric

    return metric(mesh.metrics(ALPHA), "tap_open")
