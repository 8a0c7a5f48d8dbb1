"""The pure judgement of `meshlet check` on snapshots the fake cluster cannot easily produce."""

from __future__ import annotations

import base64
import datetime as dt
from typing import Any

import yaml

from meshlet.api import wellknown as wk
from meshlet.cli.checks import POLICY_CRDS, Snapshot, Status, evaluate
from meshlet.controlplane.injector import tls
from meshlet_testing import pki

NOW = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
VALUES = yaml.safe_load(pki.VALUES.read_text())


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def webhook(ca_bundle: str, failure_policy: str = "Ignore") -> dict[str, Any]:
    service = {"name": wk.INJECTOR_NAME, "namespace": "meshlet"}
    hook = {
        "failurePolicy": failure_policy,
        "clientConfig": {"service": service, "caBundle": b64(ca_bundle)},
    }
    return {"webhooks": [hook]}


def validator(ca_bundle: str, path: str = wk.INJECTOR_VALIDATE_PATH) -> dict[str, Any]:
    service = {"name": wk.INJECTOR_NAME, "namespace": "meshlet", "path": path}
    return {"webhooks": [{"clientConfig": {"service": service, "caBundle": b64(ca_bundle)}}]}


def snapshot(**changes: Any) -> Snapshot:
    injector = VALUES["proxyInjector"]
    base: dict[str, Any] = {
        "namespace": "meshlet",
        "version": {"major": "1", "minor": "33", "gitVersion": "v1.33.1"},
        "control_namespace": {"metadata": {"name": "meshlet"}},
        "crd": {},
        "deployments": {
            name: {} for name in (wk.DESTINATION_NAME, wk.IDENTITY_NAME, wk.INJECTOR_NAME)
        },
        "pods": tuple(
            {
                "metadata": {"labels": {wk.CONTROL_PLANE_COMPONENT_LABEL: c}},
                "status": {"conditions": [{"type": "Ready", "status": "True"}]},
            }
            for c in ("destination", "identity", "proxy-injector")
        ),
        "issuer_secret": {
            "data": {
                wk.ISSUER_CERT_KEY: b64(pki.ISSUER_CRT.read_text()),
                wk.ISSUER_KEY_KEY: b64(pki.ISSUER_KEY.read_text()),
            }
        },
        "trust_roots": {"data": {wk.TRUST_ROOTS_KEY: pki.anchors_pem()}},
        "webhook": webhook(injector["caBundle"]),
        "validator": validator(injector["caBundle"]),
        "webhook_secret": {"data": {"tls.crt": b64(injector["crtPEM"])}},
        "policy_crds": frozenset(POLICY_CRDS),
        "policy_deployment": {"spec": {"replicas": 2}, "status": {"readyReplicas": 2}},
        "policy_ready": {"meshlet-policy-a": "", "meshlet-policy-b": ""},
    }
    base.update(changes)
    return Snapshot(**base)


def outcome(s: Snapshot) -> dict[str, tuple[Status, str]]:
    return {r.description: (r.status, r.error) for r in evaluate(s, NOW)}


def test_the_fixed_pki_is_healthy() -> None:
    assert {status for status, _ in outcome(snapshot()).values()} == {Status.SUCCESS}


def test_a_webhook_certificate_from_another_ca() -> None:
    other = tls.webhook_certificate("meshlet", NOW)
    result = outcome(snapshot(webhook=webhook(other.ca_pem)))
    assert result["proxy-injector webhook certificate is valid"] == (
        Status.ERROR,
        "the webhook certificate is not signed by the webhook's caBundle",
    )


def test_a_webhook_certificate_for_another_namespace() -> None:
    other = tls.webhook_certificate("elsewhere", NOW)
    result = outcome(
        snapshot(
            webhook=webhook(other.ca_pem), webhook_secret={"data": {"tls.crt": b64(other.cert_pem)}}
        )
    )
    status, error = result["proxy-injector webhook certificate is valid"]
    assert status is Status.ERROR and "not for meshlet-proxy-injector.meshlet.svc" in error


