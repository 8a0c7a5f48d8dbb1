"""Endpoint resolution and the Get stream's deltas, from Kubernetes JSON to wire messages."""

from __future__ import annotations

import pytest

from meshlet.api import addr, destination_pb2
from meshlet.controlplane.destination.paths import ServiceName
from meshlet.controlplane.destination.publisher import EndpointPublisher
from meshlet.controlplane.destination.state import ClusterState
from meshlet.controlplane.k8s import objects
from meshlet.controlplane.k8s.events import DESTINATION_KINDS, Delete, Kind, Snapshot, Upsert

WEB = ServiceName("emojivoto", "web", 80)


def addrs(update: destination_pb2.Update) -> list[tuple[str, int]]:
    kind = update.WhichOneof("update")
    assert kind in ("add", "remove")
    entries = update.add.addrs if kind == "add" else update.remove.addrs
    result = []
    for entry in entries:
        tcp = entry.addr if kind == "add" else entry
        ip, port = addr.tcp_from_proto(tcp)
        result.append((str(ip), port))
    return result


def state_with(*objs: dict, derive: bool = False) -> tuple[ClusterState, EndpointPublisher]:
    state = ClusterState()
    by_kind: dict[Kind, list[dict]] = {k: [] for k in DESTINATION_KINDS}
    for obj in objs:
        kind = Kind.of(obj["apiVersion"], obj["kind"])
        assert kind is not None
        by_kind[kind].append(obj)
    for kind, items in by_kind.items():
        state.apply(Snapshot(kind, tuple(items)))
    return state, EndpointPublisher(WEB, state, derive_from_pods=derive)


def first(publisher: EndpointPublisher) -> list[destination_pb2.Update]:
    from meshlet.controlplane.destination.translator import updates

    return updates(None, publisher.current, {"service": "web", "namespace": "emojivoto"})


def test_unknown_service_says_it_does_not_exist() -> None:
    _, publisher = state_with()
    [message] = first(publisher)
    assert message.WhichOneof("update") == "no_endpoints"
    assert message.no_endpoints.exists is False


def test_service_without_endpoints_exists() -> None:
    _, publisher = state_with(objects.service("web"))
    [message] = first(publisher)
    assert message.no_endpoints.exists is True


def test_first_message_lists_ready_endpoints_with_metadata() -> None:
    _, publisher = state_with(
        objects.service("web"),
        objects.pod("web-1", "10.0.0.1"),
        objects.pod("web-2", "10.0.0.2", meshed=False),
        objects.endpoint_slice(
            "web-abc",
            "web",
            [("10.0.0.1", True, "web-1"), ("10.0.0.2", True, "web-2"), ("10.0.0.3", False, None)],
        ),
    )
    [message] = first(publisher)
    assert addrs(message) == [("10.0.0.1", 8080), ("10.0.0.2", 8080)]
    assert dict(message.add.metric_labels) == {"service": "web", "namespace": "emojivoto"}
    meshed, plain = message.add.addrs
    assert meshed.weight == 10000
    assert dict(meshed.metric_labels) == {
        "pod": "web-1",
        "deployment": "web",
        "serviceaccount": "web",
        "zone": "zone-a",
    }
    name = "web.emojivoto.serviceaccount.identity.meshlet.cluster.local"
    assert meshed.tls_identity.dns_like_identity.name == name
    assert meshed.tls_identity.server_name.name == name
    assert meshed.protocol_hint.WhichOneof("protocol") == "h2"
    assert meshed.protocol_hint.opaque_transport.inbound_port == 4143
    assert not plain.HasField("tls_identity")
    assert not plain.HasField("protocol_hint")


def test_opaque_ports_from_annotations_and_defaults() -> None:
    _, publisher = state_with(
        objects.service("web", ports=[("mysql", 80, 3306)]),
        objects.pod("web-1", "10.0.0.1"),
        objects.endpoint_slice("web-abc", "web", [("10.0.0.1", True, "web-1")],
                               ports=[("mysql", 3306)]),
    )  # fmt: skip
    [message] = first(publisher)
    assert message.add.addrs[0].protocol_hint.WhichOneof("protocol") == "opaque"
    _, publisher = state_with(
        objects.service("web"),
        objects.pod("web-1", "10.0.0.1", annotations={"config.meshlet.io/opaque-ports": "8080"}),
        objects.endpoint_slice("web-abc", "web", [("10.0.0.1", True, "web-1")]),
    )
    [message] = first(publisher)
    assert message.add.addrs[0].protocol_hint.WhichOneof("protocol") == "opaque"


