"""Routers whose requests all go to one address: every request reaches that address, labelled
by the authority it names (bounded), with the default route's policy and no retry budget."""

from __future__ import annotations

import pytest

from meshlet.api.hostport import HostPort
from meshlet.proxy.core.routes import DEFAULT_ROUTE
from meshlet.proxy.fixed_router import FixedPicker, FixedRouter
from meshlet.proxy.http.contract import Endpoint, RequestTarget, RouteTarget, Target, settle
from meshlet.proxy.metrics import OVERFLOW, BoundedValues, ProxyMetrics

POD = HostPort("10.0.0.7", 8080)


def request(authority: str | None, method: str = "GET", path: str = "/") -> RequestTarget:
    return Target(authority, method, path)


async def routed(router: FixedRouter, authority: str | None) -> tuple[RouteTarget, Endpoint]:
    route = await settle(router.route(request(authority)))
    assert isinstance(route, RouteTarget)
    endpoint = await settle(route.endpoints.pick())
    assert isinstance(endpoint, Endpoint)
    return route, endpoint


async def test_a_fixed_picker_gives_its_endpoint_to_every_attempt() -> None:
    endpoint = Endpoint(POD, "web:8080")
    picker = FixedPicker(endpoint)
    assert [await settle(picker.pick()) for _ in range(3)] == [endpoint] * 3


@pytest.mark.parametrize(
    ("authority", "label"),
    [
        (None, "10.0.0.7:8080"),  # HTTP/1.0 without Host: the address names it
        ("", "10.0.0.7:8080"),
        ("web.emojivoto.svc.cluster.local:8080", "web.emojivoto.svc.cluster.local:8080"),
        ("elsewhere.example:80", "elsewhere.example:80"),  # labelled, but not sent there
    ],
)
async def test_every_request_goes_to_the_target_labelled_by_its_authority(
    authority: str | None, label: str
) -> None:
    router = FixedRouter(POD, ProxyMetrics())
    route, endpoint = await routed(router, authority)
    assert route.dst == label
    assert route.policy == DEFAULT_ROUTE  # no profile: no timeout, no retries, no rt_route
    assert route.budget is None
    assert endpoint.addr == POD
    assert endpoint.authority_label == label
    assert endpoint.connect is None and endpoint.lease is None and endpoint.labels is None


async def test_method_and_path_do_not_change_the_route() -> None:
    router = FixedRouter(POD, ProxyMetrics())
    first = await settle(router.route(request("web:80", "GET", "/a")))
    second = await settle(router.route(request("web:80", "POST", "/b/c?d")))
    assert first == second


async def test_authority_labels_are_bounded() -> None:
    metrics = ProxyMetrics()
    metrics.authority = BoundedValues(limit=3)  # the target's own label takes the first
    router = FixedRouter(POD, metrics)
    labels = [(await routed(router, f"host-{i}:80"))[1].authority_label for i in range(4)]
    assert labels == ["host-0:80", "host-1:80", OVERFLOW, OVERFLOW]
    # Authorities seen before the limit keep their label; every request still reaches POD.
    route, endpoint = await routed(router, "host-1:80")
    assert (route.dst, endpoint.addr) == ("host-1:80", POD)
    route, endpoint = await routed(router, None)
    assert (route.dst, endpoint.addr) == ("10.0.0.7:8080", POD)