EXCLUDING = {"matchExpressions": [{"key": "kubernetes.io/metadata.name", "operator": "NotIn",
                                    "values": ["kube-system", "meshlet"]}]}  # fmt: skip


def test_failure_policy_fail_over_kube_system_or_the_control_plane_is_an_error() -> None:
    """A webhook that fails closed must leave out the namespaces whose pods bring it back."""
    hook = webhook(VALUES["proxyInjector"]["caBundle"], failure_policy="Fail")
    status, error = outcome(snapshot(webhook=hook))["proxy-injector webhook is configured"]
    assert status is Status.ERROR, error
    assert "the webhook selects meshlet, kube-system: a down injector blocks" in error
    only_own = {"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": ["meshlet"]}
    hook["webhooks"][0]["namespaceSelector"] = {"matchExpressions": [only_own]}
    status, error = outcome(snapshot(webhook=hook))["proxy-injector webhook is configured"]
    assert status is Status.ERROR
    assert error.startswith("failurePolicy is Fail and the webhook selects kube-system:")
    hook["webhooks"][0]["namespaceSelector"] = EXCLUDING
    assert outcome(snapshot(webhook=hook))["proxy-injector webhook is configured"][0] is (
        Status.SUCCESS
    )


def ha_snapshot(replicas: int = 3, nodes: int = 3, allowed: int = 1, **changes: Any) -> Snapshot:
    """A control plane installed with --ha: each controller's Deployment, pods on `nodes`
    nodes, a budget each allowing `allowed` disruptions, the webhook failing closed."""
    from meshlet.cli.checks import CONTROLLERS

    hook = webhook(VALUES["proxyInjector"]["caBundle"], failure_policy="Fail")
    hook["webhooks"][0]["namespaceSelector"] = EXCLUDING
    ready = {"conditions": [{"type": "Ready", "status": "True"}]}
    base: dict[str, Any] = {
        "webhook": hook,
        "deployments": {name: {"spec": {"replicas": replicas},
                               "status": {"readyReplicas": replicas}}
                        for name in CONTROLLERS},
        "pods": tuple(
            {"metadata": {"labels": {wk.CONTROL_PLANE_COMPONENT_LABEL: c}},
             "spec": {"nodeName": f"node-{i % nodes}"}, "status": ready}
            for c in CONTROLLERS.values() for i in range(replicas)
        ),
        "disruption_budgets": tuple(
            {"spec": {"maxUnavailable": 1,
                      "selector": {"matchLabels": {wk.CONTROL_PLANE_COMPONENT_LABEL: c}}},
             "status": {"disruptionsAllowed": allowed, "currentHealthy": replicas,
                        "expectedPods": replicas}}
            for c in CONTROLLERS.values()
        ),
    }  # fmt: skip
    base.update(changes)
    return snapshot(**base)


HA_CHECKS = (
    "controllers have more than one replica ready",
    "each controller has a PodDisruptionBudget that allows a drain",
    "controller replicas are on distinct nodes",
    "the proxy injector refuses pods while it is down",
)


def test_the_ha_checks_run_only_for_an_ha_control_plane_and_pass_on_three_nodes() -> None:
    assert not set(HA_CHECKS) & set(outcome(snapshot()))
    result = outcome(ha_snapshot())
    assert {result[c] for c in HA_CHECKS} == {(Status.SUCCESS, "")}
    assert {status for status, _ in result.values()} == {Status.SUCCESS}


def test_the_ha_checks_name_what_a_single_node_and_a_budget_at_zero_leave_exposed() -> None:
    result = outcome(ha_snapshot(nodes=1, allowed=0))
    status, error = result["controller replicas are on distinct nodes"]
    assert status is Status.WARNING
    assert "meshlet-destination: 3 pods on 1 node(s)" in error and "meshlet-tap" in error
    status, error = result["each controller has a PodDisruptionBudget that allows a drain"]
    assert status is Status.WARNING
    assert "meshlet-identity: no disruption allowed now (3 of 3 healthy)" in error


