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
    commands = network.teardown(names)
    assert commands[:-1] == [("ip", "netns", "del", name) for name in names]
    assert commands[-1] == ("ip", "link", "del", topology.BRIDGE)
    built = {argv[3] for argv in network.plan(layout) if argv[:3] == ("ip", "netns", "add")}
    assert built == set(names)


def test_interface_names_fit_the_kernel_limit() -> None:
    for member in network.members(topology.layout(Mode.NETNS)):
        assert len(member.veth) <= 15, member.veth


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
    assert network.teardown(["meshlet-az1-control"], names) == [
        ("ip", "netns", "del", "meshlet-az1-control"),
        ("ip", "link", "del", "az1br"),
    ]
