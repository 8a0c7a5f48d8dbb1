"""The real `meshlet-controller injector` process: HTTPS with a certificate from the test CA,
AdmissionReviews posted by a real HTTP client, namespaces read from the fake API server."""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonpatch
import pytest

from meshlet.api import wellknown as wk
from meshlet.controlplane.identity import ca
from meshlet_testing import schema
from meshlet_testing.fakeapi import FakeKubeAPI
from meshlet_testing.injectorproc import SERVICE, Injector
from meshlet_testing.sockets import free_port
from meshlet_testing.workloads import pod, review


def controller(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "meshlet.controlplane.main", "injector", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=os.environ.copy(),
    )


def start(test_ca: Any, tmp_path: Path, api: FakeKubeAPI, *extra: str) -> Injector:
    """The injector with the test CA's anchors and a values file, ready."""
    api.apply(
        {
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {"name": "emojivoto", "annotations": {wk.INJECT_ANNOTATION: "enabled"}},
        }
    )
    cert, key = test_ca.serving_cert(SERVICE, tmp_path / "tls")
    config = tmp_path / "values.yaml"
    config.write_text("proxy:\n  logLevel: debug\n")
    port, admin = free_port(), free_port()
    proc = controller(
        "--addr", f"127.0.0.1:{port}",
        "--admin-addr", f"127.0.0.1:{admin}",
        "--tls-cert", str(cert),
        "--tls-key", str(key),
        "--config", str(config),
        "--kubeconfig", str(api.write_kubeconfig(tmp_path / "kubeconfig")),
        *(extra or ("--trust-anchors", str(test_ca.anchors_path))),
    )  # fmt: skip
    deadline = time.monotonic() + 20
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{admin}/ready", timeout=1):
                break
        except OSError:
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "injector never ready"
            time.sleep(0.1)
    return Injector(proc, port, admin, test_ca.anchors_path)


@pytest.fixture
def injector(test_ca: Any, tmp_path: Path, api: FakeKubeAPI) -> Iterator[Injector]:
    running = start(test_ca, tmp_path, api)
    yield running
    if running.proc.poll() is None:
        running.proc.kill()
        running.proc.communicate()


def admitted_anchors(injector: Injector) -> str:
    """The trust anchors the injector gives a pod admitted now."""
    status, body = injector.post(json.dumps(review(pod(None))).encode())
    assert status == 200
    patch = json.loads(base64.b64decode(json.loads(body)["response"]["patch"]))
    meshed = jsonpatch.apply_patch(pod(None), patch)
    proxy = next(c for c in meshed["spec"]["initContainers"] if c["name"] == wk.PROXY_CONTAINER)
    env = {e["name"]: e.get("value") for e in proxy["env"]}
    return str(env[wk.ProxyEnv.IDENTITY_TRUST_ANCHORS])


def copy_in(api: FakeKubeAPI, namespace: str) -> str | None:
    """The bundle in `namespace`'s copy of the trust roots; None without one."""
    copy = api.get("v1", "ConfigMap", wk.TRUST_ROOTS_COPY, namespace)
    if copy is None:
        return None
    assert copy["metadata"]["labels"] == {wk.TRUST_ROOTS_COPY_LABEL: "copy"}
    return str(copy["data"][wk.TRUST_ROOTS_KEY])


def test_a_dry_run_writes_no_copy_and_someone_else_s_configmap_is_left_alone(
    injector: Injector, api: FakeKubeAPI
) -> None:
    request = review(pod({wk.INJECT_ANNOTATION: "enabled"}), namespace="dry")
    request["request"]["dryRun"] = True
    status, body = injector.post(json.dumps(request).encode())
    assert status == 200 and json.loads(body)["response"]["patch"]  # meshed all the same
    assert copy_in(api, "dry") is None
    api.apply({"apiVersion": "v1", "kind": "ConfigMap",
               "metadata": {"name": wk.TRUST_ROOTS_COPY, "namespace": "emojivoto"},
               "data": {"mine": "yes"}})  # fmt: skip
    status, body = injector.post(json.dumps(review(pod(None))).encode())
    response = json.loads(body)["response"]
    assert status == 200 and response["patch"]
    assert any("not meshlet's copy" in w for w in response["warnings"]), response
    mine = api.get("v1", "ConfigMap", wk.TRUST_ROOTS_COPY, "emojivoto")
    assert mine is not None and mine["data"] == {"mine": "yes"}


