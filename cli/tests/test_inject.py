"""`meshlet inject`: the annotation, or the injector's patch with --manual; every document
without a pod template is written back byte for byte."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from meshlet.api import wellknown as wk
from meshlet.cli.inject import split
from meshlet.proxy import config as proxy_config
from meshlet_testing import kubelet, pki, schema
from meshlet_testing.fakeapi import FakeKubeAPI

APP = Path(__file__).parent / "data" / "app.yaml"
GOLDEN = Path(__file__).parent / "golden"
OFFLINE = ("--manual", "--ignore-cluster", "--identity-trust-anchors-file", str(pki.TRUST_ANCHORS))


def chunks(text: str) -> list[str]:
    return [chunk for _, chunk in split(text)]


def test_split_joins_back_exactly() -> None:
    text = APP.read_text()
    assert "".join(sep + chunk for sep, chunk in split(text)) == text
    assert len(split(text)) == 6


def test_annotation_only_and_everything_else_byte_for_byte(meshlet: Callable[..., Any]) -> None:
    run = meshlet("inject", str(APP))
    assert run.code == 0, run.err
    before, after = chunks(APP.read_text()), chunks(run.out)
    for index in (0, 2, 4):  # Service, ConfigMap, Secret (as JSON)
        assert after[index] == before[index]
    assert after[5] == before[5]  # the DaemonSet says disabled
    deployment = yaml.safe_load(after[1])
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations == {wk.INJECT_ANNOTATION: wk.INJECT_ENABLED}
    pod = yaml.safe_load(after[3])["items"][0]
    assert pod["metadata"]["annotations"] == {wk.INJECT_ANNOTATION: wk.INJECT_ENABLED}
    assert run.err.splitlines() == [
        'deployment "web" annotated',
        'pod "debug" annotated',
        'daemonset "node-agent" skipped: meshlet.io/inject is disabled',
    ]


def test_manual_offline(meshlet: Callable[..., Any], golden: Callable[[Path, str], None]) -> None:
    run = meshlet("inject", *OFFLINE, str(APP))
    assert run.code == 0, run.err
    golden(GOLDEN / "inject-manual.yaml", run.out)
    before, after = chunks(APP.read_text()), chunks(run.out)
    assert [after[i] for i in (0, 2, 4, 5)] == [before[i] for i in (0, 2, 4, 5)]
    deployment = yaml.safe_load(after[1])
    schema.validate(deployment)
    for item in yaml.safe_load(after[3])["items"]:
        schema.validate(item)
    spec = deployment["spec"]["template"]["spec"]
    proxy = spec["initContainers"][1]
    assert proxy["name"] == wk.PROXY_CONTAINER
    pod = {
        "metadata": {"name": "web-1", "namespace": "emojivoto"},
        "spec": {**spec, "nodeName": "n"},
    }
    assert proxy_config.load(kubelet.container_env(pod, proxy)).identity_local_name == (
        wk.identity_name("web", "emojivoto")
    )
    assert 'deployment "web" injected' in run.err


def test_manual_twice_changes_nothing(meshlet: Callable[..., Any], tmp_path: Path) -> None:
    once = tmp_path / "once.yaml"
    once.write_text(meshlet("inject", *OFFLINE, str(APP)).out)
    twice = meshlet("inject", *OFFLINE, str(once))
    assert twice.out == once.read_text()
    assert 'deployment "web" skipped: already_injected' in twice.err


def test_manual_reads_the_clusters_configuration(
    meshlet: Callable[..., Any], api: FakeKubeAPI, tmp_path: Path
) -> None:
    installed = yaml.safe_load_all(meshlet("install", "--values", str(pki.VALUES),
                                           "--set", "proxy.logLevel=warn").out)  # fmt: skip
    for doc in installed:
        if doc and doc["kind"] in ("Namespace", "ConfigMap"):
            api.apply(doc)
    kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
    run = meshlet("inject", "--manual", "--kubeconfig", str(kubeconfig), str(APP))
    assert run.code == 0, run.err
    proxy = yaml.safe_load(chunks(run.out)[1])["spec"]["template"]["spec"]["initContainers"][1]
    assert {"name": wk.ProxyEnv.LOG, "value": "warn"} in proxy["env"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--manual", "--ignore-cluster"), "--ignore-cluster needs --identity-trust-anchors-file"),
        (("--set", "a=b"), "only apply with --manual"),
        (("--manual", "--set", "a=b"), "need --ignore-cluster"),
    ],
)
def test_usage_errors(args: tuple[str, ...], message: str, meshlet: Callable[..., Any]) -> None:
    run = meshlet("inject", *args, str(APP))
    assert run.code == 64 and message in run.err


def test_not_yaml(meshlet: Callable[..., Any], tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [unclosed\n")
    run = meshlet("inject", str(bad))
    assert run.code == 64 and "not YAML" in run.err


def test_no_cluster(meshlet: Callable[..., Any], unreachable_kubeconfig: Path) -> None:
    kubeconfig = unreachable_kubeconfig
    run = meshlet("inject", "--manual", "--kubeconfig", str(kubeconfig), str(APP))
    assert run.code == 1
    assert "cannot reach the Kubernetes API" in run.err and "Traceback" not in run.err


def test_uninject_gives_back_the_workloads_as_they_were(
    meshlet: Callable[..., Any], tmp_path: Path
) -> None:
    """`meshlet uninject` of what `inject --manual` made: every document as it was before
    injection (containers, volumes, labels, annotations), other documents untouched; a second
    uninject changes nothing; a namespace-level annotation is the user's to remove."""
    meshed = tmp_path / "meshed.yaml"
    meshed.write_text(meshlet("inject", *OFFLINE, str(APP)).out)
    run = meshlet("uninject", str(meshed))
    assert run.code == 0, run.err
    assert [d for d in yaml.safe_load_all(run.out)] == [
        d for d in yaml.safe_load_all(APP.read_text())
    ]
    assert 'deployment "web" uninjected' in run.err
    again = tmp_path / "plain.yaml"
    again.write_text(run.out)
    run = meshlet("uninject", str(again))
    assert run.code == 0 and run.out == again.read_text()
    assert 'deployment "web" not meshed: left as it is' in run.err
