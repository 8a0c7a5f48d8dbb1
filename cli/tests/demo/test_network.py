"""The demo's network as commands: what netns mode builds and takes down."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from meshlet.cli.demo import network, topology
from meshlet.cli.demo.topology import Mode

GOLDEN = Path(__file__).parent / "golden"


def test_plan(golden: Callable[[Path, str], None]) -> None:
    commands = network.plan(topology.layout(Mode.NETNS))
    golden(GOLDEN / "network-plan.txt", "".join(" ".join(argv) + "\n" for argv in commands))


def test_teardown_removes_every_namespace_then_the_bridge() -> None:
    layout = topology.layout(Mode.NETNS)
    names = [m.netns for m in network.members(layout)]
    commands = network.teardown(names, layout.place.bridge)
    assert commands[:-1] == [("ip", "netns", "del", name) for name in names]
    assert commands[-1] == ("ip", "link", "del", topology.BRIDGE)
    built = {argv[3] for argv in network.plan(layout) if argv[:3] == ("ip", "netns", "add")}
    assert built == set(names)


def test_interface_names_fit_the_kernel_limit() -> None:
    for slot in (0, 9, topology.SLOTS - 1):
        place = topology.Place("m" * topology.NAME_MAX if slot else topology.DEFAULT_NAME, slot)
        layout = topology.layout(Mode.NETNS, place)
        for member in network.members(layout):
            assert len(member.veth) <= 15, member.veth
        assert len(place.bridge) <= 15


def test_meshes_in_other_slots_share_no_name_or_address() -> None:
    """Every slot's bridge, namespaces, veths and subnet are its own: two meshes' networks can
    be built side by side, and removing one's touches nothing of the other's."""
    import ipaddress

    seen_names: set[str] = set()
    seen_nets: list[ipaddress.IPv4Network] = []
    for slot in range(topology.SLOTS):
        place = topology.Place(f"m{slot}" if slot else topology.DEFAULT_NAME, slot)
        layout = topology.layout(Mode.NETNS, place)
        ours = made(network.plan(layout))
        assert not ours & seen_names, (slot, ours & seen_names)
        seen_names |= ours
        net = ipaddress.ip_network(layout.cluster_network)
        assert all(not net.overlaps(other) for other in seen_nets), (slot, net)
        assert all(ipaddress.ip_address(p.ip) in net for p in layout.pods)
        seen_nets.append(net)
        netns = [m.netns for m in network.members(layout)]
        removed = {argv[3] for argv in network.teardown(netns, place.bridge)}
        assert removed <= ours
    # the pod meshes of the tests (10.78.0.0/24) are outside every slot's
    assert not any(net.overlaps(ipaddress.ip_network("10.78.0.0/24")) for net in seen_nets)


def made(commands: list[network.Argv]) -> set[str]:
    """The bridge, namespaces and veths that `commands` add."""
    adds = (("ip", "link", "add"), ("ip", "netns", "add"))
    return {argv[3] for argv in commands if argv[:3] in adds}


def test_a_network_of_other_names_made_beside_the_demos() -> None:
    names = network.Names(bridge="az1br", netns_prefix="meshlet-az1-", veth_prefix="az1-")
    layout = topology.layout(Mode.NETNS)
    members = ["control", *(pod.name for pod in layout.pods)]
    ours = made(network.plan(layout, names))
    assert ours == {"az1br", *(f"meshlet-az1-{m}" for m in members), *(f"az1-{m}" for m in members)}
    assert not ours & made(network.plan(layout))
    assert network.teardown(["meshlet-az1-control"], names.bridge) == [
        ("ip", "netns", "del", "meshlet-az1-control"),
        ("ip", "link", "del", "az1br"),
    ]
