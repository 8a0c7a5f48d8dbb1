"""`meshlet uninstall`: a reference to every object install creates, namespace last."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from meshlet_testing import pki
from meshlet_testing.fakeapi import FakeKubeAPI


def refs(text: str) -> list[tuple[str, str]]:
    return [(d["kind"], d["metadata"]["name"]) for d in yaml.safe_load_all(text) if d]


def test_every_installed_object_is_named(meshlet: Callable[..., Any]) -> None:
    """Whichever options install was given: the chart's Prometheus and dashboards too (a
    ClusterRole of the Prometheus' was left behind on the first real cluster), and --ha's
    disruption budgets."""
    every = "prometheus.enabled=true,prometheus.scrapeConfig=true,grafana.dashboards=true"
    installed = refs(meshlet("install", "--ha", "--values", str(pki.VALUES), "--set", every).out)
    removed = refs(meshlet("uninstall").out)
    assert sorted(removed) == sorted(installed)
    assert set(refs(meshlet("install", "--values", str(pki.VALUES)).out)) < set(removed)
    assert removed[-1] == ("Namespace", "meshlet")
    with_crds = refs(meshlet("uninstall", "--crds").out)
    assert ("CustomResourceDefinition", "serviceprofiles.meshlet.io") in with_crds


def test_the_namespaces_copies_of_the_trust_roots_are_named_from_the_cluster(
    meshlet: Callable[..., Any], api: FakeKubeAPI, tmp_path: Path, unreachable_kubeconfig: Path
) -> None:
    """The injector's copies (labelled meshlet.io/trust-roots: copy) in meshed namespaces, read
    from the cluster; a ConfigMap of that name that is not a copy is left alone."""

    def configmap(namespace: str, labels: dict[str, str]) -> dict[str, Any]:
        return {"apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": "meshlet-trust-roots", "namespace": namespace,
                             "labels": labels}, "data": {"ca-bundle.crt": "x"}}  # fmt: skip

    for namespace in ("shop", "meshlet"):
        api.apply(configmap(namespace, {"meshlet.io/trust-roots": "copy"}))
    api.apply(configmap("other", {}))
    kubeconfig = str(api.write_kubeconfig(tmp_path / "fake.kubeconfig"))
    removed = yaml.safe_load_all(meshlet("uninstall", "--kubeconfig", kubeconfig).out)
    copies = [d["metadata"] for d in removed if d and d["kind"] == "ConfigMap"
              and d["metadata"]["name"] == "meshlet-trust-roots"]  # fmt: skip
    assert sorted(m["namespace"] for m in copies) == ["meshlet", "shop"]  # meshlet's: the chart's

    unreachable = meshlet("uninstall", "--kubeconfig", str(unreachable_kubeconfig))
    assert unreachable.code == 0 and "kubectl delete configmap -A -l meshlet.io/trust-roots=copy" \
        in unreachable.err  # fmt: skip
    assert refs(unreachable.out) == refs(meshlet("uninstall").out)
