"""The chart's observability extras, off by default: its own Prometheus (prometheus.enabled),
the scrape jobs for a Prometheus of one's own (prometheus.scrapeConfig), one definition for
both, and the Grafana dashboards as a ConfigMap for Grafana's sidecar (grafana.dashboards).
Rendered documents pass the Kubernetes 1.33 schema, the Prometheus config passes `promtool`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from meshlet.api import wellknown as wk
from meshlet.cli import charts
from meshlet.cli.demo import prometheus as promconf
from meshlet_testing import pki, schema

FIXED = ("--values", str(pki.VALUES))
ON = "prometheus.enabled=true,prometheus.scrapeConfig=true,grafana.dashboards=true"
DASHBOARDS = charts.chart_dir(charts.CONTROL_PLANE) / "dashboards"
PROMETHEUS_OBJECTS = {
    ("ServiceAccount", "meshlet-prometheus"),
    ("ConfigMap", "meshlet-prometheus-config"),
    ("ClusterRole", f"meshlet-{wk.CONTROL_PLANE_NAMESPACE}-prometheus"),
    ("ClusterRoleBinding", f"meshlet-{wk.CONTROL_PLANE_NAMESPACE}-prometheus"),
    ("Service", "meshlet-prometheus"),
    ("Deployment", "meshlet-prometheus"),
}


def render(meshlet: Callable[..., Any], *args: str) -> list[dict[str, Any]]:
    run = meshlet("install", *FIXED, *args)
    assert run.code == 0, run.err
    return [d for d in yaml.safe_load_all(run.out) if d]


def find(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    return next(o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name)


@pytest.fixture(scope="module")
def rendered() -> list[dict[str, Any]]:
    values = yaml.safe_load(pki.VALUES.read_text())
    values["prometheus"] = {"enabled": True, "scrapeConfig": True}
    values["grafana"] = {"dashboards": True}
    manifests = charts.render(charts.CONTROL_PLANE, values, wk.CONTROL_PLANE_NAMESPACE)
    return [m.doc for m in manifests]


def test_off_by_default(meshlet: Callable[..., Any]) -> None:
    names = {(o["kind"], o["metadata"]["name"]) for o in render(meshlet)}
    assert not names & PROMETHEUS_OBJECTS
    assert ("ConfigMap", "meshlet-grafana-dashboards") not in names


def test_every_document_is_schema_valid_and_lint_is_clean(meshlet: Callable[..., Any]) -> None:
    objects = render(meshlet, "--set", ON)
    assert {(o["kind"], o["metadata"]["name"]) for o in objects} >= PROMETHEUS_OBJECTS
    for obj in objects:
        schema.validate(obj)
    values = yaml.safe_load(pki.VALUES.read_text())
    values.update(prometheus={"enabled": True}, grafana={"dashboards": True})
    assert charts.lint(charts.CONTROL_PLANE, values, wk.CONTROL_PLANE_NAMESPACE) == []


def test_one_definition_of_the_scrape_jobs(rendered: list[dict[str, Any]]) -> None:
    own = yaml.safe_load(find(rendered, "ConfigMap", "meshlet-prometheus-config")["data"]
                         ["prometheus.yml"])  # fmt: skip
    external = yaml.safe_load(find(rendered, "ConfigMap", "meshlet-prometheus-scrape")["data"]
                              ["scrape-configs.yaml"])  # fmt: skip
    assert own["scrape_configs"] == external
    jobs = [job["job_name"] for job in external]
    assert jobs == [promconf.PROXY_JOB, promconf.CONTROLLER_JOB]  # as the tests' world names them
    relabels = external[1]["relabel_configs"]
    assert relabels[-1]["target_label"] == "component"


def test_promtool_accepts_the_config(rendered: list[dict[str, Any]], tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        if os.environ.get("MESHLET_REQUIRE_NETNS") == "1" or os.environ.get("CI"):
            pytest.fail("promtool is not installed (scripts/system-packages installs it)")
        pytest.skip("promtool is not installed (scripts/system-packages installs it)")
    """Debian's Prometheus is built without Kubernetes service discovery: the jobs'
    `kubernetes_sd_configs` are swapped for empty static ones; the rest is checked as written."""
    doc = yaml.safe_load(
        find(rendered, "ConfigMap", "meshlet-prometheus-config")["data"]["prometheus.yml"]
    )
    for job in doc["scrape_configs"]:
        assert job.pop("kubernetes_sd_configs")[0]["role"] == "pod"
        job["static_configs"] = [{"targets": []}]
    config = yaml.safe_dump(doc)
    (tmp_path / "prometheus.yml").write_text(config)
    done = subprocess.run([promtool, "check", "config", str(tmp_path / "prometheus.yml")],
                          capture_output=True, text=True, timeout=30, check=False)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    broken = tmp_path / "broken.yml"
    broken.write_text(config.replace("scrape_interval", "scrape_intervall", 1))
    refused = subprocess.run([promtool, "check", "config", str(broken)],
                             capture_output=True, text=True, timeout=30, check=False)  # fmt: skip
    assert refused.returncode != 0


def test_meshlet_discovery_is_a_config_debians_prometheus_takes_as_written(
    tmp_path: Path,
) -> None:
    """prometheus.discovery=meshlet: the same jobs, their targets from the destination's HTTP
    discovery (which labels them as the Kubernetes jobs relabel: destination/test_scrape.py),
    so a Prometheus without Kubernetes discovery (Debian's) runs the config unchanged."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (scripts/system-packages installs it)")
    values = yaml.safe_load(pki.VALUES.read_text())
    values["prometheus"] = {"enabled": True, "discovery": "meshlet"}
    manifests = charts.render(charts.CONTROL_PLANE, values, wk.CONTROL_PLANE_NAMESPACE)
    config = find([m.doc for m in manifests], "ConfigMap", "meshlet-prometheus-config")
    text = config["data"]["prometheus.yml"]
    jobs = yaml.safe_load(text)["scrape_configs"]
    base = f"http://meshlet-destination.{wk.CONTROL_PLANE_NAMESPACE}.svc.cluster.local:9996"
    assert [(j["job_name"], j["http_sd_configs"][0]["url"]) for j in jobs] == [
        (promconf.PROXY_JOB, f"{base}/prometheus/proxies"),
        (promconf.CONTROLLER_JOB, f"{base}/prometheus/controllers"),
    ]
    (tmp_path / "prometheus.yml").write_text(text)
    done = subprocess.run([promtool, "check", "config", str(tmp_path / "prometheus.yml")],
                          capture_output=True, text=True, timeout=30, check=False)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_prometheus_deployment(rendered: list[dict[str, Any]]) -> None:
    service = find(rendered, "Service", "meshlet-prometheus")
    assert [(p["port"], p["targetPort"]) for p in service["spec"]["ports"]] == [(9090, "http")]
    spec = find(rendered, "Deployment", "meshlet-prometheus")["spec"]
    assert service["spec"]["selector"].items() <= spec["template"]["metadata"]["labels"].items()
    [container] = spec["template"]["spec"]["containers"]
    assert container["image"] == "docker.io/prom/prometheus:v3.5.0"
    assert "--storage.tsdb.retention.time=6h" in container["args"]
    assert spec["template"]["spec"]["serviceAccountName"] == "meshlet-prometheus"
    role = find(rendered, "ClusterRole", f"meshlet-{wk.CONTROL_PLANE_NAMESPACE}-prometheus")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"],
                              "verbs": ["get", "list", "watch"]}]  # fmt: skip
    # not meshed: it reads the admin ports in plain HTTP
    assert wk.INJECT_ANNOTATION not in (spec["template"]["metadata"].get("annotations") or {})


