"""The iptables plan: golden output, port parsing, idempotence."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from meshlet.init.plan import InitConfig, PlanError, parse_ports, plan

GOLDEN = Path(__file__).parent / "golden"


def test_default_plan(golden: Callable[[Path, str], None]) -> None:
    golden(GOLDEN / "plan-default.rules", "\n".join(plan(InitConfig())) + "\n")


def test_local_mesh_plan(golden: Callable[[Path, str], None]) -> None:
    config = InitConfig(
        proxy_gid=2102,
        skip_inbound_ports=("4190", "4191", "22"),
        skip_outbound_ports=parse_ports("443,5000-5010"),
    )
    golden(GOLDEN / "plan-gid-and-skips.rules", "\n".join(plan(config)) + "\n")


def test_long_port_lists_are_split_for_multiport() -> None:
    ports = parse_ports(",".join(str(p) for p in range(1000, 1020)) + ",2000-2010")
    rules = [
        r for r in plan(InitConfig(skip_outbound_ports=ports)) if "OUTPUT -p tcp -m multiport" in r
    ]
    assert len(rules) == 2
    for rule in rules:
        listed = rule.split("--dports ")[1].split(" ")[0].split(",")
        assert sum(2 if ":" in p else 1 for p in listed) <= 15


def test_jumps_are_not_added_twice() -> None:
    first = plan(InitConfig())
    current = "\n".join(first)  # what iptables-save would show after applying it
    second = plan(InitConfig(), current)
    assert [r for r in second if r.startswith(("-A PREROUTING", "-A OUTPUT"))] == []
    assert len(second) == len(first) - 2


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", ()),
        ("25", ("25",)),
        (" 25, 587 ,4000-4010", ("25", "587", "4000:4010")),
        ("7-7", ("7",)),
    ],
)
def test_parse_ports(text: str, expected: tuple[str, ...]) -> None:
    assert parse_ports(text) == expected


def test_parse_ports_lists_every_error() -> None:
    with pytest.raises(PlanError, match=r"'0' is outside.*'x' is not a port.*'9-3'"):
        parse_ports("0,x,9-3,80")