def test_pods_admitted_after_the_anchors_change_get_the_new_bundle(
    test_ca: Any, tmp_path: Path, api: FakeKubeAPI
) -> None:
    """A step of a rotation (docs/identity.md) reaches the injector's mounted ConfigMap: pods
    admitted from then on get the new bundle, without a restart; a file that is not a bundle
    is not taken."""
    roots = tmp_path / "trust-roots" / "ca-bundle.crt"
    roots.parent.mkdir()
    roots.write_text(test_ca.anchors_pem)
    injector = start(test_ca, tmp_path, api, "--trust-anchors", str(roots),
                     "--reload-interval", "0.1")  # fmt: skip
    try:
        assert admitted_anchors(injector) == test_ca.anchors_pem
        assert copy_in(api, "emojivoto") == test_ca.anchors_pem  # made before the answer
        new, _ = test_ca.new_anchor()
        bundle = ca.cert_pem(test_ca.anchor, new).decode()
        roots.write_text(bundle)
        deadline = time.monotonic() + 10
        while admitted_anchors(injector) != bundle or copy_in(api, "emojivoto") != bundle:
            assert time.monotonic() < deadline, "the new bundle never reached admitted pods"
            time.sleep(0.1)
        roots.write_text("-----BEGIN CERTIFICATE-----\nbroken\n-----END CERTIFICATE-----\n")
        time.sleep(0.5)
        assert admitted_anchors(injector) == bundle and copy_in(api, "emojivoto") == bundle
    finally:
        injector.proc.kill()
        _, err = injector.proc.communicate()
    assert "pods admitted from now on get 2 anchor(s)" in err
    assert "not taken: not a bundle of PEM certificates" in err


def test_answers_admission_reviews_over_tls(injector: Injector) -> None:
    obj = pod(None)  # enabled by its namespace's annotation, read from the API server
    status, body = injector.post(json.dumps(review(obj)).encode())
    assert status == 200
    response = json.loads(body)["response"]
    assert response["uid"] == "705ab4f5-6393-11e8-b7cc-42010a800002"
    assert response["allowed"] is True and response["patchType"] == "JSONPatch"
    meshed = jsonpatch.apply_patch(obj, json.loads(base64.b64decode(response["patch"])))
    schema.validate(meshed)
    proxy = next(c for c in meshed["spec"]["initContainers"] if c["name"] == wk.PROXY_CONTAINER)
    assert {"name": wk.ProxyEnv.LOG, "value": "debug"} in proxy["env"]  # from --config

    status, body = injector.post(
        json.dumps(review(pod({wk.INJECT_ANNOTATION: "disabled"}))).encode()
    )
    assert status == 200 and json.loads(body)["response"] == {
        "uid": "705ab4f5-6393-11e8-b7cc-42010a800002",
        "allowed": True,
    }

    metrics = injector.metrics()
    assert (
        'proxy_inject_admission_responses_total{annotation_at="namespace",owner_kind="deployment",'
        'skip="false",skip_reason=""} 1.0' in metrics
    )
    assert 'skip_reason="injection_disabled"' in metrics


def test_refuses_malformed_and_oversized_reviews(injector: Injector) -> None:
    status, body = injector.post(b"not json at all")
    assert status == 400 and body.startswith(b"the body is not JSON")
    status, body = injector.post(
        b'{"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"}'
    )
    assert (status, body) == (400, b"the review has no request\n")
    status, body = injector.post(b" " * (1024 * 1024 + 1))
    assert status == 413
    # still serving
    status, _ = injector.post(json.dumps(review(pod(None))).encode())
    assert status == 200
    assert 'proxy_inject_admission_rejected_total{code="400"} 2.0' in injector.metrics()