def test_a_config_change_restarts_it(rendered: list[dict[str, Any]]) -> None:
    def checksum(objects: list[dict[str, Any]]) -> str:
        template = find(objects, "Deployment", "meshlet-prometheus")["spec"]["template"]
        return str(template["metadata"]["annotations"]["checksum/config"])

    values = yaml.safe_load(pki.VALUES.read_text())
    values["prometheus"] = {"enabled": True, "scrapeInterval": "30s"}
    slower = [m.doc for m in charts.render(charts.CONTROL_PLANE, values, "meshlet")]
    assert checksum(slower) != checksum(rendered)


def test_bad_values_are_refused(meshlet: Callable[..., Any]) -> None:
    run = meshlet("install", *FIXED, "--set", "prometheus.retention=forever")
    assert run.code != 0 and "retention" in run.err and "Traceback" not in run.err


def test_the_dashboards_reach_grafanas_sidecar(rendered: list[dict[str, Any]]) -> None:
    config = find(rendered, "ConfigMap", "meshlet-grafana-dashboards")
    assert config["metadata"]["labels"]["grafana_dashboard"] == "1"
    files = sorted(DASHBOARDS.glob("*.json"))
    assert [f.name for f in files] == sorted(config["data"]) and len(files) == 4
    for path in files:
        board = json.loads(config["data"][path.name])
        assert board == json.loads(path.read_text())
        [source] = board["__inputs"]
        assert (source["type"], source["pluginId"]) == ("datasource", "prometheus")
        assert board["uid"] == path.stem and board["id"] is None
        datasources = {json.dumps(p["datasource"]) for p in board["panels"] if "datasource" in p}
        assert datasources == {json.dumps({"type": "prometheus", "uid": "${datasource}"})}
        assert board["templating"]["list"][0]["type"] == "datasource"


def test_the_prometheus_pod_does_not_claim_to_be_meshed(rendered: list[dict[str, Any]]) -> None:
    """meshlet.io/control-plane-ns marks a meshed pod: the destination then tells clients to
    speak mTLS to it. The chart's Prometheus has no proxy (the dashboard got 502s from it on
    the first real cluster while it carried the label)."""
    labels = find(rendered, "Deployment", "meshlet-prometheus")["spec"]["template"]["metadata"][
        "labels"
    ]
    assert wk.CONTROL_PLANE_NS_LABEL not in labels
    assert labels["app.kubernetes.io/part-of"] == "meshlet"
