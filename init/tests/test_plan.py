"""The iptables plan: golden output for several configurations, the order of DESIGN §7, comments."""

from __future__ import annotations

from collections.abc import Callable
from ipaddress import IPv4Network
from pathlib import Path

import pytest

from meshlet.api.ports import parse_ports
from meshlet.init.plan import (
    ALWAYS_SKIPPED_INBOUND,
    COMMENT_PREFIX,
    OUTPUT_CHAIN,
    REDIRECT_CHAIN,
    InitConfig,
    plan,
)

GOLDEN = Path(__file__).parent / "golden"

CONFIGS = {
    "default": InitConfig(),
    # the local mesh: the proxy keeps its UID and runs with GID 2102 (DESIGN §7)
    "gid-and-skips": InitConfig(
        proxy_gid=2102,
        skip_inbound_ports=ALWAYS_SKIPPED_INBOUND.union(parse_ports("22")),
        skip_outbound_ports=parse_ports("443,5000-5010"),
    ),
    "subnets-and-ports": InitConfig(
        inbound_port=14143,
        outbound_port=14140,
        proxy_uid=1337,
        proxy_gid=1338,
        skip_inbound_ports=ALWAYS_SKIPPED_INBOUND.union(parse_ports("8000-8010")),
        skip_outbound_ports=parse_ports("25,587"),
        skip_subnets=(IPv4Network("10.96.0.0/12"), IPv4Network("192.0.2.7/32")),
    ),
    # 17 single ports and three ranges (23 multiport slots): split over two matches
    "long-port-lists": InitConfig(
        skip_outbound_ports=parse_ports(
            ",".join(str(p) for p in range(1000, 1017)) + ",2000-2010,3000-3001,4000-4100"
        ),
    ),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_golden(name: str, golden: Callable[[Path, str], None]) -> None:
    golden(GOLDEN / f"plan-{name}.rules", "\n".join(plan(CONFIGS[name]).lines()) + "\n")


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_rule_is_commented_with_its_purpose(name: str) -> None:
    every = plan(CONFIGS[name])
    for rule in (*every.rules, *every.jumps):
        assert rule.comment.startswith(COMMENT_PREFIX) and rule.purpose
        assert f'-m comment --comment "{rule.comment}" -j {rule.target}' in rule.render()
        assert len(rule.comment) < 256  # the comment match keeps 255 bytes


def test_output_chain_order() -> None:
    """UID, GID, loopback, subnets, ports, then the redirect: the proxy's own traffic must
    return before anything can send it back to the proxy."""
    config = CONFIGS["subnets-and-ports"]
    purposes = [r.purpose for r in plan(config).rules if r.chain == OUTPUT_CHAIN]
    assert purposes == [
        "ignore-proxy-uid",
        "ignore-proxy-gid",
        "ignore-loopback",
        "ignore-subnet-10.96.0.0/12",
        "ignore-subnet-192.0.2.7/32",
        "ignore-outbound-ports-25,587",
        "redirect-all-outgoing-to-proxy-port",
    ]
    assert "--to-ports 14140" in plan(config).rules[-1].render()


def test_no_gid_rule_without_a_gid() -> None:
    assert not any("gid-owner" in r.render() for r in plan(InitConfig()).rules)


def test_inbound_chain_skips_then_redirects() -> None:
    rules = plan(CONFIGS["subnets-and-ports"]).rules
    assert [r.render() for r in rules if r.chain == REDIRECT_CHAIN] == [
        f"-A {REDIRECT_CHAIN} -p tcp -m multiport --dports 4190,4191,8000:8010 -m comment"
        ' --comment "meshlet-init/ignore-inbound-ports-4190,4191,8000:8010" -j RETURN',
        f"-A {REDIRECT_CHAIN} -p tcp -m comment --comment"
        ' "meshlet-init/redirect-all-incoming-to-proxy-port" -j REDIRECT --to-ports 14143',
    ]


def test_long_port_lists_are_split_for_multiport() -> None:
    rules = [
        r
        for r in plan(CONFIGS["long-port-lists"]).rules
        if r.chain == OUTPUT_CHAIN and r.matches and r.matches[0].name == "multiport"
    ]
    assert len(rules) == 2
    listed = [rule.matches[0].options[0][1].split(",") for rule in rules]
    for ports in listed:
        assert sum(2 if ":" in p else 1 for p in ports) <= 15
    assert ",".join(listed[0] + listed[1]) == ",".join(
        [str(p) for p in range(1000, 1017)] + ["2000:2010", "3000:3001", "4000:4100"]
    )


def test_jumps_come_from_prerouting_and_output() -> None:
    assert [(j.chain, j.target) for j in plan(InitConfig()).jumps] == [
        ("PREROUTING", REDIRECT_CHAIN),
        ("OUTPUT", OUTPUT_CHAIN),
    ]