def profile(spec: Any, name: str = "web.emojivoto.svc.cluster.local") -> dict[str, Any]:
    return {
        "apiVersion": "meshlet.io/v1alpha1",
        "kind": "ServiceProfile",
        "metadata": {"name": name, "namespace": "emojivoto"},
        "spec": spec,
    }


def validate(injector: Injector, obj: dict[str, Any], operation: str = "CREATE") -> Any:
    status, body = injector.post(
        json.dumps(review(obj, operation=operation)).encode(), path="/validate"
    )
    assert status == 200, body
    response = json.loads(body)["response"]
    assert response["uid"] == "705ab4f5-6393-11e8-b7cc-42010a800002"
    return response


GOOD_ROUTES = [
    {
        "name": "GET /api/list",
        "condition": {"method": "GET", "pathRegex": "/api/list"},
        "responseClasses": [{"condition": {"status": {"min": 500, "max": 599}}, "isFailure": True}],
        "isRetryable": True,
        "timeout": "300ms",
    }
]


@pytest.mark.parametrize(
    ("obj", "problems"),
    [
        pytest.param(
            profile({"routes": [{"condition": {"method": "GET"}}, {"name": "b"}]}),
            ["spec.routes[0].name: missing", "spec.routes[1].condition: missing"],
            id="required-fields",
        ),
        pytest.param(
            profile({"routes": [{"name": "a", "condition": {"method": "GET"}, "timout": "1s"}],
                     "retryBudget": {"retryRatio": 0.2, "ttl": "10s", "minRetries": 1}}),
            ["spec.routes[0].timout: unknown field", "spec.retryBudget.minRetries: unknown field"],
            id="unknown-fields",
        ),
        pytest.param(
            profile({"routes": [{"name": "a", "condition": {"pathRegex": "(?=x)", "method": "G T"},
                                 "timeout": "5 s"}]}),
            ["spec.routes[0].condition.method: expected an HTTP method",
             "spec.routes[0].condition.pathRegex: invalid regex",
             "spec.routes[0].timeout: invalid duration"],
            id="bad-values",
        ),
        pytest.param(
            profile({"routes": [{"name": "a", "condition": {"method": "GET"}, "responseClasses": [
                {"condition": {"status": {"min": 600}}}, {"condition": {}}]}],
                "retryBudget": {"retryRatio": -1, "ttl": "2m"},
                "dstOverrides": [{"authority": "web-v2:80", "weight": "lots"}]}),
            ["spec.routes[0].responseClasses[0].condition.status.min: expected a status code",
             "spec.routes[0].responseClasses[1].condition: empty condition",
             "spec.retryBudget.retryRatio: expected a number from 0 to 1000",
             "spec.retryBudget.ttl: must be from 1s to 60s",
             "spec.dstOverrides[0].weight: invalid quantity 'lots'"],
            id="out-of-range",
        ),
        pytest.param(
            profile({"routes": "all of them"}, name="Web"),
            ["metadata.name: 'Web' is not a DNS-1123 subdomain", "spec.routes: expected a list"],
            id="wrong-types-and-name",
        ),
    ],
)  # fmt: skip
def test_validates_service_profiles_naming_every_problem(
    injector: Injector, obj: dict[str, Any], problems: list[str]
) -> None:
    assert validate(injector, profile({"routes": GOOD_ROUTES})) == {
        "uid": "705ab4f5-6393-11e8-b7cc-42010a800002",
        "allowed": True,
    }
    for operation in ("CREATE", "UPDATE"):
        response = validate(injector, obj, operation)
        assert response["allowed"] is False
        assert response["status"]["code"] == 400
        message = response["status"]["message"]
        name = obj["metadata"]["name"]
        count = f"{len(problems)} problem" + ("s" if len(problems) > 1 else "")
        assert message.startswith(
            f"ServiceProfile emojivoto/{name} is invalid ({count}; fix each and apply it again): "
        ), message
        parts = message.split(": ", 1)[1].split("; ")
        assert len(parts) == len(problems), parts
        for part, problem in zip(parts, problems, strict=True):
            assert part.startswith(problem), (part, problem)
    metrics = injector.metrics()
    assert (
        'validation_admission_responses_total{allowed="false",kind="ServiceProfile"} 2.0' in metrics
    )
    assert 'validation_admission_responses_total{allowed="true",kind="ServiceProfile"} 1.0' in (
        metrics
    )