def test_the_ha_checks_name_a_controller_without_a_budget_or_a_second_replica() -> None:
    s = ha_snapshot()
    deployments = dict(s.deployments)
    deployments[wk.TAP_NAME] = {"spec": {"replicas": 3}, "status": {"readyReplicas": 1}}
    result = outcome(ha_snapshot(deployments=deployments,
                                 disruption_budgets=s.disruption_budgets[:4]))  # fmt: skip
    assert result["controllers have more than one replica ready"] == (
        Status.WARNING, f"{wk.TAP_NAME}: 1 of 3 ready")  # fmt: skip
    assert result["each controller has a PodDisruptionBudget that allows a drain"] == (
        Status.WARNING, f"{wk.TAP_NAME}: no PodDisruptionBudget")  # fmt: skip


def test_an_ha_control_plane_whose_webhook_ignores_failures_is_warned_about() -> None:
    hook = webhook(VALUES["proxyInjector"]["caBundle"], failure_policy="Ignore")
    status, error = outcome(ha_snapshot(webhook=hook))[
        "the proxy injector refuses pods while it is down"]  # fmt: skip
    assert status is Status.WARNING and "starts unmeshed" in error


def test_a_missing_control_plane_pod_ends_the_check() -> None:
    result = outcome(snapshot(pods=snapshot().pods[:2]))
    assert result["control plane pods are ready"] == (Status.ERROR, "no proxy-injector pod")
    assert "issuer certificate is issued by the trust anchors" not in result


def test_a_proxy_not_ready() -> None:
    pod = {
        "metadata": {"name": "web-1", "namespace": "emojivoto", "annotations": {}},
        "status": {"initContainerStatuses": [{"name": wk.PROXY_CONTAINER, "ready": False}]},
    }
    result = outcome(snapshot(data_plane=(pod,)))
    assert result["data plane proxies are ready"] == (
        Status.ERROR,
        "proxies not ready: emojivoto/web-1",
    )


def test_the_validating_webhook_is_checked() -> None:
    ca_bundle = VALUES["proxyInjector"]["caBundle"]
    check = "validating webhook is configured"
    assert outcome(snapshot(validator=None))[check] == (
        Status.ERROR,
        "ValidatingWebhookConfiguration not found",
    )
    assert outcome(snapshot(validator=validator(ca_bundle, "/inject")))[check] == (
        Status.ERROR,
        "the validating webhook calls meshlet/meshlet-proxy-injector at /inject",
    )
    other = tls.webhook_certificate("meshlet", NOW)
    assert outcome(snapshot(validator=validator(other.ca_pem)))[check] == (
        Status.ERROR,
        "the webhook certificate is not signed by the validating webhook's caBundle",
    )


def test_one_ready_policy_controller_is_enough() -> None:
    """Proxies reach any replica through the Service: one answering /ready serves them."""
    judged = outcome(snapshot(
        policy_deployment={"spec": {"replicas": 2}, "status": {"readyReplicas": 1}},
        policy_ready={"meshlet-policy-a": "/ready: 503 Service Unavailable",
                      "meshlet-policy-b": ""},
    ))  # fmt: skip
    assert judged["policy controller Deployment is ready (1 of 2 ready)"][0] is Status.SUCCESS
    assert judged["policy controller answers on its admin /ready"][0] is Status.SUCCESS
    judged = outcome(snapshot(policy_ready={}))
    assert judged["policy controller answers on its admin /ready"] == (
        Status.ERROR,
        "no running policy controller pod",
    )


def test_a_policy_crd_that_cannot_be_read_says_why() -> None:
    name = POLICY_CRDS[0]
    judged = outcome(snapshot(policy_crds=frozenset(POLICY_CRDS[1:]),
                              errors={name: "403 Forbidden"}))  # fmt: skip
    assert judged["policy CRDs are installed"] == (Status.ERROR, "403 Forbidden")


