"""`meshlet uninstall`: a reference to every object install creates, namespace last."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import yaml

from meshlet_testing import pki


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