def test_deltas_add_then_remove_then_no_endpoints() -> None:
    state, publisher = state_with(
        objects.service("web"),
        objects.endpoint_slice("web-abc", "web", [("10.0.0.1", True, None)]),
    )
    seen: list[destination_pb2.Update] = []

    class Sink:
        def offer(self, messages: list[bytes]) -> None:
            seen.extend(destination_pb2.Update.FromString(m) for m in messages)

    publisher.listeners.add(Sink())  # type: ignore[arg-type]

    def change(event: Upsert | Delete) -> list[destination_pb2.Update]:
        seen.clear()
        state.apply(event)
        publisher.refresh()
        return list(seen)

    slice_kind = Kind.ENDPOINT_SLICE
    # one more ready endpoint: only it is added
    [added] = change(Upsert(slice_kind, objects.endpoint_slice(
        "web-abc", "web", [("10.0.0.1", True, None), ("10.0.0.2", True, None)])))  # fmt: skip
    assert addrs(added) == [("10.0.0.2", 8080)]
    # readiness flips off: removed
    [removed] = change(Upsert(slice_kind, objects.endpoint_slice(
        "web-abc", "web", [("10.0.0.1", False, None), ("10.0.0.2", True, None)])))  # fmt: skip
    assert removed.WhichOneof("update") == "remove"
    assert addrs(removed) == [("10.0.0.1", 8080)]
    # an unrelated change sends nothing
    assert change(Upsert(Kind.SERVICE, objects.service("other", cluster_ip="10.96.0.11"))) == []
    # the slice disappears: remove the last endpoint, then no_endpoints{exists: true}
    removed, empty = change(Delete(slice_kind, objects.endpoint_slice("web-abc", "web", [])))
    assert addrs(removed) == [("10.0.0.2", 8080)]
    assert empty.no_endpoints.exists is True
    # the service is deleted: no_endpoints{exists: false}
    [gone] = change(Delete(Kind.SERVICE, objects.service("web")))
    assert gone.no_endpoints.exists is False
    # and re-created with an endpoint (the slice comes back): add
    change(Upsert(Kind.SERVICE, objects.service("web")))
    back_slice = objects.endpoint_slice("web-abc", "web", [("10.0.0.9", True, None)])
    [back] = change(Upsert(slice_kind, back_slice))
    assert addrs(back) == [("10.0.0.9", 8080)]


def test_pod_metadata_change_readds_the_endpoint() -> None:
    state, publisher = state_with(
        objects.service("web"),
        objects.pod("web-1", "10.0.0.1", meshed=False),
        objects.endpoint_slice("web-abc", "web", [("10.0.0.1", True, "web-1")]),
    )
    state.apply(Upsert(Kind.POD, objects.pod("web-1", "10.0.0.1", meshed=True)))
    before = publisher.current
    publisher.refresh()
    assert publisher.current != before
    assert publisher.current.endpoints[("10.0.0.1", 8080)].identity is not None


@pytest.mark.parametrize(
    ("target", "expected"),
    [(8080, [("10.0.0.1", 8080)]), ("web", [("10.0.0.1", 9090)])],
)
def test_derived_from_selector_without_slices(target: int | str, expected: list) -> None:
    _, publisher = state_with(
        objects.service("web", ports=[("http", 80, target)]),
        objects.pod("web-1", "10.0.0.1", container_ports=[("web", 9090)]),
        objects.pod("web-2", None),  # not scheduled yet: no IP
        objects.pod("db-1", "10.0.0.5", app="db"),
        derive=True,
    )
    [message] = first(publisher)
    assert addrs(message) == expected


def test_malformed_objects_are_ignored() -> None:
    state, publisher = state_with(
        objects.service("web"),
        objects.endpoint_slice("web-abc", "web", [("not-an-ip", True, None)]),
    )
    bad = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "bad"}, "spec": {"ports": 1}}
    state.apply(Upsert(Kind.SERVICE, bad))
    [message] = first(publisher)
    assert message.no_endpoints.exists is True


def test_a_dual_stack_pod_is_found_by_each_of_its_addresses() -> None:
    """A client proxy that dials a dual-stack pod's IPv6 address asks for that address: the
    profile names the pod's identity, so the connection is mTLS as on IPv4; once the pod is
    gone, neither address answers for it."""
    import ipaddress

    from meshlet.controlplane.destination.paths import IPPort
    from meshlet.controlplane.destination.publisher import ProfilePublisher

    pod = objects.pod("web-1", "10.0.0.1")
    pod["status"]["podIPs"] = [{"ip": "10.0.0.1"}, {"ip": "fd00:10:0:0::1"}]
    state, _ = state_with(pod)
    for ip in ("10.0.0.1", "fd00:10::1"):
        profile = ProfilePublisher(IPPort(ipaddress.ip_address(ip), 8080), state).current
        endpoint = profile.endpoint
        assert str(addr.tcp_from_proto(endpoint.addr)[0]) == ip
        assert endpoint.tls_identity.dns_like_identity.name == (
            "web.emojivoto.serviceaccount.identity.meshlet.cluster.local"
        ), ip
    state.apply(Delete(Kind.POD, pod))
    assert state.pod_at("fd00:10::1") is None and state.pod_at("10.0.0.1") is None
