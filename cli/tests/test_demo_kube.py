"""The demo application as Kubernetes objects (what `make e2e` applies), and the demo image's
entry point, which runs without the CLI's extra."""

from __future__ import annotations

import subprocess
import sys

from meshlet.api import wellknown
from meshlet.cli.demo import kube, topology
from meshlet_testing.schema import validate


def test_every_object_is_valid_kubernetes() -> None:
    objs = kube.manifests("ghcr.io/meshlet/demo:0.1.0")
    for obj in objs:
        if not obj["apiVersion"].startswith("gateway.networking.k8s.io/"):  # a CRD's kind
            validate(obj)
    kinds = [o["kind"] for o in objs]
    assert kinds.count("Deployment") == 7 - 1  # api's two Deployments, one pod each of the rest
    ns = objs[0]
    assert ns["metadata"]["annotations"] == {wellknown.INJECT_ANNOTATION: "enabled"}


def test_replicas_match_the_local_mesh() -> None:
    """Three api replicas (one slower), a canary, web, store and the load: the local mesh's."""
    replicas = {
        o["metadata"]["name"]: o["spec"]["replicas"]
        for o in kube.manifests("x")
        if o["kind"] == "Deployment"
    }
    assert replicas == {"api": 2, "api-slow": 1, topology.CANARY: 1, "store": 1, "web": 1,
                        "load": 1}  # fmt: skip
    api = [o for o in kube.manifests("x") if o["kind"] == "Deployment" and
           o["spec"]["template"]["spec"]["serviceAccountName"] == "api"]  # fmt: skip
    assert len(api) == 2 and all(o["metadata"]["labels"] == {"app": "api"} for o in api)
    services = {o["metadata"]["name"]: o for o in kube.manifests("x") if o["kind"] == "Service"}
    assert services["api"]["spec"]["selector"] == {"app": "api"}
    assert "clusterIP" not in services["api"]["spec"]


def test_the_demo_apps_run_without_the_cli_extra() -> None:
    """The demo image has no rich, helm or jsonpatch: `python -m meshlet.cli.demo.apps` must
    not need them."""
    code = (
        "import runpy, sys\n"
        "for name in ('rich', 'helm', 'jsonpatch', 'kubernetes'):\n"
        "    sys.modules[name] = None\n"
        "sys.argv = ['apps', '--help']\n"
        "runpy.run_module('meshlet.cli.demo.apps', run_name='__main__')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60, check=False)  # fmt: skip
    assert result.returncode == 0, result.stderr
    for app in ("api", "store", "web", "load"):
        assert app in result.stdout


def test_no_demo_app_runs_as_the_proxy() -> None:
    """The rules let the proxy's UID and GID past the proxy: an app running as them would
    never be meshed (its calls would skip its own proxy)."""
    containers = [
        container
        for obj in kube.manifests("x")
        if obj["kind"] == "Deployment"
        for container in obj["spec"]["template"]["spec"]["containers"]
    ]
    assert len(containers) == 6
    for container in containers:
        context = container.get("securityContext") or {}
        assert context.get("runAsUser") not in (None, wellknown.PROXY_UID), container["name"]
        assert context.get("runAsGroup") not in (None, wellknown.PROXY_GID), container["name"]
