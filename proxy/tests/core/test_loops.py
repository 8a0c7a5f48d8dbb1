"""Which addresses loop back into the proxy: its own ports, on any address of this host."""

from __future__ import annotations

import pytest

from meshlet.proxy.core.loops import Addr, SelfTargets

POD_IP = "10.0.0.7"
PROXY = SelfTargets([("0.0.0.0", 4140), ("0.0.0.0", 4143), ("127.0.0.1", 4191)])


@pytest.mark.parametrize(
    ("target", "loops"),
    [
        (("127.0.0.1", 4140), True),
        (("127.0.0.53", 4143), True),  # the whole loopback range
        (("::1", 4191), True),
        (("0.0.0.0", 4140), True),  # unspecified: this host
        (("::", 4143), True),
        ((POD_IP, 4143), True),  # the pod's own address
        # the same addresses spelt otherwise: IPv4-mapped IPv6 (a CONNECT to
        # [::ffff:POD_IP]:4140 once tunneled the proxy into itself without end)
        ((f"::ffff:{POD_IP}", 4140), True),
        (("::ffff:a00:7", 4191), True),
        (("::ffff:127.1.2.3", 4143), True),
        (("::ffff:0.0.0.0", 4140), True),
        (("fe80::1%lo", 4140), False),  # a link-local neighbour, zone and all
        (("::ffff:10.0.0.8", 4143), False),
        (("10.0.0.8", 4143), False),  # another pod's proxy: a destination like any other
        ((POD_IP, 8080), False),  # the app's port
        (("127.0.0.1", 8080), False),
        (("web.ns.svc", 4140), False),  # a name is not an address the proxy listens on
    ],
)
def test_only_the_proxys_own_ports_on_this_host_loop(target: Addr, loops: bool) -> None:
    assert PROXY.loops(target, POD_IP) is loops


def test_nothing_loops_before_the_proxy_has_bound_its_ports() -> None:
    assert not SelfTargets([]).loops(("127.0.0.1", 4140), POD_IP)
