"""The iptables plan (pure): which nat rules route a pod's TCP through its proxy.

A `Plan` is the content meshlet-init wants in the nat table: its two chains with their rules, and
one jump into each from a built-in chain. IPv4 and IPv6 get the same plan, each in its own nat
table (iptables and ip6tables), except for the ignored networks, each in its family's. Every rule
is a typed `Rule` commented `meshlet-init/<purpose>`; `Plan.lines()` renders it as
`iptables-restore` input, in the form `iptables-save` prints it back (what --simulate shows and the
golden files hold). `changes.py` turns a plan into the steps that bring a live table there; the
appliers carry them out.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from ipaddress import IPv4Network, IPv6Network
from typing import Final

from meshlet.api import wellknown
from meshlet.api.ports import PortRange, PortRanges

REDIRECT_CHAIN: Final = "PROXY_INIT_REDIRECT"
OUTPUT_CHAIN: Final = "PROXY_INIT_OUTPUT"
OUR_CHAINS: Final = (REDIRECT_CHAIN, OUTPUT_CHAIN)
COMMENT_PREFIX: Final = "meshlet-init/"
MULTIPORT_MAX: Final = 15  # ports per multiport match; a range counts as two
NO_PORTS: Final = PortRanges()
ALWAYS_SKIPPED_INBOUND: Final = PortRanges(
    (
        PortRange(wellknown.PROXY_CONTROL_PORT, wellknown.PROXY_CONTROL_PORT),
        PortRange(wellknown.PROXY_ADMIN_PORT, wellknown.PROXY_ADMIN_PORT),
    )
)


@dataclass(frozen=True, slots=True)
class InitConfig:
    inbound_port: int = wellknown.PROXY_INBOUND_PORT
    outbound_port: int = wellknown.PROXY_OUTBOUND_PORT
    proxy_uid: int = wellknown.PROXY_UID
    proxy_gid: int | None = None
    # Incoming destination ports not redirected to the proxy.
    skip_inbound_ports: PortRanges = ALWAYS_SKIPPED_INBOUND
    # Outgoing destination ports and networks not redirected to the proxy.
    skip_outbound_ports: PortRanges = NO_PORTS
    skip_subnets: tuple[IPv4Network | IPv6Network, ...] = ()


@dataclass(frozen=True, slots=True)
class Match:
    """An iptables match module and its options, e.g. `owner` with (("uid-owner", "2102"),)."""

    name: str
    options: tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class Rule:
    """One rule appended to `chain`, commented `meshlet-init/<purpose>`."""

    chain: str
    purpose: str
    target: str
    target_options: tuple[tuple[str, str], ...] = ()
    destination: IPv4Network | IPv6Network | None = None
    out_interface: str | None = None
    protocol: str | None = None
    matches: tuple[Match, ...] = ()

    @property
    def comment(self) -> str:
        return COMMENT_PREFIX + self.purpose

    def render(self) -> str:
        """The rule as `iptables-save` prints it: `-A CHAIN [-d] [-o] [-p] [-m ...] -j TARGET`."""
        parts = [f"-A {self.chain}"]
        if self.destination is not None:
            parts.append(f"-d {self.destination}")
        if self.out_interface is not None:
            parts.append(f"-o {self.out_interface}")
        if self.protocol is not None:
            parts.append(f"-p {self.protocol}")
        for match in self.matches:
            parts.append(f"-m {match.name}" + _options(match.options))
        parts.append(f'-m comment --comment "{self.comment}"')
        parts.append(f"-j {self.target}" + _options(self.target_options))
        return " ".join(parts)


@dataclass(frozen=True, slots=True)
class Plan:
    chains: tuple[str, ...]  # our chains, created or flushed
    rules: tuple[Rule, ...]  # their rules, in order
    jumps: tuple[Rule, ...]  # one rule per built-in chain that jumps into ours

    def lines(self) -> list[str]:
        """`iptables-restore` input for the nat table."""
        return [
            "*nat",
            *(f":{chain} - [0:0]" for chain in self.chains),
            *(rule.render() for rule in (*self.rules, *self.jumps)),
            "COMMIT",
        ]


def plan(config: InitConfig, ipv6: bool = False) -> Plan:
    """The rules of DESIGN §7: inbound TCP to the proxy's inbound port except the skipped ports;
    outbound TCP to its outbound port except the proxy's own, loopback, skipped networks and
    skipped ports. `ipv6`: the plan of the IPv6 table (its family's skipped networks only)."""
    version = 6 if ipv6 else 4
    redirect = (
        *_skips(REDIRECT_CHAIN, config.skip_inbound_ports, "inbound"),
        Rule(
            REDIRECT_CHAIN,
            "redirect-all-incoming-to-proxy-port",
            "REDIRECT",
            (("to-ports", str(config.inbound_port)),),
            protocol="tcp",
        ),
    )
    output = [_owner("uid", config.proxy_uid)]
    if config.proxy_gid is not None:
        output.append(_owner("gid", config.proxy_gid))
    output.append(Rule(OUTPUT_CHAIN, "ignore-loopback", "RETURN", out_interface="lo"))
    output += (
        Rule(OUTPUT_CHAIN, f"ignore-subnet-{subnet}", "RETURN", destination=subnet)
        for subnet in config.skip_subnets
        if subnet.version == version
    )
    output += _skips(OUTPUT_CHAIN, config.skip_outbound_ports, "outbound")
    output.append(
        Rule(
            OUTPUT_CHAIN,
            "redirect-all-outgoing-to-proxy-port",
            "REDIRECT",
            (("to-ports", str(config.outbound_port)),),
            protocol="tcp",
        )
    )
    return Plan(
        chains=OUR_CHAINS,
        rules=(*redirect, *output),
        jumps=(
            Rule("PREROUTING", "install-proxy-init-prerouting", REDIRECT_CHAIN),
            Rule("OUTPUT", "install-proxy-init-output", OUTPUT_CHAIN),
        ),
    )


def multiport(ranges: Iterable[PortRange]) -> list[str]:
    """Port ranges as a multiport match writes them: `25`, `4000:4010`."""
    return [str(r.first) if r.first == r.last else f"{r.first}:{r.last}" for r in ranges]


def _owner(kind: str, owner: int) -> Rule:
    return Rule(
        OUTPUT_CHAIN,
        f"ignore-proxy-{kind}",
        "RETURN",
        matches=(Match("owner", ((f"{kind}-owner", str(owner)),)),),
    )


def _skips(chain: str, ports: PortRanges, direction: str) -> list[Rule]:
    rules = []
    for chunk in _chunks(ports.ranges):
        listed = ",".join(multiport(chunk))
        rules.append(
            Rule(
                chain,
                f"ignore-{direction}-ports-{listed}",
                "RETURN",
                protocol="tcp",
                matches=(Match("multiport", (("dports", listed),)),),
            )
        )
    return rules


def _chunks(ranges: Sequence[PortRange]) -> Iterable[list[PortRange]]:
    chunk: list[PortRange] = []
    weight = 0
    for item in ranges:
        cost = 1 if item.first == item.last else 2
        if weight + cost > MULTIPORT_MAX:
            yield chunk
            chunk, weight = [], 0
        chunk.append(item)
        weight += cost
    if chunk:
        yield chunk


def _options(options: tuple[tuple[str, str], ...]) -> str:
    return "".join(f" --{name} {value}" for name, value in options)