def test_the_gateway_api_route_crds_are_required_too() -> None:
    """The policy controller watches them: without them it never becomes ready."""
    gateway = {n for n in POLICY_CRDS if n.endswith(".gateway.networking.k8s.io")}
    judged = outcome(snapshot(policy_crds=frozenset(POLICY_CRDS) - gateway))
    assert judged["policy CRDs are installed"] == (
        Status.ERROR,
        "CustomResourceDefinitions not found: httproutes.gateway.networking.k8s.io,"
        " grpcroutes.gateway.networking.k8s.io",
    )


def http_route(name: str, parent: str = "web", status: list[dict[str, Any]] | None = None,
               ) -> dict[str, Any]:  # fmt: skip
    return {
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "HTTPRoute",
        "metadata": {"name": name, "namespace": "shop"},
        "spec": {"parentRefs": [{"group": "core", "kind": "Service", "name": parent}]},
        "status": {"parents": status or []},
    }


def ours(*conditions: tuple[str, str, str, str]) -> list[dict[str, Any]]:
    return [{
        "parentRef": {"group": "core", "kind": "Service", "namespace": "shop", "name": "web"},
        "controllerName": wk.POLICY_CONTROLLER_NAME,
        "conditions": [{"type": t, "status": s, "reason": r, "message": m}
                       for t, s, r, m in conditions],
    }]  # fmt: skip


GOOD = ours(("Accepted", "True", "Accepted", ""), ("ResolvedRefs", "True", "ResolvedRefs", ""))
ACCEPTED = "routes are accepted by the policy controller"
SHADOWED = "no route is shadowed by a ServiceProfile"


def test_routes_that_are_not_accepted_warn_and_say_why() -> None:
    routes = (
        http_route("good", status=GOOD),
        http_route("orphan", "nope", ours(("Accepted", "False", "NoMatchingParent",
                                           "Service shop/nope not found"))),
        http_route("canary", status=ours(("Accepted", "True", "Accepted", ""),
                                         ("ResolvedRefs", "False", "BackendNotFound",
                                          "Service shop/web-v2 not found"))),
        http_route("fresh"),
        {**http_route("gateway-only"), "spec": {"parentRefs": [{"kind": "Gateway", "name": "e"}]}},
    )  # fmt: skip
    results = {r.description: r for r in evaluate(snapshot(routes=routes), NOW)}
    found = results[ACCEPTED]
    assert found.status is Status.WARNING
    assert found.error.split("; ") == [
        "HTTPRoute.gateway.networking.k8s.io shop/orphan on Service shop/web: Accepted False"
        " (NoMatchingParent): Service shop/nope not found",
        "HTTPRoute.gateway.networking.k8s.io shop/canary on Service shop/web: ResolvedRefs False"
        " (BackendNotFound): Service shop/web-v2 not found",
        "HTTPRoute.gateway.networking.k8s.io shop/fresh: no status from the policy controller yet",
    ]
    assert "kubectl -n NAMESPACE get httproute NAME -o yaml" in found.hint
    healthy = outcome(snapshot(routes=(http_route("good", status=GOOD),)))
    assert healthy[f"{ACCEPTED} (1 routes)"] == (Status.SUCCESS, "")


def test_a_route_shadowed_by_a_service_profile_warns() -> None:
    routed = {"routes": [{"name": "GET /", "condition": {"method": "GET"}}]}
    profile = {"metadata": {"namespace": "shop", "name": "web.shop.svc.cluster.local"},
               "spec": routed}  # fmt: skip
    other = {"metadata": {"namespace": "shop", "name": "api.shop.svc.cluster.local"},
             "spec": {"dstOverrides": [{"authority": "api-v2.shop.svc.cluster.local:80",
                                        "weight": 1}]}}  # fmt: skip
    empty = {**profile, "spec": {"routes": []}}
    routes = (http_route("good", status=GOOD), http_route("to-api", "api", GOOD))
    results = {r.description: r for r in evaluate(snapshot(routes=routes, profiles=(profile,)),
                                                   NOW)}  # fmt: skip
    found = results[SHADOWED]
    assert (found.status, found.error) == (
        Status.WARNING,
        "HTTPRoute.gateway.networking.k8s.io shop/good: ServiceProfile"
        " shop/web.shop.svc.cluster.local (with routes or dstOverrides) is used instead",
    )
    assert "delete the ServiceProfile" in found.hint
    clear = outcome(snapshot(routes=routes, profiles=(other,)))
    assert clear[SHADOWED][0] is Status.WARNING  # to-api is shadowed by api's profile
    assert outcome(snapshot(routes=routes[:1], profiles=(other, empty)))[SHADOWED] == (
        Status.SUCCESS, "",
    )  # fmt: skip


