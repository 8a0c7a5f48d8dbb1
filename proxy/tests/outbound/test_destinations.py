"""The mesh router over a scripted destination service: what discovery is asked, which endpoint
each pick takes (a pod, a balanced service endpoint, a traffic split), how it is reached, and
when it fails fast. Fixtures: outbound/conftest.py."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from meshlet.api.hostport import HostPort
from meshlet.api.transport_header import SessionProtocol
from meshlet.proxy.core.accrual import FailureAccrual
from meshlet.proxy.core.endpoints import Add, EndpointSet
from meshlet.proxy.discovery.profile import DstOverride, Profile, RetryBudgetSpec
from meshlet.proxy.discovery.resolver import Destination
from meshlet.proxy.http.contract import Endpoint, RouteError, settle
from meshlet.proxy.io.counters import dst_values
from meshlet.proxy.outbound.destinations import MAX_PARENTS, Destinations

HTTP1 = SessionProtocol.HTTP1
NAME = "web.emojivoto.svc.cluster.local"
WEB = f"{NAME}:80"  # the service, as its profile names it
CLUSTER_IP = HostPort("10.96.0.10", 80)


async def picked(mesh: Destinations, destination: Destination | RouteError) -> Endpoint:
    assert isinstance(destination, Destination)
    chosen = await settle(mesh.pick(destination, HTTP1))
    assert isinstance(chosen, Endpoint)
    return chosen


async def test_a_redirected_address_is_looked_up_as_it_is(discovery: Any) -> None:
    ep = discovery.endpoint
    assert discovery.client.service("web", 80, ep("10.1.0.1"), cluster_ip="10.96.0.10") == WEB
    mesh = discovery.mesh()
    destination = await mesh.destination(CLUSTER_IP)
    assert isinstance(destination, Destination)
    assert (destination.kind, destination.target) == ("service", "10.96.0.10:80")
    assert destination.profile is not None and destination.profile.fqn == NAME
    assert discovery.client.asked == ["10.96.0.10:80"]


async def test_what_discovery_does_not_know_is_picked_as_nothing(discovery: Any) -> None:
    mesh = discovery.mesh()
    destination = await mesh.destination(HostPort("192.0.2.1", 443))
    assert isinstance(destination, Destination) and destination.kind == "unknown"
    assert (
        await settle(mesh.pick(destination, HTTP1)) is None
    )  # the caller sends it where it was going


async def test_a_full_resolver_refuses_new_destinations(discovery: Any) -> None:
    mesh = discovery.mesh(max_destinations=1)
    assert isinstance(await mesh.destination(HostPort("192.0.2.1", 80)), Destination)
    refused = await mesh.destination(HostPort("192.0.2.2", 80))
    assert isinstance(refused, RouteError) and refused.status == 503
    assert "discovery already follows 1 destinations" in refused.reason
    by_name = await mesh.destination_for_authority(WEB)
    assert isinstance(by_name, RouteError) and by_name.status == 503
    # A request refused is counted here; a connection refused, by the stack that refuses it.
    assert discovery.fail_fast("discovery_full") == 1


async def test_a_pod_named_by_its_address_is_that_endpoint_unbalanced(discovery: Any) -> None:
    pod = discovery.endpoint("10.1.0.9", 9090, pod="web-9")
    discovery.client.profiles_of["10.1.0.9:9090"] = Profile(endpoint=pod)
    mesh = discovery.mesh()
    destination = await mesh.destination(HostPort("10.1.0.9", 9090))
    assert isinstance(destination, Destination) and destination.kind == "endpoint"
    chosen = await picked(mesh, destination)
    assert chosen.addr == ("10.1.0.9", 9090) and chosen.lease is None
    assert chosen.authority_label == "10.1.0.9:9090" and chosen.connect is None


async def test_a_service_endpoint_is_reached_in_plaintext_with_its_own_labels(
    discovery: Any,
) -> None:
    one = discovery.endpoint("10.1.0.1", pod="web-1")
    discovery.client.service("web", 80, one, cluster_ip="10.96.0.10")
    mesh = discovery.mesh()
    chosen = await picked(mesh, await mesh.destination(CLUSTER_IP))
    assert chosen.addr == ("10.1.0.1", 8080) and chosen.connect is None  # plain TCP
    assert chosen.authority_label == WEB  # the service, not the address asked
    assert chosen.lease is not None  # balanced: the request holds a lease
    assert chosen.labels == discovery.metrics.conn(
        "outbound", "10.1.0.1:8080", dst_values(one.labels),
        no_tls_reason="not_provided_by_service_discovery",
    ).values()  # fmt: skip


async def test_requests_in_flight_are_balanced_over_the_services_endpoints(
    discovery: Any,
) -> None:
    ep = discovery.endpoint
    three = (ep("10.1.0.1"), ep("10.1.0.2"), ep("10.1.0.3"))
    discovery.client.service("web", 80, *three, cluster_ip="10.96.0.10")
    mesh = discovery.mesh()
    destination = await mesh.destination(CLUSTER_IP)
    seen: Counter[str] = Counter()
    for _ in range(30):  # each holds its lease: the endpoints it loads are picked less
        seen[(await picked(mesh, destination)).addr[0]] += 1
    assert set(seen) == {"10.1.0.1", "10.1.0.2", "10.1.0.3"}
    assert max(seen.values()) - min(seen.values()) <= 2


async def test_a_service_without_endpoints_fails_fast_with_503(discovery: Any) -> None:
    discovery.client.service("web", 80, cluster_ip="10.96.0.10")
    mesh = discovery.mesh()
    destination = await mesh.destination(CLUSTER_IP)
    assert await settle(mesh.pick(destination, HTTP1)) == RouteError(503, f"{WEB} has no endpoints")
    assert discovery.fail_fast("no_endpoints") == 1


async def test_a_meshed_endpoint_without_a_certificate_fails_closed_never_plaintext(
    discovery: Any,
) -> None:
    meshed = discovery.endpoint("10.1.0.1", meshed=True)
    discovery.client.service("web", 80, meshed, cluster_ip="10.96.0.10")
    mesh = discovery.mesh()  # no identity
    failed = await settle(mesh.pick(await mesh.destination(CLUSTER_IP), HTTP1))
    assert isinstance(failed, RouteError) and failed.status == 503
    assert "has no certificate yet: not sending it in plaintext" in failed.reason
    assert discovery.fail_fast("no_endpoints") == 1


@pytest.mark.parametrize(
    ("weights", "expected"),
    [
        ((0, 10_000), {"10.2.0.1"}),  # all to the canary
        ((10_000, 0), {"10.1.0.1"}),
        ((0, 0), {"10.1.0.1"}),  # nothing weighs: the first override
        ((5_000, 5_000), {"10.1.0.1", "10.2.0.1"}),
    ],
)
async def test_dst_overrides_split_traffic_between_services_by_weight(
    discovery: Any, weights: tuple[int, int], expected: set[str]
) -> None:
    ep = discovery.endpoint
    canary = discovery.client.service("web-canary", 80, ep("10.2.0.1"))
    overrides = (DstOverride(WEB, weights[0]), DstOverride(canary, weights[1]))
    discovery.client.service("web", 80, ep("10.1.0.1"), cluster_ip="10.96.0.10",
                             dst_overrides=overrides)  # fmt: skip
    mesh = discovery.mesh()
    destination = await mesh.destination(CLUSTER_IP)
    labels: dict[str, str] = {}
    for _ in range(40):
        chosen = await picked(mesh, destination)
        labels[chosen.addr[0]] = chosen.authority_label
    assert set(labels) == expected
    assert labels.get("10.2.0.1", canary) == canary  # labelled by the service it went to
    assert labels.get("10.1.0.1", WEB) == WEB


@pytest.mark.parametrize(
    ("authority", "asked"),
    [
        (WEB, WEB),
        ("WEB.emojivoto.svc.cluster.local.:80", WEB),  # case and a final dot do not matter
        (NAME, WEB),  # the default port
        ("10.96.0.10:80", "10.96.0.10:80"),  # IP literals are always asked
        ("[fd00::1]:8080", "[fd00::1]:8080"),
        # A Service's short names, completed as a pod's DNS search list would
        ("web:80", WEB),  # in the pod's own namespace
        ("web.emojivoto:80", WEB),
        ("Web.emojivoto.svc:80", WEB),
        ("web.other.svc:80", "web.other.svc.cluster.local:80"),
        # Two labels may be a Service in a namespace: asked, as a pod's resolver would ask
        # first; discovery knowing nothing of it, the name as written is resolved by DNS.
        ("example.com:80", "example.com.svc.cluster.local:80"),
        ("www.example.com:80", None),  # three labels, not `.svc`: outside the cluster
        ("svc.cluster.local.evil.example:80", None),
        ("web:http", None),  # malformed
        ("web..emojivoto:80", None),  # an empty label
    ],
)
async def test_which_authorities_discovery_is_asked_about(
    discovery: Any, authority: str, asked: str | None
) -> None:
    discovery.client.service("web", 80, discovery.endpoint("10.1.0.1"))
    mesh = discovery.mesh(namespace="emojivoto")
    destination = await mesh.destination_for_authority(authority)
    if asked is None:
        assert destination is None and discovery.client.asked == []
    else:
        assert isinstance(destination, Destination) and destination.target == asked
        assert discovery.client.asked == [asked]


async def test_a_single_label_name_is_not_asked_about_without_the_pods_namespace(
    discovery: Any,
) -> None:
    discovery.client.service("web", 80, discovery.endpoint("10.1.0.1"))
    mesh = discovery.mesh()
    assert await mesh.destination_for_authority("web:80") is None
    assert discovery.client.asked == []


async def test_a_services_retry_budget_is_shared_and_follows_its_profile(discovery: Any) -> None:
    settings = RetryBudgetSpec(ratio=0.5, min_per_second=10, ttl=100.0)
    discovery.client.service("web", 80, discovery.endpoint("10.1.0.1"), cluster_ip="10.96.0.10",
                             retry_budget=settings)  # fmt: skip
    mesh = discovery.mesh()
    by_ip = await mesh.destination(CLUSTER_IP)
    by_name = await mesh.destination_for_authority(WEB)
    assert isinstance(by_ip, Destination) and isinstance(by_name, Destination)
    budget = mesh.budget_for(by_ip)
    assert budget is not None and budget is mesh.budget_for(by_name)  # one per service
    assert budget.ratio == 0.5
    assert budget.balance(discovery.now) == 600  # 10/s over a ttl clamped to 60 s
    # The profile changes the budget: a destination that carries the change renews it.
    changed = Profile(fqn=NAME, retry_budget=RetryBudgetSpec(0.1, 1, 10.0))
    discovery.client.profiles_of[WEB] = changed
    fresh = await discovery.mesh().destination_for_authority(WEB)  # a new stream sees it
    assert isinstance(fresh, Destination)
    renewed = mesh.budget_for(fresh)
    assert renewed is not None and renewed is not budget and renewed.ratio == 0.1


async def test_only_services_have_a_retry_budget(discovery: Any) -> None:
    pod = discovery.endpoint("10.1.0.9", 9090)
    discovery.client.profiles_of["10.1.0.9:9090"] = Profile(endpoint=pod)
    mesh = discovery.mesh()
    for target in (HostPort("10.1.0.9", 9090), HostPort("192.0.2.1", 80)):
        destination = await mesh.destination(target)
        assert isinstance(destination, Destination)
        assert mesh.budget_for(destination) is None


async def test_failure_accrual_set_for_a_service_applies_to_its_next_pick(discovery: Any) -> None:
    """Set for the service (as its outbound policy will): its endpoint, failing three times in
    a row, is ejected, and with nothing left requests fail fast with the reason; turned off,
    the endpoint is picked again."""
    discovery.client.service("web", 80, discovery.endpoint("10.1.0.1"), cluster_ip="10.96.0.10")
    mesh = discovery.mesh()
    destination = await mesh.destination(CLUSTER_IP)
    (await picked(mesh, destination)).lease.release()  # type: ignore[union-attr]
    mesh.set_failure_accrual(WEB, FailureAccrual(max_failures=3, min_penalty=1.0))
    for _ in range(3):
        lease = (await picked(mesh, destination)).lease
        assert lease is not None
        lease.outcome(False)
        lease.release()
    refused = await settle(mesh.pick(destination, HTTP1))
    assert isinstance(refused, RouteError) and refused.status == 503
    assert refused.reason.startswith(f"{WEB}: all 1 endpoint failed too often in a row")
    assert discovery.fail_fast("all_endpoints_ejected") == 1
    mesh.set_failure_accrual(WEB, None)
    assert (await picked(mesh, destination)).addr == ("10.1.0.1", 8080)


async def test_a_balancer_is_reported_under_each_parent_routing_to_it_up_to_a_bound(
    discovery: Any,
) -> None:
    """Linkerd's `outbound_http_balancer_endpoints` names the parent Service and the backend:
    the service as its own parent until an outbound policy routes some parent to it, then each
    such parent, at most MAX_PARENTS of them."""
    discovery.client.service("web", 80, discovery.endpoint("10.1.0.1"), cluster_ip="10.96.0.10")
    mesh = discovery.mesh()
    (await picked(mesh, await mesh.destination(CLUSTER_IP))).lease.release()  # type: ignore[union-attr]

    def parents(state: str = "ready") -> dict[str, float]:
        return {
            sample.labels["parent_name"]: sample.value
            for family in mesh.collect()
            for sample in family.samples
            if sample.labels["endpoint_state"] == state and sample.labels["backend_name"] == "web"
        }

    assert parents() == {"web": 1} and parents("pending") == {"web": 0}
    for n in range(MAX_PARENTS + 20):
        mesh.route_parent(WEB, {"parent_kind": "Service", "parent_name": f"app-{n}"})
    mesh.route_parent(WEB, {"parent_kind": "Service", "parent_name": "app-0"})  # once
    assert parents() == {f"app-{n}": 1 for n in range(MAX_PARENTS)}


async def test_the_service_asked_by_name_and_by_address_balances_over_its_own_endpoints(
    discovery: Any,
) -> None:
    """Two destinations, the Service by its name and by its cluster IP, share one authority
    and so one balancer, while each follows its own stream, whose versions count separately.
    On a real cluster a replaced pod left the balancer on the other's endpoints at an equal
    version: it leased the gone pod, which the picking destination no longer had (KeyError,
    a 502)."""
    old, new = discovery.endpoint("10.1.0.1"), discovery.endpoint("10.1.0.2")
    discovery.client.service("web", 80, old, cluster_ip="10.96.0.10")
    mesh = discovery.mesh()
    by_name = await mesh.destination_for_authority(WEB)
    by_address = await mesh.destination(CLUSTER_IP)
    assert isinstance(by_name, Destination) and isinstance(by_address, Destination)
    assert (await picked(mesh, by_name)).addr[0] == "10.1.0.1"
    # The pod was replaced: the address's stream has the new pod at the version the name's
    # stream had the old one.
    replaced = EndpointSet(version=by_name.endpoints.version - 1).apply(Add((new,)), first=True)
    assert replaced.version == by_name.endpoints.version
    by_address._endpoints = replaced
    assert (await picked(mesh, by_address)).addr[0] == "10.1.0.2"
    assert (await picked(mesh, by_name)).addr[0] == "10.1.0.1"