def test_validation_leaves_other_kinds_and_deletes_alone(injector: Injector) -> None:
    linkerds = {**profile("junk"), "apiVersion": "linkerd.io/v1alpha2"}
    assert validate(injector, linkerds)["allowed"] is True
    assert validate(injector, pod(None))["allowed"] is True
    assert validate(injector, profile("junk"), "DELETE")["allowed"] is True
    assert 'validation_admission_responses_total{allowed="true",kind="other"} 2.0' in (
        injector.metrics()
    )


def test_validation_refuses_malformed_and_oversized_reviews(injector: Injector) -> None:
    status, body = injector.post(b"<html>not a review</html>", path="/validate")
    assert status == 400 and body.startswith(b"the body is not JSON")
    status, body = injector.post(b'{"kind": "Status"}', path="/validate")
    assert status == 400
    assert body == b"expected an AdmissionReview of apiVersion admission.k8s.io/v1\n"
    big = profile({"routes": [GOOD_ROUTES[0]] * 5000})
    status, body = injector.post(json.dumps(review(big)).encode(), path="/validate")
    assert status == 413 and body == b"the review is larger than 1048576 bytes\n"
    assert validate(injector, profile({}))["allowed"] is True  # still serving
    assert 'proxy_inject_admission_rejected_total{code="413"} 1.0' in injector.metrics()
    _, err = stop(injector)
    assert "Traceback" not in err


def stop(injector: Injector) -> tuple[str, str]:
    injector.proc.send_signal(signal.SIGTERM)
    return injector.proc.communicate(timeout=15)


def test_sigterm_stops_it(injector: Injector) -> None:
    injector.proc.send_signal(signal.SIGTERM)
    _, err = injector.proc.communicate(timeout=15)
    assert injector.proc.returncode == 0, err
    assert "injector shutting down" in err


def test_bad_configuration_exits_64_naming_every_problem(tmp_path: Path, test_ca: Any) -> None:
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate")
    config = tmp_path / "values.yaml"
    config.write_text("proxy:\n  logLevel: loud\n")
    proc = controller(
        "--tls-cert", str(junk), "--tls-key", str(junk),
        "--trust-anchors", str(test_ca.anchors_path), "--config", str(config),
    )  # fmt: skip
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 64
    assert "proxy.logLevel='loud'" in err
    assert "--tls-cert/--tls-key: not a usable certificate and key" in err
    assert "Traceback" not in err


def test_validates_policy_resources_naming_every_problem(injector: Injector) -> None:
    """The policy kinds are judged by the policy controller's own definition of valid."""
    good = {
        "apiVersion": "policy.meshlet.io/v1beta3",
        "kind": "Server",
        "metadata": {"name": "web-http", "namespace": "emojivoto"},
        "spec": {"podSelector": {"matchLabels": {"app": "web"}}, "port": "http"},
    }
    assert validate(injector, good)["allowed"] is True
    bad = {**good, "spec": {"port": 70000, "proxyProtocol": "SPDY"}}
    response = validate(injector, bad)
    assert response["allowed"] is False
    message = response["status"]["message"]
    assert message.startswith("Server emojivoto/web-http is invalid (3 problems"), message
    for field in ("spec.port", "spec.proxyProtocol", "podSelector"):
        assert field in message, (field, message)
    policy = {
        "apiVersion": "policy.meshlet.io/v1alpha1",
        "kind": "AuthorizationPolicy",
        "metadata": {"name": "p", "namespace": "emojivoto"},
        "spec": {"targetRef": {"kind": "Pod", "name": "x"}},
    }
    response = validate(injector, policy, "UPDATE")
    assert response["allowed"] is False
    assert "spec.targetRef" in response["status"]["message"]
    assert "spec.requiredAuthenticationRefs" in response["status"]["message"]