def test_routes_that_cannot_be_listed_warn_with_the_reason() -> None:
    found = outcome(snapshot(errors={"routes": "403 Forbidden"}))
    assert found[ACCEPTED] == (Status.WARNING, "403 Forbidden")


def test_an_issuer_in_a_cert_manager_secret_is_checked_as_one_in_meshlets() -> None:
    """identity.issuer.scheme kubernetes.io/tls: the issuer's certificate in tls.crt."""
    secret = {
        "type": "kubernetes.io/tls",
        "data": {"tls.crt": b64(pki.ISSUER_CRT.read_text()),
                 "tls.key": b64(pki.ISSUER_KEY.read_text())},
    }  # fmt: skip
    result = outcome(snapshot(issuer_secret=secret))
    assert result["issuer certificate is issued by the trust anchors"] == (Status.SUCCESS, "")
    missing = outcome(snapshot(issuer_secret=None))[
        "issuer certificate is issued by the trust anchors"
    ]
    assert missing[0] is Status.ERROR and "has cert-manager issued its Certificate?" in missing[1]


def _daemonset(ready: int, wanted: int) -> dict[str, Any]:
    return {"metadata": {"namespace": "meshlet-cni", "name": "meshlet-cni"},
            "status": {"desiredNumberScheduled": wanted, "numberReady": ready}}  # fmt: skip


def test_the_cni_checks_run_only_with_cni_enabled_and_name_what_is_missing() -> None:
    assert not any("meshlet-cni" in d for d in outcome(snapshot()))
    ok = outcome(snapshot(cni_enabled=True, cni_daemonsets=(_daemonset(3, 3),)))
    assert ok["meshlet-cni is ready on every node (3 nodes)"] == (Status.SUCCESS, "")
    assert ok["no meshed pod is held by its network validator"] == (Status.SUCCESS, "")

    missing = outcome(snapshot(cni_enabled=True))
    status, error = missing["meshlet-cni DaemonSet exists"]
    assert status is Status.ERROR and "fails its validator" in error
    assert "meshlet-cni is ready on every node" not in " ".join(missing)  # the category stops

    short = outcome(snapshot(cni_enabled=True, cni_daemonsets=(_daemonset(1, 2),)))
    assert short["meshlet-cni is ready on every node"] == (
        Status.ERROR,
        "meshlet-cni/meshlet-cni: 1 of 2 nodes ready: pods made on the others are not redirected",
    )


def test_a_pod_held_by_its_validator_is_named() -> None:
    def pod(name: str, exit_code: int, ready: bool) -> dict[str, Any]:
        validator = {"name": wk.VALIDATOR_CONTAINER, "ready": ready,
                     "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                     "lastState": {"terminated": {"exitCode": exit_code}}}  # fmt: skip
        proxy = {"name": wk.PROXY_CONTAINER, "ready": True}
        return {"metadata": {"name": name, "namespace": "shop", "annotations": {}},
                "status": {"initContainerStatuses": [validator, proxy]}}  # fmt: skip

    pods = (pod("web-1", 1, False), pod("web-2", 0, True))
    held = outcome(snapshot(cni_enabled=True, cni_daemonsets=(_daemonset(1, 1),), data_plane=pods))
    status, error = held["no meshed pod is held by its network validator"]
    assert (
        status is Status.ERROR and error == "not redirected, held by their validators: shop/web-1"
    )
